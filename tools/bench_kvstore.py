#!/usr/bin/env python3
"""bench_kvstore.py - time to first token with the decode node's KV store (issue 43).

A rubric of RUBRIC token ids plus a submission of SUB ids, greedy, one token,
on a `tandem serve --role local` node with --parallel 1 (so the slot never
holds the rubric when it is asked for again) and the store in memory and on
disk. Per round, side by side:
  cold      a rubric never seen (nothing stored): the whole prompt computed;
  ram       the stored rubric + a new submission: the rubric from memory;
  disk      after a restart, with the page cache dropped (as root
            `echo 3 > /proc/sys/vm/drop_caches`, else posix_fadvise DONTNEED on
            the block files): the rubric from the disk itself;
  cat       right after each disk run, the rubric's block files read with
            `cat`, the page cache dropped the same way (the disk's own rate);
  disk-pc   after a restart, the files still in the page cache.
The first round's cold run is the request that stores the rubric. TTFT is
the node's own ttft_ms (arrival to first token); store_ms the time its
loader spent finding, reading, checking and copying the blocks. Every row
notes the load average (1 min) when it was measured.

usage: tools/bench_kvstore.py MODEL.gguf [--rounds N] [--threads N] [--rubric N] [--sub N] [--ctx N]
"""
import argparse, json, os, random, shutil, signal, statistics, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TANDEM = os.environ.get("TANDEM_BIN") or os.path.join(ROOT, "build", "tandem")


def start(a, d, log):
    pf = os.path.join(d, "node.port")
    if os.path.exists(pf):
        os.unlink(pf)
    argv = [TANDEM, "serve", "--role", "local", "-m", a.model, "-t", str(a.threads), "-c", str(a.ctx or a.rubric + a.sub + 64),
            "--parallel", "1", "--kv-cache-ram", str(4 << 30), "--kv-cache-dir", os.path.join(d, "store"),
            "--kv-cache-disk", str(8 << 30), "--listen", "127.0.0.1:0", "--port-file", pf]
    p = subprocess.Popen(argv, stdout=log, stderr=log)
    t0 = time.time()
    while time.time() - t0 < 300:
        if p.poll() is not None:
            sys.exit("node exited; see " + log.name)
        try:
            port = int(open(pf).read().strip())
            if port > 0:
                return p, port
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    sys.exit("node did not start")


def stop(p):
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=300)


def gen(port, ids):
    body = json.dumps({"tokens": ids, "max_tokens": 1, "ignore_eos": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:%d/v1/generate" % port, data=body,
                                                      headers={"Content-Type": "application/json"}), timeout=3600)
    o = json.loads(r.read())
    p = o["prefill"]
    return {"ttft": p["ttft_ms"], "cached": o["usage"]["prompt_tokens_details"]["cached_tokens"],
            "tier": p.get("cache_tier"), "store_ms": p.get("store_ms", 0.0), "computed": p["computed_local"]}


def wait_written(port):
    """Until the node's writer has nothing queued (blocks on disk stop growing)."""
    last, same = -1, 0
    while same < 5:
        m = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port).read().decode()
        v = [l for l in m.splitlines() if l.startswith("tandem_decode_kv_store_blocks{") and 'tier="disk"' in l]
        n = float(v[0].split()[-1]) if v else 0
        same = same + 1 if n == last else 0
        last = n
        time.sleep(0.2)


def block_files(d):
    out = []
    for root, _, files in os.walk(os.path.join(d, "store")):
        out += [os.path.join(root, f) for f in files if f.endswith(".kvb")]
    return out


def loadavg():
    return float(open("/proc/loadavg").read().split()[0])


def drop_cache(files):
    if os.geteuid() == 0:
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
        return
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def rubric_files(d, rubric_ids):
    """The rubric's own block files: first token id the rubric's (offset 128)
    and block index (offset 60) inside it (not the blocks that go on into a
    submission)."""
    want = rubric_ids[0].to_bytes(4, "little")
    out = []
    for f in block_files(d):
        with open(f, "rb") as fh:
            h = fh.read(132)
            if h[128:132] == want and int.from_bytes(h[60:64], "little") < len(rubric_ids) // 64:
                out.append(f)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rubric", type=int, default=4096)
    ap.add_argument("--sub", type=int, default=500)
    ap.add_argument("--ctx", type=int, default=0, help="the node's -c (default rubric + sub + 64)")
    a = ap.parse_args()
    rng = random.Random(43)
    ids = lambda n: [rng.randrange(1000, 100000) for _ in range(n)]
    d = tempfile.mkdtemp(prefix="tandem-bench-kvstore-")
    log = open(os.path.join(d, "node.log"), "ab")
    rubric = ids(a.rubric)
    res = {"cold": [], "ram": [], "disk": [], "cat": [], "disk-pc": []}
    p, port = start(a, d, log)

    def run(kind, prompt):
        la = loadavg()
        x = gen(port, prompt)
        x["load"] = max(la, loadavg())
        res[kind].append(x)

    run("cold", rubric + ids(a.sub))   # the rubric stored by its first, cold, request
    files, nbytes = [], 0
    for r in range(a.rounds):
        if r:
            run("cold", ids(a.rubric) + ids(a.sub))
        else:
            gen(port, ids(80))   # the slot no longer holds the rubric: the next hit is the store's
        run("ram", rubric + ids(a.sub))
        wait_written(port)
        stop(p)
        files = rubric_files(d, rubric)
        nbytes = sum(os.path.getsize(f) for f in files)
        drop_cache(files)
        p, port = start(a, d, log)
        run("disk", rubric + ids(a.sub))
        # cat of the same files right after, the page cache dropped the same way
        drop_cache(files)
        # the shell and cat themselves back in the page cache: only the files are read
        subprocess.run("cat /dev/null > /dev/null", shell=True, check=True)
        la = loadavg()
        t0 = time.time()
        subprocess.run("cat " + " ".join(files) + " > /dev/null", shell=True, check=True)
        res["cat"].append({"store_ms": (time.time() - t0) * 1e3, "load": max(la, loadavg())})
        stop(p)
        p, port = start(a, d, log)
        run("disk-pc", rubric + ids(a.sub))
        print("round %d: %s" % (r + 1, {k: (round(v[-1].get("ttft", 0)), v[-1].get("tier"), round(v[-1]["store_ms"], 1))
                                          for k, v in res.items() if v}), flush=True)
    stop(p)
    med = lambda xs: statistics.median(xs)
    print("\nrubric %d + submission %d tokens, %s, %d threads, %d rounds (medians); %d block files, %.1f MB" %
          (a.rubric, a.sub, os.path.basename(a.model), a.threads, a.rounds, len(files), nbytes / 1e6))
    print("| run | TTFT ms | cached | computed | load ms | load GB/s | load average |")
    print("|---|---|---|---|---|---|---|")
    for k, v in res.items():
        sm = med([x["store_ms"] for x in v])
        la = "%.1f-%.1f" % (min(x["load"] for x in v), max(x["load"] for x in v))
        rate = "%.2f" % (nbytes / sm / 1e6) if sm > 0 and k != "cold" else "-"
        if k == "cat":
            print("| cat (page cache dropped) | - | - | - | %.1f | %s | %s |" % (sm, rate, la))
            continue
        print("| %s | %.0f | %d | %d | %.1f | %s | %s |" % (k, med([x["ttft"] for x in v]), v[0]["cached"], v[0]["computed"],
                                                          sm, rate, la))
    d_ms, c_ms = med([x["store_ms"] for x in res["disk"]]), med([x["store_ms"] for x in res["cat"]])
    print("\ndisk load / cat: %.2fx the time (goal: >= 1 GB/s, or <= 2x cat's time)" % (d_ms / c_ms))
    log.close()
    print(open(os.path.join(d, "node.log")).read()[-2500:]) if os.environ.get("BENCH_SHOW_LOG") else None
    shutil.rmtree(d)


if __name__ == "__main__":
    main()
