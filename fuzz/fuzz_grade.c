/* fuzz_grade.c - libFuzzer target over the parsers of `tandem grade`: the
 * Markdown rubric (and the schema derived from it), a model's analysis
 * against that schema, prompt templates and their rendering, the schema
 * validator on an arbitrary schema and value, and the totals chart drawn
 * from an arbitrary record. The first byte picks the parser. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "grade/grade.h"

static const char fz_rubric[] = "# Lab\n## Correctness (6 points)\nworks\n- not an item\n## Style (4 pts)\ntidy\n";

static void fz_rubric_parse(const char *s, size_t n) {
    grade_rubric r;
    char err[256];
    if (grade_rubric_parse(s, n, &r, err, sizeof err)) return;
    json_t *schema = grade_rubric_schema(&r);
    char *t = json_dumps(schema, JSON_COMPACT);
    free(t);
    json_decref(schema);
    grade_rubric_free(&r);
}

static void fz_analysis(const char *s) {
    grade_rubric r;
    char err[256];
    if (grade_rubric_parse(fz_rubric, strlen(fz_rubric), &r, err, sizeof err)) abort();
    json_t *schema = grade_rubric_schema(&r);
    json_t *a = grade_analysis_parse(&r, schema, s, err, sizeof err);
    json_decref(a);
    json_decref(schema);
    grade_rubric_free(&r);
}

static void fz_template(const char *s) {
    grade_template t;
    char err[256];
    if (grade_template_parse(s, &t, err, sizeof err)) return;
    grade_vars v = {"R", "S", "I", "10", "{{name}}", "{{submission}}"};
    free(grade_template_render(t.system, &v));
    free(grade_template_render(t.user, &v));
    grade_template_free(&t);
}

/* "schema\0value" */
static void fz_validate(const char *s, size_t n) {
    size_t k = strnlen(s, n);
    if (k == n) return;
    json_t *schema = json_loadb(s, k, JSON_DECODE_ANY, NULL);
    json_t *v = json_loadb(s + k + 1, n - k - 1, JSON_DECODE_ANY, NULL);
    char err[256];
    if (schema && v) grade_schema_validate(schema, v, err, sizeof err);
    json_decref(schema);
    json_decref(v);
}

static void fz_chart(const char *s, size_t n) {
    grade_rubric r;
    char err[256];
    if (grade_rubric_parse(fz_rubric, strlen(fz_rubric), &r, err, sizeof err)) abort();
    json_t *rec = json_loadb(s, n, 0, NULL);
    if (rec) free(grade_report_svg(&r, &rec, 1));
    json_decref(rec);
    grade_rubric_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    size_t n = size - 1;
    char *s = malloc(n + 1);
    if (!s) return 0;
    memcpy(s, data + 1, n);
    s[n] = 0;
    switch (data[0] % 5) {
    case 0: fz_rubric_parse(s, n); break;
    case 1: fz_analysis(s); break;
    case 2: fz_template(s); break;
    case 3: fz_validate(s, n); break;
    default: fz_chart(s, n); break;
    }
    free(s);
    return 0;
}
