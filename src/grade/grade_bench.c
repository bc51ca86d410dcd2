/* grade_bench.c - `tandem grade --bench N`: a synthetic class (a fixed
 * rubric and N generated submissions of 3,000-6,000 prompt tokens with it)
 * written under DIR/bench-input, so the grading path can be timed without a
 * real class.
 */
#include "grade/grade_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/xorshift.h"

/* ==== Synthetic class (--bench) ==== */

static const char *const grade_words[] = {
    "inventory", "order", "price", "stock", "customer", "record", "report", "total", "limit", "batch",
    "invoice", "supplier", "warehouse", "item", "count", "update", "check", "load", "store", "parse",
    "result", "value", "index", "entry", "table", "cache", "queue", "event", "status", "amount",
};
#define GRADE_NWORDS (sizeof grade_words / sizeof grade_words[0])

static unsigned grade_rand(unsigned *s) { return xorshift32_next(s); }

static const char *grade_word(unsigned *s) { return grade_words[grade_rand(s) % GRADE_NWORDS]; }

/* A rubric of about 900 tokens: six items with several sentences each. */
static char *grade_bench_rubric(void) {
    static const char *const items[] = {"Correctness", "Error handling", "Structure and naming", "Testing",
                                        "Efficiency", "Documentation"};
    static const int pts[] = {30, 15, 15, 15, 10, 15};
    strbuf b = {0};
    unsigned seed = 12345;
    strbuf_printf(&b, "# Assignment 4: the inventory service\n\nStudents write a small inventory service: load "
                        "orders from a file, update stock levels, and print a report. Grade each item below.\n");
    for (int i = 0; i < 6; i++) {
        strbuf_printf(&b, "\n## %s (%d points)\n\n", items[i], pts[i]);
        for (int k = 0; k < 7; k++)
            strbuf_printf(&b, "- Full marks when every %s %s is %s against the %s %s; deduct points when the %s "
                                "%s is not %s or when the %s of a %s is ignored.\n",
                            grade_word(&seed), grade_word(&seed), grade_word(&seed), grade_word(&seed), grade_word(&seed),
                            grade_word(&seed), grade_word(&seed), grade_word(&seed), grade_word(&seed), grade_word(&seed));
    }
    return strbuf_take(&b, NULL);
}

/* Python-like code of about `bytes` bytes: identifiers of common words,
 * digits, indentation. */
static char *grade_bench_code(unsigned seed, size_t bytes) {
    strbuf b = {0};
    strbuf_printf(&b, "\"\"\"Inventory service, submission %u.\"\"\"\nimport json\nimport sys\n", seed);
    for (int f = 0; b.len < bytes && !b.oom; f++) {
        const char *a = grade_word(&seed), *c = grade_word(&seed), *d = grade_word(&seed);
        strbuf_printf(&b, "\n\ndef %s_%s_%d(%ss, limit=%u):\n", a, c, f, d, grade_rand(&seed) % 100);
        strbuf_printf(&b, "    \"\"\"%s the %s of each %s and return the %s.\"\"\"\n", a, c, d, grade_word(&seed));
        strbuf_printf(&b, "    total = 0\n    for %s in %ss:\n", d, d);
        int n = 2 + (int)(grade_rand(&seed) % 5);
        for (int k = 0; k < n; k++)
            strbuf_printf(&b, "        if %s.%s > limit:\n            total += %s.%s - %u\n", d, grade_word(&seed), d,
                            grade_word(&seed), grade_rand(&seed) % 10);
        strbuf_printf(&b, "    return total\n");
    }
    return strbuf_take(&b, NULL);
}

/* Writes DIR/bench-input/rubric.md and N submissions; sets the paths. */
int grade_bench_setup(grade_opts *o, char **rubric_path) {
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s/bench-input", o->out);
    if (grade_mkdirs(dir)) { fprintf(stderr, "tandem grade: cannot create %s: %s\n", dir, strerror(errno)); return -1; }
    char *rubric = grade_bench_rubric();
    snprintf(path, sizeof path, "%s/rubric.md", dir);
    int rc = rubric ? grade_write_text(path, rubric) : -1;
    free(rubric);
    *rubric_path = strdup(path);
    char **subs = realloc(o->subs, ((size_t)o->n_subs + (size_t)o->bench + 1) * sizeof *subs);
    if (!subs) return -1;
    o->subs = subs;
    /* Submissions span about 2,000 to 5,000 tokens (3,500 to 9,100 bytes of
     * code: a numbered listing of short identifiers and digits runs at about
     * 1.8 bytes per token); with the rubric and the instructions a prompt
     * holds 3,000-6,000 tokens. */
    for (int i = 0; i < o->bench && !rc; i++) {
        double frac = o->bench > 1 ? (double)((i * 7) % o->bench) / (o->bench - 1) : 0.5;
        char *code = grade_bench_code(1000u + (unsigned)i, (size_t)(3500 + 5600 * frac));
        snprintf(path, sizeof path, "%s/student-%03d.py", dir, i + 1);
        rc = code ? grade_write_text(path, code) : -1;
        free(code);
        if (!rc && !(o->subs[o->n_subs++] = strdup(path))) rc = -1;
    }
    if (rc || !*rubric_path) fprintf(stderr, "tandem grade: cannot write the synthetic class in %s\n", dir);
    return rc || !*rubric_path ? -1 : 0;
}
