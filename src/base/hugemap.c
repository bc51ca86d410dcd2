/* hugemap.c - see hugemap.h. */
#include "base/hugemap.h"

#include <stdint.h>
#include <sys/mman.h>

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

void hugemap_free(void *p, size_t mapped) {
    if (p) munmap(p, mapped);
}
