#!/usr/bin/env python3
"""loadtest.py - N concurrent streaming clients (the official `openai` Python
client, one thread each) against a tandem router for a bounded time; prints
requests/s, TTFT and TPOT percentiles, errors.

    build/pyenv/bin/python tools/loadtest.py URL MODEL CLIENTS SECONDS [MAX_TOKENS] [ROUTER_PID]

Each client loops: a streamed completion with a distinct prompt, read to its
end. With ROUTER_PID, the router's RSS is sampled every second (memory must
stay flat). tools/load.sh runs it; tools/pyenv.sh installs the client.
"""
import sys
import threading
import time

import openai

WORDS = ["Once upon a time", "One day", "Lily and Max", "The big dog", "In the park", "A little bird", "The sun was"]


def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def pct(a, p):
    if not a:
        return float("nan")
    s = sorted(a)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    url, model = sys.argv[1], sys.argv[2]
    clients = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 20
    max_tok = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    pid = sys.argv[6] if len(sys.argv) > 6 else None
    # One client object per thread: no retries (an error is a result here).
    mu = threading.Lock()
    st = {"ok": 0, "errors": 0, "tokens": 0, "ttft": [], "tpot": [], "errs": {}}
    end = time.monotonic() + seconds

    def one(c, i, n):
        t0 = time.monotonic()
        stream = c.completions.create(model=model, prompt=f"{WORDS[(i + n) % len(WORDS)]} {i}-{n}", max_tokens=max_tok,
                                      temperature=0.8, seed=n, stream=True)
        first = last = 0.0
        n_tok = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.monotonic()
                first = first or now
                last = now
                n_tok += 1
        with mu:
            if first:
                st["ttft"].append((first - t0) * 1e3)
            if n_tok > 1:
                st["tpot"].append((last - first) * 1e3 / (n_tok - 1))
            st["tokens"] += n_tok

    def client(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key="no-key", max_retries=0, timeout=120)
        n = 0
        while time.monotonic() < end:
            try:
                one(c, i, n)
                with mu:
                    st["ok"] += 1
            except Exception as e:  # counted and named in the summary
                m = f"{type(e).__name__}: {e}"[:120]
                with mu:
                    st["errors"] += 1
                    st["errs"][m] = st["errs"].get(m, 0) + 1
            n += 1

    samples = [rss(pid)] if pid else []
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    while pid and any(t.is_alive() for t in threads):
        time.sleep(1)
        samples.append(rss(pid))
    for t in threads:
        t.join()
    el = time.monotonic() - t0
    print(f"clients {clients}, {el:.1f} s: {st['ok']} ok, {st['errors']} errors, {st['ok'] / el:.2f} req/s, "
          f"{st['tokens'] / el:.1f} tokens/s")
    for name, a in (("TTFT ms", st["ttft"]), ("TPOT ms", st["tpot"])):
        print(f"{name}: p50 {pct(a, 50):.1f}  p90 {pct(a, 90):.1f}  p99 {pct(a, 99):.1f}  max {pct(a, 100):.1f}")
    if pid:
        print(f"router RSS KiB: start {samples[0]}, after 1 s {samples[1] if len(samples) > 1 else -1}, "
              f"end {samples[-1]}, max {max(samples)}")
    for m, c in st["errs"].items():
        print(f"error x{c}: {m}")
    return 1 if st["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
