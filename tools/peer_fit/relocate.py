#!/usr/bin/env python3
"""relocate.py BINARY OUT.blob [--also REGEX] [--no-jump-tables] [--cpuid-avxvnni]

A benchmark helper, not part of tandem. The reference peer builds in
../shared/peers were compiled with -march=native on a Xeon with AVX-VNNI and
AVX512-FP16; a CPU without them (AMD Zen 4 has AVX-512 VNNI/BW/VL but
neither) dies with SIGILL at the first such instruction. Each of them has an
exact equivalent in AVX-512 VNNI/BW/VL, only longer, so it cannot be
rewritten in place. This moves every basic block that holds one into a
trampoline where it is re-encoded, and writes a blob that preload.c applies
at start-up:

  {vex} vpdpbusd / vpdpwssd   the same instruction, EVEX-encoded (a disp8
                              rescaled as EVEX's disp8*N, or widened)
  vmovw r32 -> xmm            vmovd; vpslld $16; vpsrld $16
  vmovw m16 -> xmm            vpxor(d) x,x,x; vpinsrw $0
  vmovw xmm -> r32 / m16      vpextrw $0
  vmovsh x1, x2, x3           vpblendw $1 (registers below 16)

A block is a run of instructions that no known branch enters in its middle:
known entries are direct branch and call targets, rip-relative addresses,
R_X86_64_RELATIVE relocations (function pointers), dynamic symbols and the
entries of gcc's jump tables (lea TABLE(%rip) .. jmp *reg, int32 offsets).
In the trampoline, branches get rel32 forms; a branch to the start of
another moved block goes straight to its trampoline, so a loop inside one
block runs wholly there; rip-relative operands are re-aimed. preload.c
writes a jmp over each block's first five bytes and int3 over the rest; an
entry no table names lands on an int3 and the SIGTRAP handler sends it on to
the same instruction in the trampoline (the blob maps every instruction).

--also REGEX moves the blocks holding matching instructions too (unchanged
but moved: a measure of what moving costs). --no-jump-tables leaves the
tables unread (the self-test's way to reach the int3 path).
--cpuid-avxvnni also replaces each cpuid with one that reports AVX-VNNI
(leaf 7, subleaf 1, eax bit 4): tandem's own test programs, so moved, run
and check its avxvnni kernel set on a CPU that lacks the extension
(tests/peer_fit.sh).
Blob layout (little-endian): "IKPATCH1", u32 trampoline bytes, relocation
count, block count, map count; u64 address and 16 original bytes of the
first block (preload.c checks them: the blob belongs to this program);
the trampolines; relocations {u32 pos, u32 end, u64 target}: the int32 at
pos becomes (base + target) - (trampolines + end); blocks {u64 address,
u32 length, u32 trampoline offset}; map {u64 address, u32 trampoline
offset}, sorted. Addresses are the ELF's virtual addresses.
"""
import bisect
import os
import re
import struct
import subprocess
import sys
import tempfile

args = sys.argv[1:]
if len(args) < 2:
    sys.exit(__doc__.split('\n')[0])
binary, outp = args[0], args[1]
no_jt = '--no-jump-tables' in args
also = re.compile(args[args.index('--also') + 1]) if '--also' in args else None
fake_vnni = '--cpuid-avxvnni' in args

def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

# ==== Instructions (objdump) ====
LINE = re.compile(r'^\s*([0-9a-f]+):\t((?:[0-9a-f]{2} )+)\s*\t(.*)$')
def disassemble(path):
    out = []
    for line in run('objdump', '-d', '--insn-width=15', path).splitlines():
        m = LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), bytes.fromhex(m.group(2).replace(' ', '')), m.group(3).strip()))
    return out

ins = disassemble(binary)
if not ins:
    sys.exit('relocate: no code in ' + binary)
addrs = [a for a, _, _ in ins]
at = {a: i for i, a in enumerate(addrs)}
text_lo, text_hi = addrs[0], addrs[-1] + len(ins[-1][1])

PFX = r'^(?:(?:bnd|notrack|ds|cs|rep|repz)\s+)*'
BRANCH = re.compile(r'^(?:(?:bnd|notrack|ds|cs)\s+)*(j[a-z]+|call)\s+([0-9a-f]+) <')
RIPC = re.compile(r'# ([0-9a-f]+)')
ENDS = re.compile(PFX + r'(j[a-z]+|ret[a-z]*|ud2|hlt)\b')       # a block ends after these
NOFALL = re.compile(PFX + r'(jmp|ret[a-z]*|ud2|hlt)\b')         # ... and these do not fall through
PAD = re.compile(r'(nop|xchg\s+%ax,%ax|data16|cs nop|int3)')

def needs_repl(t):
    return (t.startswith('{vex} vpdp') or re.match(r'vmov(w|sh)\s', t) is not None or
            (fake_vnni and t == 'cpuid'))
def moves(t):
    return needs_repl(t) or (also is not None and also.match(t) is not None)

# ==== Known entries ====
starts = set()
for a, b, t in ins:
    m = BRANCH.match(t)
    if m:
        starts.add(int(m.group(2), 16))
    elif '(%rip)' in t and RIPC.search(t):
        starts.add(int(RIPC.search(t).group(1), 16))
for l in run('readelf', '-rW', binary).splitlines():
    f = l.split()
    if len(f) >= 4 and f[2] == 'R_X86_64_RELATIVE':
        starts.add(int(f[3], 16))
for l in subprocess.run(['nm', '-D', '--defined-only', binary], capture_output=True, text=True).stdout.splitlines():
    f = l.split()
    if len(f) == 3:
        starts.add(int(f[0], 16))
data = open(binary, 'rb').read()
segs = [(int(f[2], 16), int(f[1], 16), int(f[4], 16))          # vaddr, offset, filesz
        for f in (l.split() for l in run('readelf', '-lW', binary).splitlines()) if f and f[0] == 'LOAD']
def read_i32(va):
    for v, o, s in segs:
        if v <= va and va + 4 <= v + s:
            return struct.unpack_from('<i', data, o + va - v)[0]
    return None
n_jt = 0
for i, (a, b, t) in enumerate(ins):
    if no_jt or not re.match(r'(notrack\s+)?jmp\s+\*%r', t):
        continue
    for j in range(max(0, i - 12), i):            # the table's lea a few instructions before
        tj = ins[j][2]
        if tj.startswith('lea') and '(%rip)' in tj:
            base = int(RIPC.search(tj).group(1), 16)
            for k in range(4096):
                e = read_i32(base + 4 * k)
                tg = None if e is None else (base + e) & (2**64 - 1)
                if tg is None or tg not in at or abs(tg - a) >= 1 << 20:
                    break
                starts.add(tg)
                n_jt += 1
starts = sorted(s for s in starts if text_lo <= s < text_hi)
start_set = set(starts)

# ==== Blocks ====
def block_of(i):
    k = bisect.bisect_right(starts, addrs[i]) - 1
    s = starts[k] if k >= 0 else text_lo
    j = i
    while j > 0 and addrs[j] > s and not ENDS.match(ins[j - 1][2]):
        j -= 1
    while j < i and PAD.match(ins[j][2]):         # padding after a jmp is not entered
        j += 1
    e = i
    while e + 1 < len(ins) and not ENDS.match(ins[e][2]) and addrs[e + 1] not in start_set:
        e += 1
    return j, e

blocks = {}
for i, (a, b, t) in enumerate(ins):
    if moves(t):
        s, e = block_of(i)
        blocks[s] = e
blocks = sorted(blocks.items())
for (s1, e1), (s2, e2) in zip(blocks, blocks[1:]):
    assert e1 < s2
def span(s, e):
    return addrs[e] + len(ins[e][1]) - addrs[s]
if any(span(s, e) < 5 for s, e in blocks):
    sys.exit('relocate: a block shorter than the jmp that replaces it')

# ==== Replacements (assembled by as) ====
MARK = 0x5a5a5a5a      # stands for a rip-relative displacement until it is relocated
def split_ops(s):
    depth, cut = 0, None
    for k, ch in enumerate(s):
        depth += ch == '('
        depth -= ch == ')'
        if ch == ',' and depth == 0:
            cut = k
    return s[:cut], s[cut + 1:]
# cpuid, then AVX-VNNI set in leaf 7.1's eax; below the red zone, which the
# function may be using, the leaf and subleaf are kept on the stack
CPUID_AVXVNNI = ('lea -128(%rsp),%rsp', 'push %rax', 'push %rcx', 'cpuid', 'cmpl $7,8(%rsp)', 'jne 1f',
                 'cmpl $1,(%rsp)', 'jne 1f', 'or $0x10,%eax', '1: lea 144(%rsp),%rsp')
def repl_text(t):
    if t == 'cpuid':
        return CPUID_AVXVNNI
    t = re.sub(r'\s+#.*$', '', t)
    t = re.sub(r'-?0x[0-9a-f]+\(%rip\)', f'{MARK:#x}(%rip)', t)
    m = re.match(r'\{vex\}\s+(vpdp\w+)\s+(.*)$', t)
    if m:
        return ('{evex} %s %s' % (m.group(1), m.group(2)),)
    if t.startswith('vmovw'):
        src, dst = split_ops(t[len('vmovw'):].strip())
        if dst.startswith('%xmm'):
            if src.startswith('%'):               # r32 -> xmm, bits 16 and up cleared
                return (f'vmovd {src},{dst}', f'vpslld $16,{dst},{dst}', f'vpsrld $16,{dst},{dst}')
            z = 'vpxord' if int(dst[4:]) >= 16 else 'vpxor'
            return (f'{z} {dst},{dst},{dst}', f'vpinsrw $0,{src},{dst},{dst}')
        return (f'vpextrw $0,{src},{dst}',)
    m = re.match(r'vmovsh\s+(%xmm\d+),(%xmm\d+),(%xmm\d+)$', t)
    if m and all(int(r[4:]) < 16 for r in m.groups()):
        return (f'vpblendw $1,{m.group(1)},{m.group(2)},{m.group(3)}',)
    sys.exit('relocate: no replacement for: ' + t)

reps = {}
for s, e in blocks:
    for i in range(s, e + 1):
        if needs_repl(ins[i][2]):
            reps.setdefault(repl_text(ins[i][2]), None)
with tempfile.TemporaryDirectory() as tmp:
    src, obj = os.path.join(tmp, 'r.s'), os.path.join(tmp, 'r.o')
    with open(src, 'w') as f:
        f.write('.text\n')
        for k, r in enumerate(reps):
            f.write(f'r{k}:\n' + ''.join('\t' + x + '\n' for x in r))
    subprocess.run(['as', '--64', '-o', obj, src], check=True)
    label, cur, code = re.compile(r'^[0-9a-f]+ <r(\d+)>:'), None, {}
    for line in run('objdump', '-d', '--insn-width=15', obj).splitlines():
        m = label.match(line)
        if m:
            cur = int(m.group(1))
            code[cur] = b''
        elif LINE.match(line) and cur is not None:
            code[cur] += bytes.fromhex(LINE.match(line).group(2).replace(' ', ''))
for k, r in enumerate(reps):
    reps[r] = code[k]

# ==== Trampolines ====
def encode(i):
    """(bytes, [(pos, end, target)]) of instruction i in a trampoline"""
    a, b, t = ins[i]
    m = BRANCH.match(t)
    if needs_repl(t):
        r = reps[repl_text(t)]
        if '(%rip)' not in t:
            return r, []
        p = r.find(struct.pack('<I', MARK))
        assert p >= 0
        # the memory operand is in the sequence's last instruction: its end is the sequence's
        return r, [(p, len(r), int(RIPC.search(t).group(1), 16))]
    if m:
        k = 0
        while b[k] in (0x2e, 0x3e, 0xf2):            # hint / bnd prefixes
            k += 1
        c = b[k]
        if m.group(1) == 'call' and c == 0xe8: op = b'\xe8'
        elif c in (0xeb, 0xe9): op = b'\xe9'
        elif 0x70 <= c <= 0x7f: op = bytes([0x0f, 0x80 + c - 0x70])
        elif c == 0x0f and 0x80 <= b[k + 1] <= 0x8f: op = bytes([0x0f, b[k + 1]])
        else: sys.exit('relocate: cannot re-aim: ' + t)
        return op + b'\0\0\0\0', [(len(op), len(op) + 4, int(m.group(2), 16))]
    if '(%rip)' in t:
        tg = int(RIPC.search(t).group(1), 16)
        d = struct.pack('<i', tg - (a + len(b)))
        cands = [p for p in range(len(b) - 3) if b[p:p + 4] == d and len(b) - (p + 4) <= 4]
        if not cands:
            sys.exit('relocate: no displacement in: ' + t)
        return b, [(cands[0], len(b), tg)]
    return b, []

def encode_block(s, e):
    out, rel, pos = bytearray(), [], []
    for i in range(s, e + 1):
        c, r = encode(i)
        pos.append((addrs[i], len(out)))
        rel += [(len(out) + p, len(out) + q, tg) for p, q, tg in r]
        out += c
    if not NOFALL.match(ins[e][2]):               # back to the instruction after the block
        out += b'\xe9'
        rel.append((len(out), len(out) + 4, addrs[e] + len(ins[e][1])))
        out += b'\0\0\0\0'
    return out, rel, pos

encoded = [encode_block(s, e) for s, e in blocks]
toff, off = {}, 0
for (s, e), (o, _, _) in zip(blocks, encoded):
    toff[addrs[s]] = off
    off += (len(o) + 15) & ~15
tramp, relocs, imap = bytearray(), [], []
for (s, e), (o, rel, pos) in zip(blocks, encoded):
    base = len(tramp)
    for p, end, tg in rel:
        if tg in toff:     # another moved block: straight to its trampoline
            struct.pack_into('<i', o, p, toff[tg] - (base + end))
        else:
            relocs.append((base + p, base + end, tg))
    imap += [(a, base + q) for a, q in pos]
    tramp += o + b'\xcc' * (((len(o) + 15) & ~15) - len(o))

with open(outp, 'wb') as f:
    f.write(struct.pack('<8sIIII', b'IKPATCH1', len(tramp), len(relocs), len(blocks), len(imap)))
    s0 = blocks[0][0]
    f.write(struct.pack('<Q', addrs[s0]) + b''.join(ins[i][1] for i in range(s0, s0 + 8))[:16].ljust(16, b'\0'))
    f.write(tramp)
    for p, end, tg in relocs:
        f.write(struct.pack('<IIQ', p, end, tg))
    for s, e in blocks:
        f.write(struct.pack('<QII', addrs[s], span(s, e), toff[addrs[s]]))
    for a, q in imap:
        f.write(struct.pack('<QI', a, q))
print(f'relocate: {len(blocks)} blocks ({sum(span(s, e) for s, e in blocks)} bytes) moved, '
      f'{sum(needs_repl(t) for _, _, t in ins)} instructions replaced, {n_jt} jump-table entries read',
      file=sys.stderr)
