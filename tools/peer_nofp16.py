#!/usr/bin/env python3
"""peer_nofp16.py IN OUT - a copy of a peer benchmark binary that runs on an
x86-64 CPU without AVX512-FP16 (a benchmark helper, not part of tandem).

The reference builds in ../shared/peers were compiled with -march=native on a
Xeon that has AVX512-FP16. Their kernels never do FP16 arithmetic, but the
compiler moved scalar halves between registers and memory with the FP16
extension's vmovw and vmovsh, so on any other CPU the binary dies with SIGILL
before its first test. This rewrites each of those moves, found with objdump,
into an instruction of the same length from AVX2 / AVX-512 F/BW that carries
the same 16 bits:

  vmovw r32 -> xmm     vmovd (EVEX; bits 16-31 take the register's upper half)
  vmovw m16 -> xmm     vpmovzxwq (bits 0-63 exact), or vpbroadcastw where the
                       address has a displacement (lane 0 exact)
  vmovw xmm -> r32     vpextrw $0 (exact)
  vmovw xmm -> m16     vpextrw $0 (exact); where the EVEX disp8*2 does not fit
                       a VEX disp8, a jump to a trampoline placed in the zero
                       padding after .text, inside the segment's last page
  vmovsh x, x, x       vpblendw $1 (exact)

Lane 0, the half the program meant to move, is always exact; where noted the
other lanes may differ from the zeros the original left there. Speed is what
the copy is for: every kernel instruction is left as it was.
"""
import re
import struct
import subprocess
import sys


def fail(msg, line):
    sys.exit(f"peer_nofp16: cannot rewrite ({msg}): {line.strip()}")


def exec_segment(data):
    """(file offset, vaddr, filesz, header offset) of the executable PT_LOAD."""
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phnum = struct.unpack_from("<H", data, 0x38)[0]
    for i in range(phnum):
        o = phoff + 56 * i
        typ, flags = struct.unpack_from("<II", data, o)
        off, va, _, fsz, _ = struct.unpack_from("<QQQQQ", data, o + 8)
        if typ == 1 and flags & 1:
            return off, va, fsz, o
    sys.exit("peer_nofp16: no executable segment")


def insn_len(b):
    """Length of an EVEX instruction with a modrm and no immediate."""
    modrm = b[5]
    mod, rm = modrm >> 6, modrm & 7
    n = 6
    sib_base = None
    if mod != 3 and rm == 4:
        n += 1
        sib_base = b[6] & 7
    if mod == 1:
        n += 1
    elif mod == 2 or (mod == 0 and (rm == 5 or sib_base == 5)):
        n += 4
    return n, mod, (mod == 0 and (rm == 5 or sib_base == 5))


def main():
    src, dst = sys.argv[1], sys.argv[2]
    data = bytearray(open(src, "rb").read())
    off, va, fsz, ph = exec_segment(data)
    if off != va:
        sys.exit("peer_nofp16: executable segment not mapped at its file offset")
    cave = (off + fsz + 15) & ~15
    cave_end = (off + fsz + 0xFFF) & ~0xFFF   # the rest of the segment's last page
    if set(data[cave:cave_end]) - {0}:
        sys.exit("peer_nofp16: no zero padding after .text")
    dis = subprocess.run(["objdump", "-d", src], capture_output=True, text=True, check=True).stdout
    sites = [l for l in dis.splitlines() if re.search(r"\tvmov(w|sh)\s", l)]
    stats = {}
    for line in sites:
        addr = int(line.split(":")[0], 16)
        b = data[addr:addr + 16]
        if b[0] != 0x62:
            fail("not EVEX", line)
        P0, P1, P2, op, modrm = b[1], b[2], b[3], b[4], b[5]
        if P0 & 7 != 5 or P2 & 0x87:
            fail("map or masking", line)
        pp = P1 & 3
        n, mod, abs_or_rip = insn_len(b)
        ins = bytes(b[:n])
        lo3 = (P0 & 0xE0)          # inverted R, X, B, shared by EVEX and VEX
        if op == 0x10 and pp == 2 and mod == 3:
            if not (P0 & 0x10) or not (P2 & 0x08):
                fail("register above xmm15", line)
            new, kind = bytes([0xC4, lo3 | 0x03, (P1 & 0x78) | 0x01, 0x0E, modrm, 0x01]), "vmovsh -> vpblendw"
        elif op == 0x6E and pp == 1 and mod == 3:
            new, kind = bytes([0x62, (P0 & ~7) | 1, P1 & 0x7F, P2]) + ins[4:], "vmovw r->x -> vmovd"
        elif op == 0x6E and pp == 1 and mod == 0 and not abs_or_rip:
            new, kind = bytes([0x62, (P0 & ~7) | 2, P1 & 0x7F, P2, 0x34]) + ins[5:], "vmovw m->x -> vpmovzxwq"
        elif op == 0x6E and pp == 1:
            new, kind = bytes([0x62, (P0 & ~7) | 2, P1 & 0x7F, P2, 0x79]) + ins[5:], "vmovw m->x -> vpbroadcastw"
        elif op == 0x7E and pp == 1 and mod == 3:
            if not (P0 & 0x10) or not (P0 & 0x40):
                fail("register above xmm15", line)
            reg, rm = (modrm >> 3) & 7, modrm & 7
            vex1 = (((P0 >> 5) & 1) << 7) | 0x40 | (((P0 >> 7) & 1) << 5) | 0x01   # reg and rm swap roles
            new, kind = bytes([0xC4, vex1, 0x79, 0xC5, 0xC0 | (rm << 3) | reg, 0x00]), "vmovw x->r -> vpextrw"
        elif op == 0x7E and pp == 1:
            if not (P0 & 0x10) or abs_or_rip:
                fail("register above xmm15 or rip-relative", line)
            body = bytearray(ins[5:])
            kind = "vmovw x->m -> vpextrw"
            if mod == 1:
                d = (body[-1] - 256 if body[-1] > 127 else body[-1]) * 2   # EVEX disp8 counts halves
                if not -128 <= d <= 127:
                    body = bytearray([(modrm & 0x3F) | 0x80]) + body[1:-1] + d.to_bytes(4, "little", signed=True)
                    tr = bytes([0xC4, lo3 | 0x03, 0x79, 0x15]) + bytes(body) + b"\x00"
                    tr += b"\xE9" + (addr + n - (cave + len(tr) + 5)).to_bytes(4, "little", signed=True)
                    if cave + len(tr) > cave_end:
                        fail("trampoline space full", line)
                    data[cave:cave + len(tr)] = tr
                    new = b"\xE9" + (cave - (addr + 5)).to_bytes(4, "little", signed=True) + b"\x90" * (n - 5)
                    cave = (cave + len(tr) + 15) & ~15
                    kind = "vmovw x->m -> trampoline"
                    data[addr:addr + n] = new
                    stats[kind] = stats.get(kind, 0) + 1
                    continue
                body[-1] = d & 0xFF
            new = bytes([0xC4, lo3 | 0x03, 0x79, 0x15]) + bytes(body) + b"\x00"
        else:
            fail("unknown form", line)
        if len(new) != n:
            fail(f"length {len(new)} != {n}", line)
        data[addr:addr + n] = new
        stats[kind] = stats.get(kind, 0) + 1
    struct.pack_into("<QQ", data, ph + 32, cave - off, cave - va)   # segment now covers the trampolines
    with open(dst, "wb") as f:
        f.write(data)
    print(f"peer_nofp16: {len(sites)} moves rewritten: " + ", ".join(f"{v} {k}" for k, v in stats.items()),
          file=sys.stderr)


if __name__ == "__main__":
    main()
