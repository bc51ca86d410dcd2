/* preload.c - LD_PRELOAD half of tools/peer_fit (a benchmark helper, not part
 * of tandem). Applies a blob made by relocate.py to the program it was made
 * for: maps the trampolines within 2 GiB of the executable, fills in their
 * relocations, writes a jmp over each moved block's first five bytes and int3
 * over the rest, and sends an int3 hit (an entry into a block's middle that
 * no table named) on to the same instruction in the trampolines. Any other
 * program started with the same environment (a shell, timeout) is left alone:
 * the blob carries 16 bytes of its program's code and where they are.
 * Environment: PEER_FIT_BLOB (the blob), PEER_FIT_VERBOSE (say what it did). */
#define _GNU_SOURCE
#include <link.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

struct pf_hdr { char magic[8]; uint32_t tramp, nrel, nblk, nmap; uint64_t sig_at; uint8_t sig[16]; } __attribute__((packed));
struct pf_rel { uint32_t pos, end; uint64_t target; } __attribute__((packed));
struct pf_blk { uint64_t addr; uint32_t len, toff; } __attribute__((packed));
struct pf_map { uint64_t addr; uint32_t toff; } __attribute__((packed));

static uintptr_t base, tramp;          /* the executable's load bias; the trampolines */
static const struct pf_map *map;
static uint32_t nmap;
static volatile long redirects;
static uint64_t sig_at;
static int sig_mapped;
static uint64_t text_lo, text_hi;      /* the executable segment holding sig_at */

static void pf_die(const char *msg) {
    fprintf(stderr, "peer_fit: %s\n", msg);
    _exit(97);
}

/* ==== Which program ==== */
static int pf_first_object(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size;
    *(uintptr_t *)arg = info->dlpi_addr;
    for (int k = 0; k < info->dlpi_phnum; k++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[k];
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X) && ph->p_vaddr <= sig_at &&
            sig_at + 16 <= ph->p_vaddr + ph->p_memsz) {
            sig_mapped = 1;
            text_lo = ph->p_vaddr;
            text_hi = ph->p_vaddr + ph->p_memsz;
        }
    }
    return 1;                          /* the first object is the executable */
}

/* ==== Entries into a block's middle ==== */
static void pf_on_trap(int sig, siginfo_t *si, void *ucv) {
    (void)si;
    ucontext_t *uc = ucv;
    uint64_t a = (uint64_t)uc->uc_mcontext.gregs[REG_RIP] - 1 - base;   /* int3 is one byte */
    uint32_t lo = 0, hi = nmap;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (map[mid].addr < a) lo = mid + 1; else hi = mid;
    }
    if (sig == SIGTRAP && lo < nmap && map[lo].addr == a) {
        uc->uc_mcontext.gregs[REG_RIP] = (greg_t)(tramp + map[lo].toff);
        redirects++;
        return;
    }
    fprintf(stderr, "peer_fit: signal %d at executable offset %#llx, not a moved instruction\n",
            sig, (unsigned long long)a);
    _exit(98);
}

static void pf_report(void) {
    fprintf(stderr, "peer_fit: %ld entries redirected\n", redirects);
}

/* ==== Applying the blob ==== */
/* Every offset the blob gives stays inside what it names before anything is
 * written through it: relocations inside the trampolines, blocks inside the
 * executable segment and at least a jmp long, the map sorted (the trap
 * handler searches it) and pointing into the trampolines. */
static void pf_check_blob(const struct pf_hdr *h, const struct pf_rel *rel, const struct pf_blk *blk) {
    for (uint32_t i = 0; i < h->nrel; i++)
        if (rel[i].pos > h->tramp || h->tramp - rel[i].pos < 4 || rel[i].end < rel[i].pos + 4 || rel[i].end > h->tramp)
            pf_die("a relocation outside the trampolines");
    for (uint32_t i = 0; i < h->nblk; i++)
        if (blk[i].len < 5 || blk[i].toff >= h->tramp || blk[i].addr < text_lo || blk[i].addr > text_hi ||
            text_hi - blk[i].addr < blk[i].len)
            pf_die("a block outside the executable segment");
    for (uint32_t i = 0; i < nmap; i++)
        if (map[i].toff >= h->tramp || (i && map[i].addr < map[i - 1].addr))
            pf_die("the instruction map is out of order or out of range");
}

static void *pf_map_near(size_t size) {
    /* rel32 reaches +-2 GiB: try just above the executable's image */
    for (uintptr_t at = base + (64u << 20); at < base + (1u << 30); at += 16u << 20) {
        void *p = mmap((void *)at, size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
        if (p == (void *)at) return p;
        if (p != MAP_FAILED) munmap(p, size);
    }
    return NULL;
}

static void pf_patch_block(const struct pf_blk *b) {
    uintptr_t a = base + b->addr, pg = a & ~(uintptr_t)4095;
    size_t len = ((a + b->len + 4095) & ~(uintptr_t)4095) - pg;
    if (mprotect((void *)pg, len, PROT_READ | PROT_WRITE)) pf_die("cannot make the code writable");
    int32_t d = (int32_t)((int64_t)(tramp + b->toff) - (int64_t)(a + 5));
    uint8_t *c = (uint8_t *)a;
    c[0] = 0xe9;
    memcpy(c + 1, &d, 4);
    memset(c + 5, 0xcc, b->len - 5);
    if (mprotect((void *)pg, len, PROT_READ | PROT_EXEC)) pf_die("cannot make the code executable");
}

__attribute__((constructor)) static void pf_init(void) {
    const char *path = getenv("PEER_FIT_BLOB");
    if (!path) return;
    FILE *f = fopen(path, "rb");
    if (!f) pf_die("cannot open the blob");
    if (fseek(f, 0, SEEK_END)) pf_die("cannot read the blob");
    long n = ftell(f);
    rewind(f);
    if (n < (long)sizeof(struct pf_hdr)) pf_die("blob too short");
    uint8_t *buf = malloc((size_t)n);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) pf_die("cannot read the blob");
    fclose(f);
    const struct pf_hdr *h = (const struct pf_hdr *)buf;
    if (memcmp(h->magic, "IKPATCH1", 8)) pf_die("not a blob of relocate.py");
    uint64_t want = sizeof *h + (uint64_t)h->tramp + (uint64_t)h->nrel * sizeof(struct pf_rel) +
                    (uint64_t)h->nblk * sizeof(struct pf_blk) + (uint64_t)h->nmap * sizeof(struct pf_map);
    if (want != (uint64_t)n) pf_die("blob size does not match its header");
    const uint8_t *code = buf + sizeof *h;
    const struct pf_rel *rel = (const struct pf_rel *)(code + h->tramp);
    const struct pf_blk *blk = (const struct pf_blk *)(rel + h->nrel);
    map = (const struct pf_map *)(blk + h->nblk);
    nmap = h->nmap;

    sig_at = h->sig_at;
    dl_iterate_phdr(pf_first_object, &base);
    if (!sig_mapped || memcmp((void *)(base + sig_at), h->sig, 16)) {
        free(buf);                     /* another program: leave it alone */
        return;
    }
    pf_check_blob(h, rel, blk);
    size_t size = ((size_t)h->tramp + 4095) & ~(size_t)4095;
    uint8_t *t = pf_map_near(size);
    if (!t) pf_die("no room for the trampolines within 2 GiB of the executable");
    tramp = (uintptr_t)t;
    memcpy(t, code, h->tramp);
    for (uint32_t i = 0; i < h->nrel; i++) {
        int64_t d = (int64_t)(base + rel[i].target) - (int64_t)(tramp + rel[i].end);
        if (d != (int32_t)d) pf_die("a relocation does not reach");
        int32_t d32 = (int32_t)d;
        memcpy(t + rel[i].pos, &d32, 4);
    }
    if (mprotect(t, size, PROT_READ | PROT_EXEC)) pf_die("cannot make the trampolines executable");
    for (uint32_t i = 0; i < h->nblk; i++) pf_patch_block(&blk[i]);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = pf_on_trap;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGTRAP, &sa, NULL);
    if (getenv("PEER_FIT_VERBOSE")) {
        fprintf(stderr, "peer_fit: %u blocks moved\n", h->nblk);
        atexit(pf_report);
    }
}
