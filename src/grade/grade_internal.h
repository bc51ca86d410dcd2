/* grade_internal.h - between the files of `tandem grade`'s client (not
 * part of the interface: grade.h is): grade.c (options, the class, one
 * submission's two requests, workers, setup, cli_grade), grade_files.c (the
 * output folder, reading and writing files, submissions walked, listed and
 * hashed), grade_call.c (one streamed chat request with its retries),
 * grade_summary.c (progress, the router's counters, the closing summary),
 * grade_bench.c (the synthetic class of --bench). */

#ifndef TANDEM_GRADE_INTERNAL_H
#define TANDEM_GRADE_INTERNAL_H

#include "grade/grade.h"
#include "base/strbuf.h"

#include <curl/curl.h>
#include <openssl/evp.h>
#include <pthread.h>

/* ==== Options ==== */

typedef struct {
    const char *router, *rubric_path, *model_a, *model_b, *out, *api_key;
    const char *tmpl_a_path, *tmpl_b_path, *write_templates;
    int parallel, tokens_a, tokens_b, retries, timeout_s, max_bytes, bench;
    double temp_a, temp_b, backoff_s;
    int force, regrade_invalid, ignore_eos, quiet, no_schema;
    char **subs;
    int n_subs;
} grade_opts;

/* ==== Submissions (grade_files.c) ==== */

/* A rubric or a prompt template is a page of text; a bigger file is the
 * wrong one (a model, a log), refused before it is read. */
#define GRADE_MAX_CONFIG_BYTES ((size_t)1 << 20)

typedef struct {
    char *path;                  /* as given */
    char name[256];              /* basename */
    char stem[256];              /* output file stem */
    char *listing;               /* numbered listing sent to the models, or NULL */
    json_t *files;               /* [{"path","lines","bytes"}] and skipped files */
    char sha[65];                /* over relative paths and contents */
    char error[512];             /* why it cannot be graded */
    json_t *record;              /* what DIR/STEM.json holds at the end */
    int skipped;
    json_t *prev;                /* a failed earlier record of it: its finished half is kept */
    int n_text, n_blank, n_binary;   /* files listed, those with nothing but white space, binary ones */
    char flag[16];               /* "empty" or "binary": not graded, flagged (no request is spent) */
} grade_sub;

/* ==== One streamed chat request (grade_call.c) ==== */

typedef struct {
    const grade_opts *o;
    const char *model;
    char *body;
    CURL *h;
    /* result of the last attempt */
    long status;
    strbuf text, buf;
    int prompt_tokens, completion_tokens, chunks, done, attempts;
    int cached_tokens;       /* usage.prompt_tokens_details.cached_tokens: the prompt the server had cached */
    double t_send, t_first, t_last, t_end, retry_after_s;
    char finish[16];
    char decode_node[128], plan[16], prefill_node[128];
    char error[512];
    int failed;
} grade_call;

/* ==== The class (grade.c) ==== */

typedef struct { double *v; int n, cap; } grade_series;

enum { GRADE_A = 0, GRADE_B = 1 };   /* the analysis and the feedback request */

typedef struct {
    const grade_opts *o;
    grade_rubric rubric;
    json_t *schema;
    char *schema_text, *items_text;
    char max_total_text[16], rubric_sha[65];
    grade_template tmpl[2];
    grade_sub *subs;
    int n;
    /* scheduling and figures, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int next, running, finished, to_do;
    int graded, failed, skipped, invalid, flagged;
    double t0;
    grade_series latency, ttft[2], tpot[2], ptok[2], ctok[2];
    long long ptok_sum[2], cached_sum[2];   /* this run's prompt tokens, and those served from a cache */
    int plan_split, plan_local;
} grade_class;

/* ==== Summary (grade_summary.c) ==== */

typedef struct { double split, local, dec_split, dec_local; int ok; } grade_router_counts;

/* ==== Shared functions ==== */

/* grade_files.c */
double grade_now_ms(void);
void grade_sleep_ms(double ms);
int grade_mkdirs(const char *path);
int grade_check_out_tree(const char *dir, int depth, long *seen, char *err, size_t errlen);
char *grade_read_regular(const char *path, size_t max, size_t *len, char *err, size_t errlen);
int grade_write_text(const char *path, const char *text);
json_t *grade_json_text(const char *s);
void grade_sha256_str(const char *s, char out[65]);
void grade_sub_load(grade_sub *s, size_t max_bytes);
void grade_sub_name(grade_sub *s);

/* grade_call.c */
int grade_call_run(grade_call *c);
void grade_call_free(grade_call *c);

/* grade.c */
double grade_pct(grade_series *s, double p);

/* grade_summary.c */
void grade_progress(grade_class *g, int tty);
grade_router_counts grade_router_metrics(const grade_opts *o);
void grade_summary(grade_class *g, double wall_s, grade_router_counts before, grade_router_counts after);

/* grade_bench.c */
int grade_bench_setup(grade_opts *o, char **rubric_path);

#endif
