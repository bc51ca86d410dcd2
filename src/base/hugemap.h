/* hugemap.h - anonymous memory asked for on transparent huge pages.
 *
 * The CPU backend keeps its packed weights in such mappings (a decode step
 * streams them; with 4 KiB pages the hardware prefetchers stop at every page
 * boundary and every page costs a TLB walk), and `tandem bench` reads its
 * bandwidth bound from one, so the bound is measured on the pages the
 * weights live on.
 */
#ifndef TANDEM_HUGEMAP_H
#define TANDEM_HUGEMAP_H

#include <stddef.h>

#define HUGEMAP_PAGE ((size_t)2 << 20)

/* size bytes rounded up to whole HUGEMAP_PAGEs (*mapped), aligned to one,
 * zeroed and backed only as pages are touched; huge pages are a hint
 * (without THP they stay small). NULL if the mapping failed. */
void *hugemap_alloc(size_t size, size_t *mapped);
/* The pages of [p + used, p + mapped) go back to the system, the bytes
 * before p + used kept (the last huge page partly used moves to small
 * pages): a filled mapping's untouched tail costs nothing, but the huge
 * page its last bytes touched holds up to 2 MiB of zeros. Bytes past used
 * read as zeros afterwards. */
void hugemap_trim(void *p, size_t mapped, size_t used);
/* p and *mapped from hugemap_alloc; NULL is ignored */
void hugemap_free(void *p, size_t mapped);

#endif
