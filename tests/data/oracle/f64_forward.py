#!/usr/bin/env python3
"""A third, exact oracle for the qwen3/qwen3moe fixtures: the model's
forward pass in float64 (numpy), teacher-forced on a golden record's prompt
and generated ids, optionally rounding where an implementation rounds, to
tell which rounding explains a distance.

  f64_forward.py MODEL.gguf GOLDEN.jsonl PROMPT_NAME [--out LOGITS.npy]
                 [--kv16] [--act16] [--moe16] [--q16] [--p16] [--actq]
                 [--jitter SEED] [--force POS:LAYER:E1,E2;...]
                 [--golden2 GOLDEN2.jsonl] [--sel-out FILE]

Weights: F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K (dequantized exactly,
ggml's block layouts). Options:
--kv16   K and V rounded to f16 (an f16 KV cache, as the goldens use)
--act16  every F16 product's input rounded to f16 (mainline ggml)
--moe16  only the MoE experts' inputs rounded to f16 (ik_llama.cpp and
         tandem's CPU backend)
--q16 / --p16  the attention's Q / probabilities rounded to f16
--actq   every product's input quantized as ggml (and tandem, quant.h) does
         for its weight type: Q8_K for the K types, Q8_0 for Q4_0/Q5_0/Q8_0,
         none for F32 (the router); f16 for F16 as mainline does (tandem and
         ik_llama.cpp round only the MoE experts' inputs: --moe16)
--jitter SEED  with --actq: each value moved by a random 2^-22 relative
         before it is quantized (another f32 summation order's few ulps)
--force  use these experts at these (position, layer) pairs
--golden2  also the distance to a second golden while its tokens agree
--sel-out  every (position, layer)'s experts, gap and router logits

Prints, per step, the largest |logit - golden| over the golden's top 10 and
this forward's argmax, the smallest router gap at the step's token, the
median and max, and the smallest k-th/(k+1)-th router logit gaps over every
position and layer (a near-tie at an earlier position changes the KV of all
later steps). Needs numpy (`python3 -m venv build/f64env &&
build/f64env/bin/pip install numpy==2.4.6`, or the oracle venv of make_goldens.py).
Measurements made with it: tests/data/README.md, "moe-divergence.jsonl" and
"why tandem parts from the oracles"; moe_ties.py builds on it.
"""
import json
import struct
import sys

import numpy as np


# ==== ggml block formats (dequantization) ====
# Each: (elements per block, bytes per block, function(raw uint8 array (nb, bytes)) -> (nb, elems) float64)
def _f16(b):
    return b.copy().view(np.float16).astype(np.float64)


def _deq_q8_0(b):   # d f16, qs int8[32]
    return _f16(b[:, 0:2]) * b[:, 2:34].view(np.int8).astype(np.float64)


def _deq_q4_0(b):   # d f16, qs[16]: low nibbles are elements 0-15, high 16-31, minus 8
    q = b[:, 2:18]
    L = np.concatenate([q & 0xF, q >> 4], 1).astype(np.float64) - 8
    return _f16(b[:, 0:2]) * L


def _deq_q5_0(b):   # d f16, qh u32 (bit j: 5th bit of element j), qs[16], minus 16
    qh = b[:, 2:6].copy().view('<u4').astype(np.int64)
    q = b[:, 6:22].astype(np.int64)
    j = np.arange(32)
    hb = (qh >> j) & 1
    L = np.concatenate([q & 0xF, q >> 4], 1) | (hb << 4)
    return _f16(b[:, 0:2]) * (L - 16).astype(np.float64)


def _scale_min_k4(s):   # s (nb, 12) -> sc, m (nb, 8): ggml's get_scale_min_k4
    s = s.astype(np.int64)
    sc = np.empty((s.shape[0], 8), np.int64)
    m = np.empty_like(sc)
    sc[:, :4], m[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def _deq_qk45(b, five):   # d, dmin f16, scales[12], (qh[32]), qs[128]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    o = 16
    if five:
        qh = b[:, 16:48].astype(np.int64)
        o = 48
    qs = b[:, o:o + 128].astype(np.int64).reshape(-1, 4, 32)
    L = np.stack([qs & 0xF, qs >> 4], 2).reshape(-1, 8, 32)   # sub-block j = 2c + (high nibble)
    if five:
        L = L | (((qh[:, None, :] >> np.arange(8)[None, :, None]) & 1) << 4)
    y = d[:, :, None] * sc[:, :, None] * L - dmin[:, :, None] * m[:, :, None]
    return y.reshape(-1, 256)


def _deq_q6_k(b):   # ql[128], qh[64], scales int8[16], d f16
    ql = b[:, 0:128].astype(np.int64).reshape(-1, 2, 64)
    qh = b[:, 128:192].astype(np.int64).reshape(-1, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float64).reshape(-1, 2, 8)
    d = _f16(b[:, 208:210])
    q1 = (ql[:, :, 0:32] & 0xF) | ((qh & 3) << 4)
    q2 = (ql[:, :, 32:64] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    L = np.stack([q1, q2, q3, q4], 2).astype(np.float64) - 32   # (nb, half, 4, 32)
    s = sc.reshape(-1, 2, 4, 2)                                    # scale is = 2 * quarter + l / 16
    y = L.reshape(-1, 2, 4, 2, 16) * s[..., None]
    return d * y.reshape(-1, 256)


# type id: (name, elements per block, bytes per block, dequantizer, vec_dot type of the activations
# ggml multiplies it against: F32 / F16 keep their own, the 32-blocks Q8_0, the K types Q8_K)
QTYPES = {
    0: ('F32', 1, 4, None, 'F32'),
    1: ('F16', 1, 2, None, 'F16'),
    2: ('Q4_0', 32, 18, _deq_q4_0, 'Q8_0'),
    6: ('Q5_0', 32, 22, _deq_q5_0, 'Q8_0'),
    8: ('Q8_0', 32, 34, _deq_q8_0, 'Q8_0'),
    12: ('Q4_K', 256, 144, lambda b: _deq_qk45(b, False), 'Q8_K'),
    13: ('Q5_K', 256, 176, lambda b: _deq_qk45(b, True), 'Q8_K'),
    14: ('Q6_K', 256, 210, _deq_q6_k, 'Q8_K'),
}


# ==== Activation quantization (ggml's reference quantize_row_q8_0 / _q8_K, in f32) ====
JITTER = None   # a numpy Generator: --jitter SEED


def quant_act(x, vt):
    """x (n, k) float64 -> the values an implementation multiplies: x's f32
    rows quantized to vt and dequantized (exact in float64). With --jitter,
    each value is first moved by a random relative 2^-22 at most (a few f32
    ulps: what another summation order gives), so that a run shows which
    8-bit levels, and through them which router decisions, are that fragile."""
    if vt == 'F32':
        return x
    if JITTER is not None:
        x = x * (1 + JITTER.uniform(-2.0 ** -22, 2.0 ** -22, x.shape))
    x = x.astype(np.float32)
    n, k = x.shape
    if vt == 'F16':
        return x.astype(np.float16).astype(np.float64)
    if vt == 'Q8_0':   # d = amax/127 (kept as f16), q = roundf(x * (1/d)), ties away from zero
        b = x.reshape(n, k // 32, 32)
        d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
        with np.errstate(divide='ignore'):
            idd = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = (b * idd).astype(np.float32)
        t = np.trunc(v)   # roundf: ties away from zero (v - t is exact in f32)
        q = t + np.sign(v) * (np.abs(v - t) >= 0.5)
        return (q.astype(np.float64) * d.astype(np.float16).astype(np.float64)).reshape(n, k)
    if vt == 'Q8_K':   # max = signed value of largest |x| (first), iscale = -127/max, q = rint, d = 1/iscale (f32)
        b = x.reshape(n, k // 256, 256)
        mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
        with np.errstate(divide='ignore'):
            isc = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
            d = np.where(mx != 0, np.float32(1) / isc, np.float32(0)).astype(np.float32)
        q = np.minimum(np.rint((isc * b).astype(np.float32)), 127)
        return (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)
    raise ValueError(vt)


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
    T, VT = {}, {}
    for name, ne, ty, off in infos:
        if ty not in QTYPES:
            sys.exit('%s: tensor %s has type %d, which this forward does not read' % (path, name, ty))
        tname, bk, bb, deq, vt = QTYPES[ty]
        n = int(np.prod(ne))
        if deq is None:
            a = np.frombuffer(buf, dtype=np.float16 if ty == 1 else np.float32, count=n, offset=base + off)
            a = a.astype(np.float64)
        else:
            raw = np.frombuffer(buf, dtype=np.uint8, count=n // bk * bb, offset=base + off)
            a = deq(raw.reshape(n // bk, bb)).reshape(-1)
        T[name] = a.reshape(tuple(reversed(ne)))
        VT[name] = vt
    return meta, T, VT


def parse_args(a):
    """flags (set), options with a value (dict), positional arguments."""
    flags, opts, pos = set(), {}, []
    i = 0
    while i < len(a):
        if a[i] in VALUED:
            if i + 1 >= len(a):
                sys.exit(__doc__)
            opts[a[i]] = a[i + 1]
            i += 2
            continue
        if a[i].startswith('--'):
            flags.add(a[i])
        else:
            pos.append(a[i])
        i += 1
    return flags, opts, pos


VALUED = ('--out', '--golden2', '--sel-out', '--force', '--jitter')


def load_prompt(gpath, pname):
    rec = None
    for line in open(gpath):
        r = json.loads(line)
        if r.get('type') == 'prompt' and r.get('name') == pname:
            rec = r
    if rec is None:
        sys.exit('%s: no prompt named %s' % (gpath, pname))
    return rec


def step_dist(logits, st):
    return max(abs(logits[i] - v) for i, v in st['top10'])


def forward(model, ids, n_p, flags, force=None):
    """Teacher-forced pass over ids: the logits of positions n_p-1 .. n-2
    (one per step), and {(position, layer): (experts, k-th minus (k+1)-th
    router logit, router logits)}. force: {(position, layer): experts} used
    instead of the router's choice there."""
    meta, T, VT = model
    A = meta['general.architecture']
    L, nh, nkvh = meta[A + '.block_count'], meta[A + '.attention.head_count'], meta[A + '.attention.head_count_kv']
    hd = meta[A + '.attention.key_length']
    eps, fb = meta[A + '.attention.layer_norm_rms_epsilon'], meta[A + '.rope.freq_base']
    K = meta.get(A + '.expert_used_count', 0)
    force = force or {}
    n = len(ids)

    def f16(x):
        return x.astype(np.float16).astype(np.float64)

    def mm(name, x, moe=False, e=None):   # weight `name` (out, in) (expert e of a 3-D one), x (n, in)
        W = T[name] if e is None else T[name][e]
        if '--actq' in flags:
            x = quant_act(x, VT[name])
        elif '--act16' in flags or (moe and '--moe16' in flags):
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
    sel_all = {}
    for il in range(L):
        p = 'blk.%d.' % il
        h = rms(x, T[p + 'attn_norm.weight'])
        q = mm(p + 'attn_q.weight', h).reshape(n, nh, hd)
        k = mm(p + 'attn_k.weight', h).reshape(n, nkvh, hd)
        v = mm(p + 'attn_v.weight', h).reshape(n, nkvh, hd)
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
        x = x + mm(p + 'attn_output.weight', att.reshape(n, nh * hd))
        h = rms(x, T[p + 'ffn_norm.weight'])
        if not K:
            gt, ut = mm(p + 'ffn_gate.weight', h), mm(p + 'ffn_up.weight', h)
            x = x + mm(p + 'ffn_down.weight', gt / (1 + np.exp(-gt)) * ut)
            continue
        lg = h @ T[p + 'ffn_gate_inp.weight'].T   # an F32 matrix: f32 activations everywhere
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        route = np.zeros((n, T[p + 'ffn_gate_inp.weight'].shape[0]))
        for t in range(n):
            order = np.argsort(-lg[t], kind='stable')
            sel = force.get((t, il), [int(e) for e in order[:K]])
            sel_all[(t, il)] = (sel, float(lg[t][order[K - 1]] - lg[t][order[K]]), lg[t])
            route[t, sel] = pr[t][sel] / pr[t][sel].sum()
        y = np.zeros_like(x)
        for e in range(route.shape[1]):
            rows = np.nonzero(route[:, e])[0]
            if len(rows) == 0:
                continue
            ht = h[rows]
            gt = mm(p + 'ffn_gate_exps.weight', ht, True, e)
            ut = mm(p + 'ffn_up_exps.weight', ht, True, e)
            y[rows] += route[rows, e][:, None] * mm(p + 'ffn_down_exps.weight', gt / (1 + np.exp(-gt)) * ut, True, e)
        x = x + y
    x = rms(x, T['output_norm.weight'])
    out_name = 'output.weight' if 'output.weight' in T else 'token_embd.weight'
    xo = x[n_p - 1:n - 1]
    logits = (quant_act(xo, VT[out_name]) if '--actq' in flags else xo) @ T[out_name].T
    return logits, sel_all


def main():
    flags, opts, pos_args = parse_args(sys.argv[1:])
    if len(pos_args) != 3:
        sys.exit(__doc__)
    mpath, gpath, pname = pos_args
    model = read_gguf(mpath)
    meta = model[0]
    A = meta['general.architecture']
    L, K = meta[A + '.block_count'], meta.get(A + '.expert_used_count', 0)
    if '--jitter' in opts:
        global JITTER
        JITTER = np.random.default_rng(int(opts['--jitter']))
    rec = load_prompt(gpath, pname)
    ids = rec['prompt_ids'] + rec['generated_ids']
    n_p = len(rec['prompt_ids'])
    force = {}   # (position, layer) -> experts, from --force "POS:LAYER:E1,E2;..."
    for item in filter(None, opts.get('--force', '').split(';')):
        ps, ls, es = item.split(':')
        force[(int(ps), int(ls))] = [int(e) for e in es.split(',')]
    logits, sel_all = forward(model, ids, n_p, flags, force)
    if '--out' in opts:
        np.save(opts['--out'], logits.astype(np.float32))
    if '--sel-out' in opts:
        with open(opts['--sel-out'], 'w') as f:
            for (t, il), (sel, gp, lgt) in sorted(sel_all.items()):
                f.write('%d %d %s %.6f %s\n' % (t, il, ','.join(map(str, sel)), gp, ' '.join('%.6f' % v for v in lgt)))
    rec2 = load_prompt(opts['--golden2'], pname) if '--golden2' in opts else None
    worst = []
    for k, st in enumerate(rec['steps'][:len(logits)]):
        d = step_dist(logits[k], st)
        worst.append(d)
        t = n_p - 1 + k   # the position whose logits these are
        g_here = min(sel_all[(t, il)][1] for il in range(L)) if K else float('nan')
        extra = ''
        if rec2 is not None and k < len(rec2['steps']) and rec2['generated_ids'][:k] == rec['generated_ids'][:k]:
            extra = ' golden2 %.4f oracles %.4f' % (step_dist(logits[k], rec2['steps'][k]),
                                                    max(abs(v - dict(rec['steps'][k]['top10']).get(i, v))
                                                        for i, v in rec2['steps'][k]['top10']))
        print('step %2d |dlogit| %.4f argmax %d (golden %d) router gap here %.4f%s' %
              (k, d, int(np.argmax(logits[k])), rec['generated_ids'][k], g_here, extra))
    print('median %.4f max %.4f' % (float(np.median(worst)), max(worst)))
    gaps = sorted((gp, il, t, sel) for (t, il), (sel, gp, _) in sel_all.items())
    if gaps:
        print('smallest router gaps (k-th minus (k+1)-th logit), layer, position (prompt: 0..%d), chosen:' % (n_p - 1))
        for g in gaps[:12]:
            print('  %.5f layer %d position %d %s' % tuple(g))


if __name__ == '__main__':
    main()
