#!/usr/bin/env python3
"""bench_route_picks.py - which requests of a tools/bench_route.sh run computed
a shared prefix again, and the pick's terms for each (docs/bench.md "Why
"on" ranged ...").

    tools/bench_route_picks.py build/bench_route/on.1 [more run dirs]

Reads MODE.ROUND/rt.log (the router's "pick:", "-> decode" and "done" lines,
--log-level debug) and pf*.log (each prefill node's per-request "computed").
A request's kind comes from its length: the class's feedback prompt is its
analysis prompt plus 553 tokens (the default templates, qwen3-mini's
tokenizer), and the two share their first 6 tokens only. A request that
computed its kind's prefix (1,562 / 2,116 positions, the default templates)
is the first on its decode node or a recompute; each recompute is printed
with every candidate's wait, plan and held positions. Another model or
template: pass PREFIXES=A,F and DELTA=n in the environment.
"""
import glob
import os
import re
import sys

PRE = dict(zip("AF", map(int, os.environ.get("PREFIXES", "1562,2116").split(","))))
DELTA = int(os.environ.get("DELTA", "553"))
PICK = re.compile(r"req=(\w+) pick: decode (\S+) wait ([\d.]+) ms \(ahead (\d+), (\d+) slots, hold (\d+) ms\) "
                  r"\+ plan ([\d.]+) ms \(held (\d+) of (\d+), (\w+)( via prefill)?(?:, work ahead ([\d.]+) ms)?\) "
                  r"= ([\d.]+)")
ROUTE = re.compile(r"req=(\w+) model \S+ -> decode .*?(held (\d+) on decode / (\d+) on prefill)?( via prefill|$)")


def fields(line):
    return dict(re.findall(r" (\w+)=(\S+)", line))


def run(d):
    pf = {}
    for f in glob.glob(d + "/pf*.log"):
        for line in open(f):
            if " done tokens=" in line:
                pf[re.search(r"req=(\w+)", line).group(1)] = int(fields(line)["computed"])
    picks, plans, done, order = {}, {}, {}, []
    for line in open(d + "/rt.log"):
        m = PICK.search(line)
        if m:
            picks.setdefault(m.group(1), []).append(m)
            if m.group(1) not in order:
                order.append(m.group(1))
        m = ROUTE.search(line) if " -> decode " in line else None
        if m:
            plans[m.group(1)] = (int(m.group(3) or 0), int(m.group(4) or 0))
        if " done status=" in line:
            done[re.search(r"req=(\w+)", line).group(1)] = fields(line)
    lens = {int(k["prompt"]) for k in done.values()}
    total, seen, out = 0, set(), []
    for r in order:
        if r not in done:
            continue
        k = done[r]
        n = int(k["prompt"])
        kind = "A" if n + DELTA in lens else "F" if n - DELTA in lens else "?"
        computed = int(k["computed_local"]) + pf.get(r, 0)
        total += computed
        if kind not in PRE or computed - (n - PRE[kind]) < 64:
            continue
        node = k["decode"]
        if (node, kind) not in seen:
            seen.add((node, kind))
            continue
        hd, hp = plans.get(r, (0, 0))
        if k["plan"] == "split":
            why = "busy session: plan counted %d held on prefill" % hp if hp >= PRE[kind] - 64 else \
                  "split to a session holding nothing (decode held %d): the estimate's choice" % hd
        else:
            why = "local: plan counted %d held on decode, not there" % hd if hd >= PRE[kind] - 64 else \
                  "local where nothing was held: the estimate's choice"
        out.append("  %s %s prompt %d -> %s %s %s: computed %d (%s)" % (r, kind, n, node, k["plan"], k.get("prefill", ""),
                                                                       computed, why))
        for m in picks[r]:
            out.append("      %s wait %s ms (ahead %s, %s slots, hold %s ms) + plan %s ms (held %s, %s%s, work ahead %s ms)"
                       " = %s ms" % (m.group(2), m.group(3), m.group(4), m.group(5), m.group(6), m.group(7), m.group(8),
                                     m.group(10), m.group(11) or "", m.group(12) or "-", m.group(13)))
    print("== %s: %d positions computed, %d prefix recomputes" % (d, total, sum(1 for x in out if not x.startswith("    "))))
    print("\n".join(out))


for d in sys.argv[1:]:
    run(d)
