#!/usr/bin/env python3
"""A third, exact oracle for the generated qwen3/qwen3moe fixtures: the model's
forward pass in float64 (numpy), teacher-forced on a golden record's prompt
and generated ids, optionally rounding where an implementation rounds, to
tell which rounding explains a distance.

  f64_forward.py MODEL.gguf GOLDEN.jsonl PROMPT_NAME [--out LOGITS.npy]
                 [--kv16] [--act16] [--moe16] [--q16] [--p16]

--kv16   K and V rounded to f16 (an f16 KV cache, as the goldens use)
--act16  every F16 product's input rounded to f16 (mainline ggml)
--moe16  only the MoE experts' inputs rounded to f16 (ik_llama.cpp and
         tandem's CPU backend)
--q16 / --p16  the attention's Q / probabilities rounded to f16

Prints, per step, the largest |logit - golden| over the golden's top 10 and
this forward's argmax, the median and max, and the smallest k-th/(k+1)-th
router logit gaps over every position and layer (a near-tie at an earlier
position changes the KV of all later steps). F16/F32 weights only; needs
numpy (the oracle venv of make_goldens.py has it). Measurements made with
it: tests/data/README.md, "moe-divergence.jsonl".
"""
import json
import struct
import sys

import numpy as np


def read_gguf(path):
    buf = open(path, 'rb').read()
    o = 4
    def rd(fmt):
        nonlocal o
        v = struct.unpack_from('<' + fmt, buf, o)
        o += struct.calcsize('<' + fmt)
        return v
    def rs():
        nonlocal o
        (n,) = rd('Q')
        s = buf[o:o + n].decode('utf-8', 'replace')
        o += n
        return s
    def rv(t):
        if t == 8:
            return rs()
        if t == 9:
            (at, n) = rd('IQ')
            return [rv(at) for _ in range(n)]
        return rd({0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q', 11: 'q', 12: 'd'}[t])[0]
    if buf[:4] != b'GGUF':
        sys.exit('%s: not a GGUF file' % path)
    _, nt, nkv = rd('IQQ')
    meta = {}
    for _ in range(nkv):
        k = rs()
        (t,) = rd('I')
        meta[k] = rv(t)
    infos = []
    for _ in range(nt):
        name = rs()
        (nd,) = rd('I')
        ne = rd('Q' * nd)
        ty, off = rd('IQ')
        infos.append((name, ne, ty, off))
    al = meta.get('general.alignment', 32)
    base = (o + al - 1) // al * al
    T = {}
    for name, ne, ty, off in infos:
        if ty not in (0, 1):
            sys.exit('%s: tensor %s is neither F32 nor F16' % (path, name))
        n = int(np.prod(ne))
        a = np.frombuffer(buf, dtype=np.float16 if ty == 1 else np.float32, count=n, offset=base + off)
        T[name] = a.astype(np.float64).reshape(tuple(reversed(ne)))
    return meta, T


def main():
    a = sys.argv[1:]
    flags = {f for f in a if f.startswith('--') and f != '--out'}
    out = a[a.index('--out') + 1] if '--out' in a else None
    pos_args = [x for i, x in enumerate(a) if not x.startswith('--') and (i == 0 or a[i - 1] != '--out')]
    if len(pos_args) != 3:
        sys.exit(__doc__)
    mpath, gpath, pname = pos_args
    meta, T = read_gguf(mpath)
    A = meta['general.architecture']
    L, nh, nkvh = meta[A + '.block_count'], meta[A + '.attention.head_count'], meta[A + '.attention.head_count_kv']
    hd = meta[A + '.attention.key_length']
    eps, fb = meta[A + '.attention.layer_norm_rms_epsilon'], meta[A + '.rope.freq_base']
    K = meta.get(A + '.expert_used_count', 0)
    rec = None
    for line in open(gpath):
        r = json.loads(line)
        if r.get('type') == 'prompt' and r.get('name') == pname:
            rec = r
    if rec is None:
        sys.exit('%s: no prompt named %s' % (gpath, pname))
    ids = rec['prompt_ids'] + rec['generated_ids']
    n_p, n = len(rec['prompt_ids']), len(ids)

    def f16(x):
        return x.astype(np.float16).astype(np.float64)

    def mm(W, x, moe=False):   # W (out, in), x (n, in)
        if '--act16' in flags or (moe and '--moe16' in flags):
            x = f16(x)
        return x @ W.T

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos):   # NEOX: pairs (i, i + hd/2)
        half = hd // 2
        ang = pos[:, None] * (fb ** (-np.arange(half) * 2.0 / hd))[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = T['token_embd.weight'][ids]
    pos = np.arange(n, dtype=np.float64)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    gaps = []
    for il in range(L):
        p = 'blk.%d.' % il
        h = rms(x, T[p + 'attn_norm.weight'])
        q = mm(T[p + 'attn_q.weight'], h).reshape(n, nh, hd)
        k = mm(T[p + 'attn_k.weight'], h).reshape(n, nkvh, hd)
        v = mm(T[p + 'attn_v.weight'], h).reshape(n, nkvh, hd)
        q = rope(rms(q, T[p + 'attn_q_norm.weight']), pos)
        k = rope(rms(k, T[p + 'attn_k_norm.weight']), pos)
        if '--kv16' in flags:
            k, v = f16(k), f16(v)
        att = np.zeros((n, nh, hd))
        for hh in range(nh):
            g = hh // (nh // nkvh)
            qq = f16(q[:, hh, :]) if '--q16' in flags else q[:, hh, :]
            sc = qq @ k[:, g, :].T / np.sqrt(hd) + mask
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            if '--p16' in flags:
                sc = f16(sc)
            att[:, hh, :] = sc @ v[:, g, :]
        x = x + mm(T[p + 'attn_output.weight'], att.reshape(n, nh * hd))
        h = rms(x, T[p + 'ffn_norm.weight'])
        if not K:
            gt, ut = mm(T[p + 'ffn_gate.weight'], h), mm(T[p + 'ffn_up.weight'], h)
            x = x + mm(T[p + 'ffn_down.weight'], gt / (1 + np.exp(-gt)) * ut)
            continue
        lg = h @ T[p + 'ffn_gate_inp.weight'].T
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        y = np.zeros_like(x)
        for t in range(n):
            order = np.argsort(-lg[t], kind='stable')
            sel = order[:K]
            gaps.append((lg[t][order[K - 1]] - lg[t][order[K]], il, t, [int(e) for e in sel]))
            w = pr[t][sel] / pr[t][sel].sum()
            for e, we in zip(sel, w):
                ht = h[t:t + 1]
                gt = mm(T[p + 'ffn_gate_exps.weight'][e], ht, True)
                ut = mm(T[p + 'ffn_up_exps.weight'][e], ht, True)
                y[t] += we * mm(T[p + 'ffn_down_exps.weight'][e], gt / (1 + np.exp(-gt)) * ut, True)[0]
        x = x + y
    x = rms(x, T['output_norm.weight'])
    out_w = T['output.weight'] if 'output.weight' in T else T['token_embd.weight']
    logits = x[n_p - 1:n - 1] @ out_w.T
    if out:
        np.save(out, logits.astype(np.float32))
    worst = []
    for k, st in enumerate(rec['steps'][:len(logits)]):
        d = max(abs(logits[k][i] - v) for i, v in st['top10'])
        worst.append(d)
        print('step %2d |dlogit| %.4f argmax %d (golden %d)' % (k, d, int(np.argmax(logits[k])), rec['generated_ids'][k]))
    print('median %.4f max %.4f' % (float(np.median(worst)), max(worst)))
    if gaps:
        gaps.sort()
        print('smallest router gaps (k-th minus (k+1)-th logit), layer, position (prompt: 0..%d), chosen:' % (n_p - 1))
        for g in gaps[:8]:
            print('  %.5f layer %d position %d %s' % tuple(g))


if __name__ == '__main__':
    main()
