/* bench_serve.c - `tandem bench-serve`: a serving benchmark for any
 * OpenAI-compatible server (a tandem router, llama.cpp's llama-server).
 *
 * For each concurrency level C, C client threads each send R streaming
 * POST /v1/completions requests back to back (distinct prompts of W random
 * words, max_tokens N, greedy), and the level reports:
 *   aggregate t/s = all completion tokens / wall time of the level,
 *   TTFT p50/p99 (request sent -> first text chunk),
 *   TPOT p50/p99 ((last chunk - first chunk) / (tokens - 1), per request).
 * Tokens are counted from the stream's usage chunk when the server sends
 * one (stream_options.include_usage), else one per text chunk. The same
 * client measures every server, so the numbers compare like for like.
 * A benchmark, not a test: nothing here asserts a speed.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>
#include <jansson.h>

#include "cmd/cli.h"
#include "base/cliopt.h"
#include "engine/generate.h"

/* ==== Options ==== */

#define BS_MAX_LEVELS 16
#define BS_MAX_CLIENTS 256

typedef struct {
    const char *url, *model, *api_key;
    char *prompt_text;            /* -f: every request's prompt, or NULL (random words) */
    json_t *response_format;      /* sent with every request, or NULL */
    int levels[BS_MAX_LEVELS], n_levels;
    int requests, words, max_tokens;
    double temperature;
    int json;
} bs_opts;

#define BS "tandem bench-serve"

static void bs_usage(FILE *f) {
    fprintf(f,
        "usage: tandem bench-serve --url http://HOST:PORT --model NAME [options]\n"
        "  --url URL          server base URL (a tandem router or any OpenAI-compatible server)\n"
        "  --model NAME       the model field of each request\n"
        "  -c LIST            concurrent streams per level (default 1,2,4,8,16)\n"
        "  -r N               requests per stream per level, 1..1000 (default 3)\n"
        "  -w N               words per prompt, 1..100000 (default 32)\n"
        "  -f FILE            every request's prompt is this file's text instead (up to 1 MiB; e.g. a\n"
        "                     grading prompt whose answer quotes it: speculative decoding by prompt lookup)\n"
        "  -n N               max_tokens, 1..1000000 (default 64)\n"
        "  --temp T           temperature, 0..2 (default 0: greedy)\n"
        "  --api-key KEY      sent as a Bearer token\n"
        "  --response-format json_object|SCHEMA.json   constrained output (TPOT with a schema)\n"
        "  -o md|json         output format (default md)\n");
}

/* -f FILE: the whole file (at most 1 MiB) as a NUL-terminated string. */
static int bs_read_prompt(const char *path, char **out) {
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f) { fprintf(stderr, BS ": -f: cannot open '%s'\n", path ? path : ""); return -1; }
    enum { CAP = 1 << 20 };
    char *p = malloc(CAP + 1);
    size_t n = p ? fread(p, 1, CAP + 1, f) : 0;
    fclose(f);
    if (!p || n == 0 || n > CAP) {
        fprintf(stderr, BS ": -f: '%s' is empty or over 1 MiB\n", path);
        free(p);
        return -1;
    }
    p[n] = 0;
    free(*out);
    *out = p;
    return 0;
}

static int bs_parse(int argc, char **argv, bs_opts *o) {
    memset(o, 0, sizeof *o);
    int def[] = { 1, 2, 4, 8, 16 };
    memcpy(o->levels, def, sizeof def);
    o->n_levels = 5;
    o->requests = 3; o->words = 32; o->max_tokens = 64;
    static const char *const fmts[] = { "md", "json", NULL };
    for (int i = 0; i < argc; i += 2) {   /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        float temp;
        if (cliopt_is_help(a)) { bs_usage(stdout); return 1; }
        else if (!strcmp(a, "--url")) bad = cliopt_str(BS, a, v, &o->url);
        else if (!strcmp(a, "--model")) bad = cliopt_str(BS, a, v, &o->model);
        else if (!strcmp(a, "--api-key")) bad = cliopt_str(BS, a, v, &o->api_key);
        else if (!strcmp(a, "--response-format")) {
            json_t *schema = v && strcmp(v, "json_object") ? json_load_file(v, 0, NULL) : NULL;
            bad = !v || (strcmp(v, "json_object") && !json_is_object(schema));
            if (!bad) o->response_format = schema ? json_pack("{s:s, s:{s:s, s:o}}", "type", "json_schema", "json_schema",
                                                              "name", "bench", "schema", schema)
                                                  : json_pack("{s:s}", "type", "json_object");
            else fprintf(stderr, BS ": --response-format: '%s' is neither json_object nor a JSON schema file\n", v ? v : "");
        }
        else if (!strcmp(a, "-r")) bad = cliopt_int(BS, a, v, 1, 1000, &o->requests);
        else if (!strcmp(a, "-w")) bad = cliopt_int(BS, a, v, 1, 100000, &o->words);
        else if (!strcmp(a, "-f")) bad = bs_read_prompt(v, &o->prompt_text);
        else if (!strcmp(a, "-n")) bad = cliopt_int(BS, a, v, 1, 1000000, &o->max_tokens);
        else if (!strcmp(a, "--temp")) { bad = cliopt_float(BS, a, v, 0, 2, &temp); o->temperature = temp; }
        else if (!strcmp(a, "-o")) bad = cliopt_choice(BS, a, v, fmts, &o->json);
        else if (!strcmp(a, "-c")) bad = cliopt_int_list(BS, a, v, 1, BS_MAX_CLIENTS, o->levels, BS_MAX_LEVELS, &o->n_levels);
        else { fprintf(stderr, BS ": unknown option %s (see tandem bench-serve --help)\n", a); return -1; }
        if (bad) return -1;   /* the message is out */
    }
    if (!o->url || !o->model) {
        if (argc) fprintf(stderr, BS ": give --url URL and --model NAME\n");
        bs_usage(stderr);
        return -1;
    }
    return 0;
}

/* ==== One streamed request ==== */

typedef struct {
    double t0, t_first, t_last;
    int chunks, usage_tokens, failed;
    char buf[65536];
    size_t len;
} bs_stream;

/* One SSE event's data: a text chunk, a usage chunk, [DONE] or an error. */
static void bs_event(bs_stream *s, const char *data) {
    if (!strcmp(data, "[DONE]")) return;
    json_t *o = json_loads(data, 0, NULL);
    if (!o) return;
    if (json_object_get(o, "error")) s->failed = 1;
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    const char *text = json_string_value(json_object_get(ch, "text"));
    if (text && *text) {
        double now = gen_now_ms();
        if (!s->chunks) s->t_first = now;
        s->t_last = now;
        s->chunks++;
    }
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) s->usage_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
    json_decref(o);
}

static size_t bs_write(char *p, size_t sz, size_t nm, void *ud) {
    bs_stream *s = ud;
    size_t n = sz * nm;
    if (s->len + n >= sizeof s->buf) { s->failed = 1; return 0; }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
    s->buf[s->len] = 0;
    char *ev;
    while ((ev = strstr(s->buf, "\n\n"))) {
        *ev = 0;
        for (char *line = s->buf; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            if (!strncmp(line, "data: ", 6)) bs_event(s, line + 6);
            line = nl ? nl + 1 : NULL;
        }
        size_t used = (size_t)(ev + 2 - s->buf);
        memmove(s->buf, ev + 2, s->len - used + 1);
        s->len -= used;
    }
    return n;
}

static const char *const bs_vocab[] = {
    "river", "student", "code", "function", "loop", "grade", "mountain", "quiet", "bright", "number",
    "window", "garden", "rubric", "answer", "signal", "memory", "silver", "engine", "harbor", "pencil",
    "forest", "planet", "market", "lesson", "puzzle", "bridge", "candle", "winter", "summer", "castle",
};

static char *bs_prompt(int words, unsigned seed) {
    size_t cap = (size_t)words * 12 + 16;
    char *p = malloc(cap);
    if (!p) return NULL;
    size_t n = 0;
    for (int i = 0; i < words; i++) {
        seed = seed * 1103515245u + 12345u;
        n += (size_t)snprintf(p + n, cap - n, "%s%s", i ? " " : "", bs_vocab[(seed >> 16) % 30]);
    }
    return p;
}

/* 0 and the token count, or -1. */
static int bs_request(const bs_opts *o, unsigned seed, bs_stream *s) {
    memset(s, 0, sizeof *s);
    char *prompt = o->prompt_text ? strdup(o->prompt_text) : bs_prompt(o->words, seed);
    json_t *req = json_object();
    json_object_set_new(req, "model", json_string(o->model));
    json_object_set_new(req, "prompt", json_string(prompt ? prompt : "hello"));
    json_object_set_new(req, "max_tokens", json_integer(o->max_tokens));
    json_object_set_new(req, "temperature", json_real(o->temperature));
    json_object_set_new(req, "stream", json_true());
    json_t *so = json_object();
    json_object_set_new(so, "include_usage", json_true());
    json_object_set_new(req, "stream_options", so);
    if (o->response_format) json_object_set(req, "response_format", o->response_format);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    free(prompt);
    char url[1024], auth[512];
    snprintf(url, sizeof url, "%s/v1/completions", o->url);
    CURL *c = curl_easy_init();
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    if (o->api_key) { snprintf(auth, sizeof auth, "Authorization: Bearer %s", o->api_key); h = curl_slist_append(h, auth); }
    long status = 0;
    CURLcode rc = CURLE_FAILED_INIT;
    if (c && body) {
        curl_easy_setopt(c, CURLOPT_URL, url);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, bs_write);
        curl_easy_setopt(c, CURLOPT_WRITEDATA, s);
        curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(c, CURLOPT_TIMEOUT, 600L);
        s->t0 = gen_now_ms();
        rc = curl_easy_perform(c);
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    }
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    free(body);
    if (rc != CURLE_OK || status != 200 || s->failed || !s->chunks) return -1;
    return 0;
}

/* ==== A level ==== */

typedef struct {
    const bs_opts *o;
    int id, level;
    double *ttft, *tpot;          /* [requests] */
    int n_ok, n_fail;
    long tokens;
} bs_client;

static void *bs_client_main(void *arg) {
    bs_client *c = arg;
    bs_stream *s = malloc(sizeof *s);
    for (int r = 0; s && r < c->o->requests; r++) {
        unsigned seed = (unsigned)(c->level * 100003 + c->id * 1009 + r);
        if (bs_request(c->o, seed, s)) { c->n_fail++; continue; }
        int toks = s->usage_tokens > 0 ? s->usage_tokens : s->chunks;
        c->ttft[c->n_ok] = s->t_first - s->t0;
        c->tpot[c->n_ok] = toks > 1 ? (s->t_last - s->t_first) / (toks - 1) : NAN;
        c->tokens += toks;
        c->n_ok++;
    }
    free(s);
    return NULL;
}

static int bs_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of the finite values. */
static double bs_pct(double *v, int n, double p) {
    int k = 0;
    for (int i = 0; i < n; i++) if (isfinite(v[i])) v[k++] = v[i];
    if (!k) return NAN;
    qsort(v, (size_t)k, sizeof *v, bs_cmp);
    int idx = (int)ceil(p / 100.0 * k) - 1;
    return v[idx < 0 ? 0 : idx];
}

typedef struct { int level, ok, fail; long tokens; double wall_s, tps, ttft50, ttft99, tpot50, tpot99; } bs_row;

static int bs_level(const bs_opts *o, int level, bs_row *row) {
    bs_client *cl = calloc((size_t)level, sizeof *cl);
    pthread_t *th = calloc((size_t)level, sizeof *th);
    double *ttft = calloc((size_t)level * (size_t)o->requests, sizeof(double));
    double *tpot = calloc((size_t)level * (size_t)o->requests, sizeof(double));
    if (!cl || !th || !ttft || !tpot) { free(cl); free(th); free(ttft); free(tpot); return -1; }
    double t0 = gen_now_ms();
    for (int i = 0; i < level; i++) {
        cl[i] = (bs_client){ .o = o, .id = i, .level = level, .ttft = ttft + (size_t)i * o->requests,
                             .tpot = tpot + (size_t)i * o->requests };
        pthread_create(&th[i], NULL, bs_client_main, &cl[i]);
    }
    for (int i = 0; i < level; i++) pthread_join(th[i], NULL);
    double wall = (gen_now_ms() - t0) / 1e3;
    memset(row, 0, sizeof *row);
    row->level = level;
    row->wall_s = wall;
    /* gather every client's samples at the front */
    int n = 0;
    for (int i = 0; i < level; i++) {
        for (int k = 0; k < cl[i].n_ok; k++) { ttft[n] = cl[i].ttft[k]; tpot[n] = cl[i].tpot[k]; n++; }
        row->ok += cl[i].n_ok;
        row->fail += cl[i].n_fail;
        row->tokens += cl[i].tokens;
    }
    row->tps = wall > 0 ? row->tokens / wall : 0;
    row->ttft50 = bs_pct(ttft, n, 50);
    row->ttft99 = bs_pct(ttft, n, 99);
    row->tpot50 = bs_pct(tpot, n, 50);
    row->tpot99 = bs_pct(tpot, n, 99);
    free(cl); free(th); free(ttft); free(tpot);
    return 0;
}

/* ==== Entry ==== */

int cli_bench_serve(int argc, char **argv) {
    bs_opts o;
    int p = bs_parse(argc, argv, &o);
    if (p) return p > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!o.json) {
        if (o.prompt_text)
            printf("%s, model %s, a %zu-byte prompt file, max_tokens %d, temperature %g, %d requests per stream\n\n",
                   o.url, o.model, strlen(o.prompt_text), o.max_tokens, o.temperature, o.requests);
        else
            printf("%s, model %s, %d-word prompts, max_tokens %d, temperature %g, %d requests per stream\n\n", o.url,
                   o.model, o.words, o.max_tokens, o.temperature, o.requests);
        printf("| streams | requests ok | failed | tokens | aggregate t/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |\n");
        printf("|---|---|---|---|---|---|---|---|---|\n");
    } else {
        printf("[");
    }
    int rc = 0;
    for (int i = 0; i < o.n_levels; i++) {
        bs_row r;
        if (bs_level(&o, o.levels[i], &r)) { rc = 1; break; }
        if (o.json)
            printf("%s{\"streams\":%d,\"ok\":%d,\"failed\":%d,\"tokens\":%ld,\"wall_s\":%.3f,\"tps\":%.2f,"
                   "\"ttft_p50_ms\":%.1f,\"ttft_p99_ms\":%.1f,\"tpot_p50_ms\":%.2f,\"tpot_p99_ms\":%.2f}",
                   i ? "," : "", r.level, r.ok, r.fail, r.tokens, r.wall_s, r.tps, r.ttft50, r.ttft99, r.tpot50, r.tpot99);
        else
            printf("| %d | %d | %d | %ld | %.1f | %.0f | %.0f | %.1f | %.1f |\n", r.level, r.ok, r.fail, r.tokens, r.tps,
                   r.ttft50, r.ttft99, r.tpot50, r.tpot99);
        fflush(stdout);
        if (r.fail) rc = 1;
    }
    if (o.json) printf("]\n");
    curl_global_cleanup();
    free(o.prompt_text);
    return rc;
}
