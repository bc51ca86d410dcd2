/* grade_check.h - what `tandem grade` checks besides grading (issue 40):
 * the preflight before the first submission, which submissions are text at
 * all, whether an analysis's problems point at lines that exist, and the
 * halves (analysis, feedback) a failed run already finished. docs/grade.md.
 */
#ifndef TANDEM_GRADE_CHECK_H
#define TANDEM_GRADE_CHECK_H

#include <stddef.h>

#include <jansson.h>

/* Before the first submission: the router answers GET /v1/models (with the
 * API key when one is given), both models are listed, the analysis model
 * serves a chat request with the rubric's schema (schema_text; NULL with
 * --no-schema) and the feedback model a plain chat request (each asked for
 * one token). 0, or -1 with one message saying what is wrong. A transient
 * answer (no connection, 429, 503, a model not listed yet) is retried
 * `tries` times, wait_s apart. */
int grade_preflight(const char *router, const char *api_key, const char *model_a, const char *model_b,
                    const char *schema_text, int timeout_s, int tries, double wait_s, char *err, size_t errlen);

/* 1 when n bytes look like text: no NUL, and control bytes other than tab,
 * newline, carriage return and form feed are at most 1 in 64 (a text file
 * has none; an executable, an image or an archive many). */
int grade_is_text(const char *p, size_t n);
/* 1 when a text holds nothing but white space. */
int grade_is_blank(const char *p, size_t n);

/* For each problem {"file", "line", ...} of analysis (the parsed answer,
 * left as the schema has it), in order, {"file", "line", "located"}:
 * located is true when files (the submission's [{"path", "lines"}]) has
 * that file ("./" dropped; a base name matches a file in a folder) and the
 * line is within it, else false with "error" saying which. The array (new
 * reference); *n_bad gets how many are not located. */
json_t *grade_check_problems(json_t *analysis, json_t *files, int *n_bad);

/* A previous record of the same submission, rubric and models that failed:
 * which halves it finished (*have_a: the analysis came back, valid, or
 * invalid when !regrade_invalid; *have_b: the feedback came back). */
void grade_prev_halves(json_t *prev, int regrade_invalid, int *have_a, int *have_b);
/* Copies half which (0 analysis, 1 feedback) of prev into rec, marked
 * "reused": true in its timings. */
void grade_reuse_half(json_t *rec, json_t *prev, int which);

#endif
