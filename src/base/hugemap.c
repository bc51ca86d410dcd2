/* hugemap.c - see hugemap.h. */
#include "base/hugemap.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

void *hugemap_alloc(size_t size, size_t *mapped) {
    size = (size + HUGEMAP_PAGE - 1) / HUGEMAP_PAGE * HUGEMAP_PAGE;
    *mapped = 0;
    if (size == 0) return NULL;
    /* one huge page more, so the base can be aligned to one; the unaligned
     * head and tail go back */
    void *p = mmap(NULL, size + HUGEMAP_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uintptr_t lo = (uintptr_t)p, al = (lo + HUGEMAP_PAGE - 1) & ~(uintptr_t)(HUGEMAP_PAGE - 1);
    if (al > lo) munmap(p, al - lo);
    if (al + size < lo + size + HUGEMAP_PAGE) munmap((void *)(al + size), lo + HUGEMAP_PAGE - al);
#ifdef MADV_HUGEPAGE
    madvise((void *)al, size, MADV_HUGEPAGE);   /* a hint: without THP the pages stay small */
#endif
    *mapped = size;
    return (void *)al;
}

void hugemap_trim(void *p, size_t mapped, size_t used) {
    long pg = sysconf(_SC_PAGESIZE);
    if (!p || pg <= 0 || used >= mapped) return;
    uint8_t *b = p;
    size_t head = used / HUGEMAP_PAGE * HUGEMAP_PAGE, part = used - head;
    /* Dropping only the tail of a huge page splits it, and the kernel frees
     * the split-off pages later (its deferred split, under memory pressure):
     * the resident set would shrink before the memory does. So the kept
     * part of the last huge page moves to small pages: copied out, the
     * whole huge page dropped (freed at once), the range marked for small
     * pages, the part copied back. Where no copy can be made, the tail goes
     * the deferred way. */
    void *keep = part ? malloc(part) : NULL;
    if (part && !keep) {
        size_t lo = (used + (size_t)pg - 1) / (size_t)pg * (size_t)pg;
        if (lo < mapped) madvise(b + lo, mapped - lo, MADV_DONTNEED);
        return;
    }
    if (part) memcpy(keep, b + head, part);
    madvise(b + head, mapped - head, MADV_DONTNEED);
#ifdef MADV_NOHUGEPAGE
    if (part) madvise(b + head, mapped - head, MADV_NOHUGEPAGE);
#endif
    if (part) memcpy(b + head, keep, part);
    free(keep);
}

void hugemap_free(void *p, size_t mapped) {
    if (p) munmap(p, mapped);
}
