#!/usr/bin/env python3
"""How far apart two golden files (the fixture format) for the same model and
prompts are: the distance between two oracles, as tests/data/README.md's
"Tolerances" table reports it.

  python3 compare_goldens.py A.jsonl B.jsonl [--steps]

Each oracle teacher-forces on its own greedy tokens, so step k of a prompt is
comparable only while both oracles' tokens 0..k-1 agree (the same context);
from a prompt's first differing token on, its steps are not compared (the
differing step itself is: its context is still shared).  Per compared step:
the largest |dlogit| over the ids in both top-10 lists (ids in only one
list are counted, not measured: each file stores only its own top 10), and
the relative difference of the L2 norms of all logits.  Prints median, p95
and max per file, the divergences (prompt, step, the top-1/top-2 gap there
in A), and with --steps every compared step.  Standard library only.
"""
import json
import sys


def load(path):
    lines = [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]
    return lines[0], {p["name"]: p for p in lines[1:] if p.get("type") == "prompt"}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    show = "--steps" in sys.argv
    ha, pa = load(args[0])
    hb, pb = load(args[1])
    if ha.get("model_sha256") != hb.get("model_sha256"):
        sys.exit("different model files")
    diffs, l2s, missing, total, divs = [], [], 0, 0, []
    for name, a in pa.items():
        b = pb.get(name)
        if not b or a["prompt_ids"] != b["prompt_ids"]:
            print(f"{name}: prompt ids differ or prompt missing, skipped")
            continue
        ga, gb = a["generated_ids"], b["generated_ids"]
        for k, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
            if ga[:k] != gb[:k]:
                break
            ta, tb = dict((i, v) for i, v in sa["top10"]), dict((i, v) for i, v in sb["top10"])
            common = set(ta) & set(tb)
            missing += 20 - 2 * len(common)
            d = max(abs(ta[i] - tb[i]) for i in common) if common else float("inf")
            r = abs(sa["logit_l2"] - sb["logit_l2"]) / sa["logit_l2"]
            diffs.append(d)
            l2s.append(r)
            total += 1
            gap = sa["top10"][0][1] - sa["top10"][1][1]
            if show:
                print(f"  {name} step {k}: |dlogit| {d:.4f} L2 rel {r:.5f} gap(A) {gap:.4f}")
            if ga[k] != gb[k]:
                gapb = sb["top10"][0][1] - sb["top10"][1][1]
                divs.append(f"{name} step {k} (gap A {gap:.3f}, B {gapb:.3f}, |dlogit| {d:.3f})")
    print(f"{args[0]} vs {args[1]}: {total} steps compared; |dlogit| median {pct(diffs, .5):.4f} "
          f"p95 {pct(diffs, .95):.4f} max {max(diffs):.4f}; L2 rel median {pct(l2s, .5):.5f} "
          f"max {max(l2s):.5f}; top-10 ids in one list only: {missing}")
    print(f"  greedy divergences ({len(divs)}): " + "; ".join(divs))


if __name__ == "__main__":
    main()
