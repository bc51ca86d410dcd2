#!/usr/bin/env python3
"""Which router decisions explain tandem's excursions from a golden on a
quantized MoE fixture (qwen3moe-mini-Q4_K_M), measured with f64_forward.py's
float64 forward run as ggml rounds (--actq --kv16: activations quantized to
8 bits as each weight type's vec_dot type wants, f16 KV cache).

  moe_ties.py MODEL.gguf GOLDEN.jsonl TRACE_DIR [--prompts A,B] [--runs N]
              [--over TOL] [--tries N]

TRACE_DIR holds, per prompt NAME, tandem's own run teacher-forced on the
golden's tokens, from moe_trace.c (beside this file; it says how to build it):
tr_NAME.txt (per position and layer: the experts tandem chose, its k-th minus
(k+1)-th router logit, the router logits) and lg_NAME.f32 (its logits per step).

It prints:
1. The noise of 8-bit activations in the router, per layer: how far tandem's
   k-th minus (k+1)-th router logit gap is from the float64 forward's with the
   same expert choices everywhere (what f32 against float64 rounding does
   through the 8-bit levels), and how far the float64 forward moves when every
   activation is moved by a random 2^-22 relative before it is quantized
   (--jitter: a few f32 ulps, what another summation order gives). The largest
   of the first per layer is the layer's bound: a decision whose gap is below
   it may go either way in any f32 implementation that quantizes activations.
2. Per step over TOL from the golden: tandem's distance, the float64
   forward's on its own routing, and over N jittered runs (min / median /
   max, how many over TOL); then the router decisions at the step's position
   or before whose gap in tandem's run is below the layer's bound, tried one
   at a time (the smallest gap relative to its bound first, at most --tries)
   in the float64 forward on tandem's routing with that decision's k-th and
   (k+1)-th experts swapped: those that bring the step within TOL are printed
   with the gap, the probability margin (k-th minus (k+1)-th router
   probability) and the step's distance after the swap.
Measurements made with it: tests/data/README.md, "Tolerances".
"""
import sys

import numpy as np

import f64_forward as F

FLAGS = {'--actq', '--kv16'}
PAIRS = 16   # --pairs: how many decisions the two-at-once search takes


def load_trace(path):
    """{(position, layer): (experts, gap, router logits)} from moe_trace.c's file."""
    d = {}
    for line in open(path):
        a = line.split()
        d[(int(a[0]), int(a[1]))] = ([int(e) for e in a[2].split(',')], float(a[3]),
                                     np.array([float(v) for v in a[4:]]))
    return d


def gap_of(lg, order, K):
    return lg[order[K - 1]] - lg[order[K]]


def prob_margin(lg, K):
    o = np.argsort(-lg, kind='stable')
    p = np.exp(lg - lg.max())
    p /= p.sum()
    return p[o[K - 1]] - p[o[K]]


def noise(model, prompts, K, L, runs):
    """Per layer: |gap(tandem) - gap(f64)| and |gap(f64 jittered) - gap(f64)|, tandem's routing."""
    dt = {l: [] for l in range(L)}
    dj = {l: [] for l in range(L)}
    for rec, tr, _ in prompts:
        ids = rec['prompt_ids'] + rec['generated_ids']
        route = {key: v[0] for key, v in tr.items()}
        F.JITTER = None
        _, s0 = F.forward(model, ids, len(rec['prompt_ids']), FLAGS, route)
        s1 = []
        for seed in range(runs):
            F.JITTER = np.random.default_rng(seed)
            s1.append(F.forward(model, ids, len(rec['prompt_ids']), FLAGS, route)[1])
        F.JITTER = None
        for key, (_, _, tl) in tr.items():
            o = np.argsort(-tl, kind='stable')
            g0 = gap_of(s0[key][2], o, K)
            dt[key[1]].append(abs(gap_of(tl, o, K) - g0))
            dj[key[1]].extend(abs(gap_of(s[key][2], o, K) - g0) for s in s1)
    bound = {}
    for l in range(L):
        a, b = np.array(dt[l]), np.array(dj[l])
        bound[l] = float(a.max())
        print('layer %d (%d decisions): |gap tandem - gap f64| p50 %.4f p95 %.4f max %.4f; '
              'f64 jittered p50 %.4f p95 %.4f max %.4f' %
              (l, len(a), np.median(a), np.percentile(a, 95), a.max(), np.median(b), np.percentile(b, 95), b.max()))
    return bound


def explain(model, rec, tr, tl, K, L, bound, runs, over, tries, only=None):
    steps = rec['steps']
    ids = rec['prompt_ids'] + rec['generated_ids']
    n_p = len(ids) - len(rec['generated_ids'])
    route = {key: v[0] for key, v in tr.items()}
    F.JITTER = None
    own = F.forward(model, ids, n_p, FLAGS)[0]
    jit = []
    for seed in range(runs):
        F.JITTER = np.random.default_rng(1000 + seed)
        jit.append(F.forward(model, ids, n_p, FLAGS))
    F.JITTER = None
    for k, st in enumerate(steps[:len(own)]):
        dt = F.step_dist(tl[k], st)
        if dt <= over or (only is not None and k not in only):
            continue
        t = n_p - 1 + k
        dj = np.array([F.step_dist(j[0][k], st) for j in jit])
        print('%s step %d: tandem %.3f, f64 %.3f, jittered f64 %.3f / %.3f / %.3f (%d of %d over %.2f)' %
              (rec['name'], k, dt, F.step_dist(own[k], st), dj.min(), np.median(dj), dj.max(),
               int((dj > over).sum()), runs, over))
        cand = sorted((tr[key][1] / bound[key[1]], key) for key in tr if key[0] <= t and tr[key][1] < bound[key[1]])
        found = 0
        for _, key in cand[:tries]:
            o = np.argsort(-tr[key][2], kind='stable')
            alt = [int(e) for e in o[:K - 1]] + [int(o[K])]
            ro = dict(route)
            ro[key] = alt
            d = F.step_dist(F.forward(model, ids[:t + 2], n_p, FLAGS, ro)[0][k], st)
            if d <= over:
                found += 1
                print('    position %d layer %d: gap %.4f (bound %.3f), probability margin %.4f: %s -> %s gives %.3f' %
                      (key[0], key[1], tr[key][1], bound[key[1]], prob_margin(tr[key][2], K),
                       sorted(tr[key][0]), sorted(alt), d))
        print('    %d of %d decisions below the bound tried, %d bring the step within %.2f' %
              (min(len(cand), tries), len(cand), found, over))
        if found:
            continue
        # the routing of a jittered run that is within TOL here: where it
        # differs from tandem's up to this position, and tandem's gaps there
        best = None
        for j in jit:
            if F.step_dist(j[0][k], st) > over:
                continue
            diff = sorted(key for key in tr if key[0] <= t and set(j[1][key][0]) != set(tr[key][0]))
            if best is None or len(diff) < len(best[1]):
                best = (j, diff)
        if best is None:
            pairs = [key for _, key in cand[:int(PAIRS)]]
            hits = []
            for a in range(len(pairs)):
                for b in range(a + 1, len(pairs)):
                    ro = dict(route)
                    for key in (pairs[a], pairs[b]):
                        o = np.argsort(-tr[key][2], kind='stable')
                        ro[key] = [int(e) for e in o[:K - 1]] + [int(o[K])]
                    d = F.step_dist(F.forward(model, ids[:t + 2], n_p, FLAGS, ro)[0][k], st)
                    if d <= over:
                        hits.append('%d/L%d:%.4f + %d/L%d:%.4f -> %.3f' % (pairs[a] + (tr[pairs[a]][1],) + pairs[b] +
                                                                           (tr[pairs[b]][1], d)))
            print('    no jittered run within %.2f; two decisions swapped at once (of the %d smallest gaps '
                  'relative to their bound): %d of %d pairs bring the step within it%s' %
                  (over, len(pairs), len(hits), len(pairs) * (len(pairs) - 1) // 2,
                   (': ' + '; '.join(hits[:6])) if hits else ''))
            continue
        j, diff = best
        ro = dict(route)
        for key in diff:
            ro[key] = j[1][key][0]
        d = F.step_dist(F.forward(model, ids[:t + 2], n_p, FLAGS, ro)[0][k], st)
        # roots: decisions no other differing decision feeds (one at an earlier
        # or the same position in a lower layer); the rest follow from them
        roots = [a for a in diff if not any(b != a and b[0] <= a[0] and b[1] < a[1] for b in diff)]
        worst = max(tr[key][1] / bound[key[1]] for key in roots) if roots else 0.0
        print('    a jittered run within %.2f differs from tandem at %d decisions up to here; tandem\'s routing '
              'with those: %.3f; roots (position/layer: tandem\'s gap) %s, the largest %.2f of its bound' %
              (over, len(diff), d, ' '.join('%d/L%d:%.4f' % (key[0], key[1], tr[key][1]) for key in roots), worst))


def main():
    F.VALUED = F.VALUED + ('--prompts', '--runs', '--over', '--tries', '--steps', '--bound', '--pairs')
    flags, opts, pos = F.parse_args(sys.argv[1:])
    if len(pos) != 3:
        sys.exit(__doc__)
    mpath, gpath, tdir = pos
    global PAIRS
    PAIRS = int(opts.get('--pairs', PAIRS))
    runs, over, tries = int(opts.get('--runs', 12)), float(opts.get('--over', 0.6)), int(opts.get('--tries', 60))
    model = F.read_gguf(mpath)
    meta = model[0]
    A = meta['general.architecture']
    L, K = meta[A + '.block_count'], meta[A + '.expert_used_count']
    V = model[1]['token_embd.weight'].shape[0]
    names = opts['--prompts'].split(',') if '--prompts' in opts else \
        [r['name'] for r in map(F.json.loads, open(gpath)) if r.get('type') == 'prompt']
    prompts = []
    for name in names:
        rec = F.load_prompt(gpath, name)
        tl = np.fromfile('%s/lg_%s.f32' % (tdir, name), np.float32).reshape(-1, V)
        prompts.append((rec, load_trace('%s/tr_%s.txt' % (tdir, name)), tl))
    if '--bound' in opts:   # the layers' bounds as a previous run printed them, comma-separated
        bound = dict(enumerate(float(b) for b in opts['--bound'].split(',')))
    else:
        bound = noise(model, prompts, K, L, 3)
    only = {}   # --steps NAME:K,NAME:K: only these steps
    for item in filter(None, opts.get('--steps', '').split(',')):
        nm, k = item.rsplit(':', 1)
        only.setdefault(nm, set()).add(int(k))
    for rec, tr, tl in prompts:
        if only and rec['name'] not in only:
            continue
        explain(model, rec, tr, tl, K, L, bound, runs, over, tries, only.get(rec['name']))
        sys.stdout.flush()


if __name__ == '__main__':
    main()
