/* test_strbuf.c - the growable string buffer (src/base/strbuf.c): empty
 * buffers, appends that land exactly on the capacity, printf longer than any
 * fixed temporary, many small appends, sizes that would overflow size_t,
 * the sticky oom flag, take/reset/free. */
#include "base/strbuf.h"

#include <stdint.h>

#include "t.h"

/* ==== Empty buffers ==== */

static void test_empty(void) {
    strbuf b = {0};
    CHECK(b.len == 0 && !b.p && !b.oom, "zero-initialized strbuf is empty");
    size_t n = 99;
    char *s = strbuf_take(&b, &n);
    CHECK(s && s[0] == 0 && n == 0, "take of an untouched buffer gives \"\" (len %zu)", n);
    free(s);
    CHECK(!b.p && b.len == 0 && b.cap == 0, "take leaves the buffer empty");

    CHECK(strbuf_put(&b, "", 0) == 0 && b.p && b.p[0] == 0 && b.len == 0, "put of 0 bytes allocates a terminated \"\"");
    CHECK(strbuf_puts(&b, "") == 0 && b.len == 0, "puts(\"\") adds nothing");
    CHECK(strbuf_printf(&b, "%s", "") == 0 && b.len == 0 && b.p[0] == 0, "printf of an empty result adds nothing");
    strbuf_free(&b);
    CHECK(!b.p && b.len == 0 && b.cap == 0 && !b.oom, "free leaves the buffer empty");
    strbuf_free(&b);   /* twice is harmless */
}

/* ==== Capacity edges ==== */

static void test_exact_cap(void) {
    strbuf b = {0};
    strbuf_putc(&b, 'a');
    size_t cap = b.cap;
    CHECK(cap >= 2, "first append allocates (cap %zu)", cap);
    /* fill to exactly cap - 1 bytes: the NUL takes the last byte, no growth */
    char *fill = malloc(cap);
    memset(fill, 'b', cap);
    CHECK(strbuf_put(&b, fill, cap - 2) == 0, "fill to cap - 1");
    CHECK(b.len == cap - 1 && b.cap == cap && b.p[b.len] == 0, "len %zu == cap - 1, cap unchanged (%zu)", b.len, b.cap);
    /* one more byte needs len + 1 + NUL > cap: it must grow */
    CHECK(strbuf_putc(&b, 'c') == 0 && b.cap > cap && b.len == cap && b.p[cap - 1] == 'c' && b.p[cap] == 0,
          "one byte past the capacity grows (cap %zu -> %zu)", cap, b.cap);
    CHECK(b.p[0] == 'a' && b.p[1] == 'b' && b.p[cap - 2] == 'b', "content kept across realloc");
    free(fill);
    strbuf_free(&b);

    /* binary content: embedded NULs are kept, length is what was put */
    strbuf_put(&b, "x\0y", 3);
    CHECK(b.len == 3 && !memcmp(b.p, "x\0y", 4), "embedded NUL kept");
    strbuf_free(&b);
}

/* ==== printf ==== */

static void test_printf(void) {
    strbuf b = {0};
    CHECK(strbuf_printf(&b, "%d-%s-%.2f", 42, "x", 1.5) == 0 && !strcmp(b.p, "42-x-1.50"), "printf formats: %s", b.p);
    strbuf_puts(&b, "|");
    /* longer than the old modules' 1 KiB / 2 KiB temporaries: no truncation */
    size_t big = 100000;
    char *s = malloc(big + 1);
    for (size_t i = 0; i < big; i++) s[i] = (char)('a' + i % 26);
    s[big] = 0;
    CHECK(strbuf_printf(&b, "<%s>%zu", s, big) == 0, "large printf succeeds");
    char tail[32];
    snprintf(tail, sizeof tail, ">%zu", big);
    size_t want = strlen("42-x-1.50|") + 1 + big + strlen(tail);
    CHECK(b.len == want && strlen(b.p) == want, "large printf length %zu (want %zu)", b.len, want);
    CHECK(!memcmp(b.p + 11, s, big) && !strcmp(b.p + 11 + big, tail), "large printf content intact");
    strbuf_reset(&b);
    CHECK(b.len == 0 && b.p[0] == 0 && b.cap > big, "reset keeps storage");
    strbuf_free(&b);
    /* printf result exactly filling the capacity */
    strbuf_putc(&b, '<');
    size_t cap = b.cap;
    s[cap - 2] = 0;
    CHECK(strbuf_printf(&b, "%s", s) == 0 && b.len == cap - 1 && b.cap == cap, "printf to exactly cap - 1 does not grow");
    CHECK(strbuf_printf(&b, "%c", 'Z') == 0 && b.cap > cap && b.p[cap - 1] == 'Z' && b.p[cap] == 0, "printf one past grows");
    free(s);
    strbuf_free(&b);
}

/* ==== Many appends ==== */

static void test_many(void) {
    strbuf b = {0};
    int n = 200000, ok = 1;
    for (int i = 0; i < n; i++) ok &= strbuf_putc(&b, (char)('0' + i % 10)) == 0;
    CHECK(ok && b.len == (size_t)n && !b.oom, "%d single-byte appends", n);
    int same = 1;
    for (int i = 0; i < n; i++) same &= b.p[i] == (char)('0' + i % 10);
    CHECK(same && b.p[n] == 0, "content of many appends");
    CHECK(b.cap < 4 * (size_t)n, "doubling growth stays within 4x (cap %zu)", b.cap);
    for (int i = 0; i < 1000; i++) strbuf_printf(&b, "[%d]", i);
    CHECK(!strncmp(b.p + n, "[0][1][2]", 9) && !strcmp(b.p + b.len - 5, "[999]"), "many printf appends");
    size_t len = 0;
    char *s = strbuf_take(&b, &len);
    CHECK(s && len == strlen(s) && !b.p, "take hands over %zu bytes", len);
    free(s);
}

/* ==== Overflow and sticky oom ==== */

static void test_oom(void) {
    strbuf b = {0};
    strbuf_puts(&b, "keep");
    CHECK(strbuf_put(&b, "x", SIZE_MAX) == -1 && b.oom, "a size that overflows size_t is refused");
    CHECK(b.len == 4 && !strcmp(b.p, "keep"), "refused append leaves content alone");
    CHECK(strbuf_put(&b, "x", SIZE_MAX - 4) == -1, "len + n + NUL == SIZE_MAX + 1 refused");
    CHECK(strbuf_puts(&b, "more") == -1 && strbuf_putc(&b, 'c') == -1 && strbuf_printf(&b, "%d", 1) == -1,
          "oom is sticky: every later append fails");
    CHECK(b.len == 4, "nothing appended after oom");
    CHECK(strbuf_take(&b, NULL) == NULL, "take of an oom buffer is NULL");
    CHECK(!b.p && !b.oom && b.len == 0, "take cleared the oom buffer");

    strbuf_puts(&b, "a");
    strbuf_put(&b, "x", SIZE_MAX);
    strbuf_reset(&b);
    CHECK(!b.oom && b.len == 0 && strbuf_puts(&b, "ok") == 0 && !strcmp(b.p, "ok"), "reset clears oom for reuse");
    strbuf_free(&b);
}

int main(void) {
    test_empty();
    test_exact_cap();
    test_printf();
    test_many();
    test_oom();
    return t_done("test_strbuf");
}
