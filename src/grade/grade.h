/* grade.h - `tandem grade`: grade a class of student submissions through a
 * tandem router (docs/grade.md).
 *
 * For each submission two chat requests go out at once: a code-analysis
 * model answers JSON that follows a schema derived from the rubric (scores,
 * justifications, total, problems with line numbers), a feedback model
 * writes prose to the student. Results land in one JSON file per submission
 * and a class report (Markdown + self-contained HTML).
 *
 *   grade.c         options, the class, scheduling, setup (grade_internal.h: the
 *                   types and functions its files share)
 *   grade_files.c   the output folder, reading and writing files, submissions
 *   grade_call.c    the OpenAI client: one streamed chat request, retries
 *   grade_summary.c progress, the router's counters, the summary
 *   grade_bench.c   the synthetic class of --bench
 *   grade_rubric.c  rubric parsing, the derived JSON schema, the schema validator,
 *                   prompt templates (pure functions: unit-tested and fuzzed)
 *   grade_report.c  the class report (Markdown, HTML with an inline SVG chart)
 *   grade_check.c   the preflight, text and blank files, problems' locations, kept halves
 */
#ifndef TANDEM_GRADE_H
#define TANDEM_GRADE_H

#include <stddef.h>

#include <jansson.h>

/* tandem grade ARGS: the subcommand (main.c dispatches to it); returns the
 * process exit status. */
int cli_grade(int argc, char **argv);

/* ==== Rubric ==== */

/* Bounds on what a rubric may hold: a class rubric has a handful of items;
 * these keep a hostile file from blowing up the schema or the prompts. */
#define GRADE_MAX_ITEMS 64
#define GRADE_MAX_POINTS 1000
#define GRADE_MAX_RUBRIC_BYTES (256 * 1024)

typedef struct {
    char name[160];          /* as written in the rubric */
    char key[48];            /* property name in the schema: lowercase slug, unique */
    int max_points;
    char *description;       /* text under a heading item, or after ':' of a list item */
} grade_item;

typedef struct {
    char title[160];         /* first "# " heading, or "" */
    grade_item *items;
    int n_items;
    int max_total;
    char *text;              /* the rubric file as given (NUL-terminated), sent to the models */
} grade_rubric;

/* Parses a Markdown rubric (format in docs/grade.md): items are headings
 * "## Name (N points)" or list entries "- Name (N pts): description".
 * 0, or -1 with a message naming the line. */
int grade_rubric_parse(const char *text, size_t len, grade_rubric *r, char *err, size_t errlen);
void grade_rubric_free(grade_rubric *r);

/* The JSON schema an analysis must follow (new reference):
 * {"scores": {KEY: {"score": 0..max, "justification": str}...}, "total": int,
 *  "problems": [{"file": str, "line": int >= 1, "description": str}]} */
json_t *grade_rubric_schema(const grade_rubric *r);

/* ==== Schema validation ==== */

/* Validates v against a schema in the subset tandem supports: type,
 * properties, required, additionalProperties (false or a schema), items,
 * minItems, maxItems, enum, const, minimum, maximum, anyOf, $ref to
 * "#/$defs/NAME". Keywords outside the subset make the schema invalid (so a
 * typo is not silently ignored). 0 when valid, -1 with "path: reason". */
int grade_schema_validate(json_t *schema, json_t *v, char *err, size_t errlen);

/* Parses a model's analysis text (a JSON object, possibly wrapped in a
 * ```json fence) and validates it against the rubric's schema. Returns the
 * object (new reference) or NULL with the reason. */
json_t *grade_analysis_parse(const grade_rubric *r, json_t *schema, const char *text, char *err, size_t errlen);

/* ==== Prompt templates ==== */

/* A template is text with a "[system]" and a "[user]" section (lines of
 * their own) and placeholders {{rubric}}, {{schema}}, {{items}},
 * {{max_total}}, {{name}}, {{submission}}. */
typedef struct {
    char *system, *user;
} grade_template;

extern const char grade_default_analysis_template[];
extern const char grade_default_feedback_template[];

/* Splits a template into its sections and checks its placeholders; a
 * submission placeholder in the system section is refused: the system
 * message is the prefix every request of the class shares. */
int grade_template_parse(const char *text, grade_template *t, char *err, size_t errlen);
void grade_template_free(grade_template *t);

typedef struct {
    const char *rubric, *schema, *items, *max_total, *name, *submission;
} grade_vars;

/* The section with every placeholder replaced (malloc'd), or NULL. */
char *grade_template_render(const char *section, const grade_vars *v);

/* ==== Small shared helpers ==== */

/* A copy of s with invalid UTF-8 sequences replaced by U+FFFD and NUL
 * bytes dropped (jansson refuses both). */
char *grade_utf8_clean(const char *s, size_t len);
/* Output file stem for a submission name: [A-Za-z0-9._-], others '_'. */
void grade_file_stem(const char *name, char *out, size_t outlen);

/* ==== Output files (grade_files.c) ==== */

/* Creates (truncates) path for writing with O_NOFOLLOW: a symbolic link
 * planted at an output name is refused, never written through. NULL with
 * errno set. */
#include <stdio.h>
FILE *grade_create_file(const char *path);

/* ==== Report (grade_report.c) ==== */

/* Writes DIR/report.md, DIR/report.html, DIR/totals.svg and
 * DIR/feedback/STEM.md from the per-submission records (the JSON objects
 * written to DIR/STEM.json, in class order). 0, or -1 with a message. */
int grade_report_write(const char *dir, const grade_rubric *r, json_t *const *records, int n,
                       char *err, size_t errlen);
/* The histogram of totals as an SVG document (malloc'd). */
char *grade_report_svg(const grade_rubric *r, json_t *const *records, int n);

#endif
