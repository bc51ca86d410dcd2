#!/usr/bin/env python3
"""slice_rss.py - resident memory of layer-split prefill slice nodes (issue 41).

Starts `tandem serve --role prefill --layers A:B` for each slice of an even
split of MODEL into K slices (K from --slices, e.g. 2,4), waits until each
listens, reads its VmRSS, and prints it beside the slice's share of the
weight bytes (its blocks' tensors, plus token_embd for the first slice: what
it maps and keeps; the output head is the decode node's). A measurement,
not a test.

The expected figure is the share alone: a loaded slice holds no buffers
(activations, scratch and KV caches are allocated by the first request;
the breakdown shows it: all anonymous memory but the packed weights is the
heap's and the libraries' few hundred KiB). Beside RSS (VmRSS, what the
kernel counts) it prints PSS (shared library pages divided among the
processes mapping them) and where the RSS is, from /proc/PID/smaps:
"anon" (the packed weights' arena and any other anonymous mapping), "file"
(the model file's mapping: the first slice's embedding rows, norms),
"libs" (shared libraries, relocated data included), "bin" (the tandem
binary), "heap".

usage: tools/slice_rss.py MODEL.gguf [--slices 2,4] [--bin build/tandem] [--backend mlx]
(--slices 1 is a whole-model node without --layers: the baseline)
"""
import argparse, os, re, struct, subprocess, sys, tempfile, time

# bytes per block and elements per block of the GGUF types used here
TYPES = {0: (4, 1), 1: (2, 1), 30: (2, 1), 8: (34, 32), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32),
         12: (144, 256), 13: (176, 256), 14: (210, 256)}


def read_tensors(path):
    with open(path, 'rb') as f:
        data = f.read(64 << 20)
    off = 0

    def u(fmt):
        nonlocal off
        v = struct.unpack_from('<' + fmt, data, off)
        off += struct.calcsize('<' + fmt)
        return v[0]

    def s():
        n = u('Q')
        nonlocal off
        v = data[off:off + n].decode('utf-8', 'replace')
        off += n
        return v
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(t):
        nonlocal off
        if t == 8:
            s()
        elif t == 9:
            et = u('I'); n = u('Q')
            for _ in range(n):
                skip(et)
        else:
            off += sizes[t]
    assert data[:4] == b'GGUF'
    off = 4
    u('I'); nt = u('Q'); nkv = u('Q')
    for _ in range(nkv):
        s(); skip(u('I'))
    out = []
    for _ in range(nt):
        name = s(); nd = u('I'); ne = [u('Q') for _ in range(nd)]; t = u('I'); u('Q')
        n = 1
        for d in ne:
            n *= d
        bb, be = TYPES[t]
        out.append((name, n // be * bb))
    return out


def share(tensors, lo, hi):
    b = 0
    for name, nb in tensors:
        m = re.match(r'blk\.(\d+)\.', name)
        if m and lo <= int(m.group(1)) < hi:
            b += nb
        elif name == 'token_embd.weight' and lo == 0:
            b += nb
    return b


def smaps_parts(pid, model, binary):
    """PSS and the RSS by kind of mapping (bytes), from /proc/PID/smaps."""
    model, binary = os.path.realpath(model), os.path.realpath(binary)
    parts = {c: 0 for c in ('anon', 'file', 'libs', 'bin', 'heap', 'other')}
    pss, kind = 0, 'other'
    for line in open(f'/proc/{pid}/smaps'):
        f = line.split()
        if re.match(r'^[0-9a-f]+-[0-9a-f]+ ', line):
            path = f[5] if len(f) > 5 else ''
            kind = ('anon' if not path else 'heap' if path == '[heap]' else 'file' if path == model
                    else 'bin' if path == binary else 'libs' if '.so' in os.path.basename(path) else 'other')
        elif f[0] == 'Rss:':
            parts[kind] += int(f[1]) * 1024
        elif f[0] == 'Pss:':
            pss += int(f[1]) * 1024
    return pss, parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('model')
    ap.add_argument('--slices', default='2,4')
    ap.add_argument('--bin', default='build/tandem')
    ap.add_argument('--backend', default=None, help='--backend for the nodes (mlx: a build-mlx/tandem)')
    a = ap.parse_args()
    tensors = read_tensors(a.model)
    nl = 1 + max(int(m.group(1)) for m in (re.match(r'blk\.(\d+)\.', n) for n, _ in tensors) if m)
    tmp = tempfile.mkdtemp(prefix='slice-rss-')
    sec = os.path.join(tmp, 'secret')
    open(sec, 'w').write(os.urandom(32).hex())   # 32 random bytes: nodes refuse less
    print(f'{os.path.basename(a.model)}: {nl} layers, {sum(b for _, b in tensors) / 2**20:.1f} MiB of tensors')
    print('| chain | slice | weight share MiB | RSS after load MiB | RSS / share | PSS MiB | anon / file / libs / bin / heap MiB |')
    print('|---|---|---:|---:|---:|---:|---|')
    for k in [int(x) for x in a.slices.split(',')]:
        for i in range(k):
            lo, hi = i * nl // k, (i + 1) * nl // k
            # k == 1: a whole-model node (no --layers), the baseline
            lay = ['--layers', f'{lo}:{hi}'] if k > 1 else []
            be = ['--backend', a.backend] if a.backend else []
            pf = os.path.join(tmp, f'port{k}.{i}')
            log = open(os.path.join(tmp, f'log{k}.{i}'), 'w')
            p = subprocess.Popen([a.bin, 'serve', '--role', 'prefill', '-m', a.model, '--secret-file', sec,
                                  '--port-file', pf, '-t', '2'] + lay + be, stdout=log, stderr=log)
            t0 = time.time()
            while not os.path.exists(pf) and time.time() - t0 < 300 and p.poll() is None:
                time.sleep(0.2)
            time.sleep(0.5)
            rss = 0
            for line in open(f'/proc/{p.pid}/status'):
                if line.startswith('VmRSS:'):
                    rss = int(line.split()[1]) * 1024
            pss, parts = smaps_parts(p.pid, a.model, a.bin)
            p.terminate()
            p.wait()
            sh = share(tensors, lo, hi)
            where = ' / '.join(f'{parts[c] / 2**20:.1f}' for c in ('anon', 'file', 'libs', 'bin', 'heap'))
            print(f'| {k if k > 1 else "whole"} {"slices" if k > 1 else "model"} | {lo}:{hi} | {sh / 2**20:.1f} | {rss / 2**20:.1f} | {rss / sh:.3f} | '
                  f'{pss / 2**20:.1f} | {where} |')
            sys.stdout.flush()


if __name__ == '__main__':
    main()
