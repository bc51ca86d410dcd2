/* bench_spec.c - `tandem bench`'s speculative mode (--draft-model FILE
 * and/or --lookup N): the decode node's scheduler in process, on a real
 * prompt, each stream count run plainly and with the draft source in turn
 * (alternated, -r rounds), printing TPOT, aggregate tokens/s, drafted,
 * accepted and the acceptance rate beside the plain run (a markdown table).
 *
 * TPOT of a stream: (time of its last token - time of its first) / (tokens
 * - 1); the row's TPOT is the mean over streams and rounds. t/s: every
 * stream's tokens after the first over the time from the first stream's
 * first token to the last stream's last. max gap: the longest wait between
 * two of a stream's tokens after its first, over streams and rounds (a
 * stalled step shows there). Each stream gets the same prompt
 * with its own last token (no prefix is shared between slots beyond the
 * prompt's body; every run changes the prompt's second token so that no
 * cache holds it), generates exactly -n tokens (end-of-generation ignored).
 */
#include "cmd/bench_spec.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cliopt.h"
#include "cmd/cli.h"
#include "engine/generate.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "node/draft.h"
#include "node/scheduler.h"

#define BS "tandem bench"
/* Stream counts in one run at most (-np list). */
#define BS_MAX_LIST 8
/* The most streams a row may run (the scheduler's slots). */
#define BS_MAX_STREAMS 64
/* Prompt bytes read from -f at most. */
#define BS_MAX_PROMPT_BYTES (1 << 20)
/* A wait for the next token longer than this ends the run (a stuck
 * scheduler should not hang a benchmark). */
#define BS_WAIT_MS 120000

/* A quoting prompt: the answer is asked to repeat lines of the text, the
 * grading workload's shape (feedback quotes the submission). */
static const char BS_DEFAULT_PROMPT[] =
    "Review this function and quote each line you comment on.\n"
    "def total(items):\n    s = 0\n    for x in items:\n        s = s + x\n    return s\n"
    "def mean(items):\n    if not items:\n        return 0\n    return total(items) / len(items)\n"
    "Feedback, quoting each line:\n";

/* ==== Options ==== */

typedef struct {
    const char *model, *draft_model, *prompt_file, *prompt;
    int threads, n_gen, reps, lookup, draft_max, fixed;
    int streams[BS_MAX_LIST], n_streams;
    float temp;
} bs_opts;

static void bs_usage(FILE *f) {
    fprintf(f,
        "usage: tandem bench -m MODEL.gguf (--draft-model FILE | --lookup N) [options]\n"
        "speculative mode: plain and speculative decoding alternated on the scheduler\n"
        "  --draft-model FILE  a draft model with the same vocabulary\n"
        "  --lookup N          prompt lookup, up to N drafts per step\n"
        "  --draft-max N       drafts per step from the draft model (default 8)\n"
        "  --fixed             every step asks for the most drafts (no adaptation)\n"
        "  -np N[,N..]         streams decoding together (default 1,8)\n"
        "  -n N                tokens per stream (default 128)\n"
        "  -r N                rounds, each: plain then speculative (default 2)\n"
        "  -t N                threads (default 2)\n"
        "  -f FILE | -p TEXT   the prompt (default: a short quoting review prompt)\n"
        "  --temp T            sampling temperature (default 0: greedy)\n");
}

static int bs_parse(int argc, char **argv, bs_opts *o) {
    memset(o, 0, sizeof *o);
    o->threads = 2;
    o->n_gen = 128;
    o->reps = 2;
    o->streams[0] = 1;
    o->streams[1] = 8;
    o->n_streams = 2;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, used = 1;
        if (cliopt_is_help(a)) { bs_usage(stdout); return 1; }
        if (!strcmp(a, "-m")) bad = cliopt_str(BS, a, v, &o->model);
        else if (!strcmp(a, "--draft-model")) bad = cliopt_str(BS, a, v, &o->draft_model);
        else if (!strcmp(a, "--lookup")) bad = cliopt_int(BS, a, v, 1, 16, &o->lookup);
        else if (!strcmp(a, "--draft-max")) bad = cliopt_int(BS, a, v, 1, 16, &o->draft_max);
        else if (!strcmp(a, "-n")) bad = cliopt_int(BS, a, v, 2, 8192, &o->n_gen);
        else if (!strcmp(a, "-r")) bad = cliopt_int(BS, a, v, 1, 100, &o->reps);
        else if (!strcmp(a, "-t")) bad = cliopt_int(BS, a, v, 1, 512, &o->threads);
        else if (!strcmp(a, "-f")) bad = cliopt_str(BS, a, v, &o->prompt_file);
        else if (!strcmp(a, "-p")) bad = cliopt_str(BS, a, v, &o->prompt);
        else if (!strcmp(a, "--temp")) bad = cliopt_float(BS, a, v, 0, 10, &o->temp);
        else if (!strcmp(a, "--fixed")) { o->fixed = 1; used = 0; }
        else if (!strcmp(a, "-np")) bad = cliopt_int_list(BS, a, v, 1, BS_MAX_STREAMS, o->streams, BS_MAX_LIST, &o->n_streams);
        else { fprintf(stderr, BS ": unknown option %s in the speculative mode\n", a); bad = 1; used = 0; }
        if (bad) return -1;
        i += used;
    }
    if (!o->model) { fprintf(stderr, BS ": give -m MODEL.gguf\n"); return -1; }
    return 0;
}

/* ==== One row ==== */

typedef struct {
    sched *sc;
    sched_job *j;
    double t_first, t_end, gap_max;
    int n_gen, drafted, accepted, ok;
} bs_stream;

static void *bs_stream_wait(void *arg) {
    bs_stream *st = arg;
    int have = 0;
    double prev = 0;
    for (;;) {
        const sched_view *v = sched_wait(st->sc, st->j, have, BS_WAIT_MS);
        if (v->n_gen == have && v->state != SJ_DONE) break;   /* timed out */
        double now = gen_now_ms();
        /* the longest wait between tokens after the first (a stalled step) */
        if (have > 0 && v->n_gen > have && now - prev > st->gap_max) st->gap_max = now - prev;
        if (v->n_gen > have) prev = now;
        have = v->n_gen;
        if (v->state == SJ_DONE) {
            st->t_end = gen_now_ms();
            st->t_first = v->t_first;
            st->n_gen = v->n_gen;
            st->drafted = v->drafted;
            st->accepted = v->accepted;
            st->ok = v->finish && !strcmp(v->finish, "length");
            break;
        }
    }
    return NULL;
}

typedef struct {
    double tpot_ms, tps, gap_ms;
    long drafted, accepted;
    int runs;
} bs_row;

/* Runs so far (each run's prompts differ: bs_run). */
static int bs_run_no;

/* n streams at once on sc; adds to row. */
static int bs_run(sched *sc, const int32_t *ids, int np, const bs_opts *o, int n, bs_row *row, char *err,
                  size_t errlen) {
    bs_stream st[BS_MAX_STREAMS];
    pthread_t th[BS_MAX_STREAMS];
    memset(st, 0, sizeof st);
    int started = 0, rc = 0;
    for (int i = 0; i < n; i++) {
        sched_req r;
        memset(&r, 0, sizeof r);
        if (!(r.prompt = malloc(sizeof(int32_t) * (size_t)np))) { rc = -1; break; }
        memcpy(r.prompt, ids, sizeof(int32_t) * (size_t)np);
        /* every run's prompts are new to the caches (as a new request's
         * are: the draft model catches up on them), streams differ too */
        r.prompt[np - 1] = ids[(np - 1 + i) % np];
        if (np > 2) r.prompt[1] = ids[1 + (bs_run_no * 131 + i * 17) % (np - 1)];
        r.n_prompt = np;
        r.max_tokens = o->n_gen;
        r.ignore_eos = 1;
        r.sp = sampler_defaults();
        r.sp.temp = o->temp;
        r.sp.seed = (uint64_t)(i + 1);
        st[i].sc = sc;
        if (sched_submit(sc, &r, &st[i].j)) { rc = -1; break; }
        if (pthread_create(&th[i], NULL, bs_stream_wait, &st[i])) { sched_release(sc, st[i].j); rc = -1; break; }
        started++;
    }
    bs_run_no++;
    double first = 0, last = 0;
    long tokens = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        sched_release(sc, st[i].j);
        if (!st[i].ok || st[i].n_gen < 2) { rc = -1; continue; }
        row->tpot_ms += (st[i].t_end - st[i].t_first) / (st[i].n_gen - 1) / n;
        if (st[i].gap_max > row->gap_ms) row->gap_ms = st[i].gap_max;
        row->drafted += st[i].drafted;
        row->accepted += st[i].accepted;
        tokens += st[i].n_gen - 1;
        if (!first || st[i].t_first < first) first = st[i].t_first;
        if (st[i].t_end > last) last = st[i].t_end;
    }
    if (rc) { snprintf(err, errlen, "a stream failed or timed out"); return -1; }
    row->tps += last > first ? tokens * 1000.0 / (last - first) : 0;
    row->runs++;
    return 0;
}

static sched *bs_sched(model *m, draft_src *d, int n_slots, int n_ctx, char *err, size_t errlen) {
    sched_opts so = { .n_slots = n_slots, .queue_max = BS_MAX_STREAMS, .n_ctx = n_ctx,
                      .kv_dtype = kv_dtype_parse("f16"), .prefill_budget = 256, .min_reuse = 1 << 30, .draft = d };
    sched *sc = NULL;
    return sched_create(&sc, m, &so, err, errlen) ? NULL : sc;
}

/* ==== The table ==== */

static void bs_print(const char *kind, int n, const bs_row *plain, const bs_row *spec) {
    double pt = plain->tpot_ms / plain->runs, st = spec->tpot_ms / spec->runs;
    printf("| plain | %d | %.2f | %.1f | %.1f | | | | |\n", n, pt, plain->tps / plain->runs, plain->gap_ms);
    printf("| %s | %d | %.2f | %.1f | %.1f | %ld | %ld | %.2f | %.2fx |\n", kind, n, st, spec->tps / spec->runs, spec->gap_ms,
           spec->drafted / spec->runs, spec->accepted / spec->runs,
           spec->drafted ? (double)spec->accepted / (double)spec->drafted : 0.0, st > 0 ? pt / st : 0.0);
    fflush(stdout);
}

static int bs_prompt(model *m, const bs_opts *o, int32_t **ids, int *np, char *err, size_t errlen) {
    size_t len = 0;
    char *text = NULL;
    const char *t = o->prompt ? o->prompt : BS_DEFAULT_PROMPT;
    if (o->prompt_file) {
        if (!(text = cliopt_read_text(o->prompt_file, BS_MAX_PROMPT_BYTES, &len, err, errlen))) return -1;
        t = text;
    } else len = strlen(t);
    int cap = (int)len + 8;
    *ids = malloc(sizeof(int32_t) * (size_t)cap);
    int64_t n = *ids ? tokenizer_encode(model_get_tokenizer(m), t, len, 1, 0, *ids, cap) : -1;
    free(text);
    if (n < 2) { snprintf(err, errlen, "the prompt encodes to %lld tokens (need 2 or more)", (long long)n); return -1; }
    *np = (int)n;
    return 0;
}

int bench_spec_main(int argc, char **argv) {
    bs_opts o;
    int pr = bs_parse(argc, argv, &o);
    if (pr) return pr > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE;
    char err[512] = "";
    model_opts mo = { .n_threads = o.threads, .fingerprint_later = 1 };
    model *m = NULL, *dm = NULL;
    draft_src *d = NULL;
    int32_t *ids = NULL;
    int np = 0, rc = CLI_EXIT_FAIL, max_s = 1;
    for (int i = 0; i < o.n_streams; i++) max_s = o.streams[i] > max_s ? o.streams[i] : max_s;
    if (model_load(&m, o.model, &mo, err, sizeof err)) goto out;
    if (o.draft_model && model_load(&dm, o.draft_model, &mo, err, sizeof err)) goto out;
    if (bs_prompt(m, &o, &ids, &np, err, sizeof err)) goto out;
    int n_ctx = np + o.n_gen + 32;
    draft_opts dro = { .lookup = o.lookup, .dm = dm, .draft_max = o.draft_max, .n_slots = max_s, .n_ctx = n_ctx,
                       .kv_dtype = kv_dtype_parse("f16"), .fixed = o.fixed };
    if (draft_create(&d, m, &dro, err, sizeof err)) goto out;
    if (!d) { snprintf(err, sizeof err, "give --draft-model FILE or --lookup N"); goto out; }
    printf("speculative bench: %s, drafts %s%s%s, prompt %d tokens, %d tokens per stream, %d rounds, -t %d, temp %.2f%s\n\n",
           o.model, draft_kind(d), dm ? " " : "", dm ? o.draft_model : "", np, o.n_gen, o.reps, o.threads, o.temp,
           o.fixed ? ", fixed draft length" : "");
    printf("| decoding | streams | TPOT ms | t/s | max gap ms | drafted | accepted | acceptance | TPOT speed-up |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < o.n_streams; i++) {
        int n = o.streams[i];
        bs_row plain = {0}, spec = {0};
        sched *sp = bs_sched(m, NULL, n, n_ctx, err, sizeof err), *ss = sp ? bs_sched(m, d, n, n_ctx, err, sizeof err) : NULL;
        int ok = sp && ss;
        /* a warm-up of each, then the rounds alternated */
        bs_row warm = {0};
        ok = ok && !bs_run(sp, ids, np, &o, n, &warm, err, sizeof err) && !bs_run(ss, ids, np, &o, n, &warm, err, sizeof err);
        for (int r = 0; ok && r < o.reps; r++)
            ok = !bs_run(sp, ids, np, &o, n, &plain, err, sizeof err) && !bs_run(ss, ids, np, &o, n, &spec, err, sizeof err);
        sched_destroy(sp);
        sched_destroy(ss);
        if (!ok) goto out;
        bs_print(draft_kind(d), n, &plain, &spec);
    }
    rc = CLI_EXIT_OK;
out:
    if (rc != CLI_EXIT_OK) fprintf(stderr, BS ": %s\n", err);
    draft_free(d);
    free(ids);
    model_free(dm);
    model_free(m);
    return rc;
}

int bench_spec_wanted(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--draft-model") || !strcmp(argv[i], "--lookup")) return 1;
    return 0;
}
