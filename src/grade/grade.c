/* grade.c - `tandem grade`: grade a class of submissions through a tandem
 * router (or any OpenAI-compatible server).
 *
 * K worker threads each take the next submission and send its two chat
 * requests at once (the analysis on this thread, the feedback on a helper
 * thread), both streamed so that time to first token and time per output
 * token are measured. A request answered 429 or 503, or a router that cannot
 * be reached, is retried with exponential back-off; anything else that fails
 * is recorded as the submission's failure and the class goes on. Each
 * submission's record is written atomically to DIR/STEM.json; a rerun skips
 * records already graded with the same rubric, submission and models.
 * `--bench N` grades a synthetic class of fixed-length requests.
 */
#include "grade/grade.h"
#include "base/strbuf.h"

#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/cliopt.h"
#include "grade/grade_check.h"

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

static void grade_usage(FILE *f) {
    fprintf(f,
        "usage: tandem grade --router URL --rubric RUBRIC.md --analysis-model A --feedback-model B\n"
        "                    --out DIR [options] SUBMISSION...\n"
        "       tandem grade --bench N --router URL --analysis-model A --feedback-model B --out DIR [options]\n"
        "       tandem grade --write-templates DIR\n"
        "  SUBMISSION            a code file, or a folder (one submission, every text file in it)\n"
        "  --parallel K          submissions in flight (default 4)\n"
        "  --analysis-template F, --feedback-template F   prompt templates (defaults built in)\n"
        "  --analysis-tokens N   max_tokens of the analysis (default 1024; bench 384)\n"
        "  --feedback-tokens N   max_tokens of the feedback (default 768; bench 512)\n"
        "  --analysis-temp T, --feedback-temp T   temperatures (default 0: greedy)\n"
        "  --retries N           retries of a request answered 429/503 (default 6)\n"
        "  --backoff S           first retry delay in seconds, doubled each time (default 0.5)\n"
        "  --timeout S           per-request time limit (default 600)\n"
        "  --max-bytes N         largest submission listing in bytes (default 200000)\n"
        "  --api-key KEY         Bearer token (or env TANDEM_API_KEY)\n"
        "  --force               regrade submissions already graded\n"
        "  --regrade-invalid     regrade submissions whose analysis did not follow the schema\n"
        "  --ignore-eos          generate exactly max_tokens (fixed lengths; --bench sets it)\n"
        "  --no-schema           send no response_format (--bench sets it)\n"
        "  --quiet               no progress line\n"
        "  --bench N             grade a synthetic class of N submissions (3,000-6,000 prompt tokens\n"
        "                        with the rubric) written to DIR/bench-input; regrades every run\n");
}

#define GRADE "tandem grade"

static int grade_int(const char *opt, const char *v, int lo, int hi, int *out) {
    return cliopt_int(GRADE, opt, v, lo, hi, out);
}

static int grade_double(const char *opt, const char *v, double lo, double hi, double *out) {
    return cliopt_double(GRADE, opt, v, lo, hi, out);
}

/* Flags without a value; 1 if a was one. */
static int grade_flag(const char *a, grade_opts *o) {
    if (!strcmp(a, "--force")) o->force = 1;
    else if (!strcmp(a, "--regrade-invalid")) o->regrade_invalid = 1;
    else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = 1;
    else if (!strcmp(a, "--no-schema")) o->no_schema = 1;
    else if (!strcmp(a, "--quiet")) o->quiet = 1;
    else return 0;
    return 1;
}

static int grade_parse(int argc, char **argv, grade_opts *o) {
    memset(o, 0, sizeof *o);
    o->parallel = 4; o->retries = 6; o->timeout_s = 600; o->max_bytes = 200000; o->backoff_s = 0.5;
    o->api_key = getenv("TANDEM_API_KEY");
    o->subs = calloc((size_t)argc + 1, sizeof *o->subs);
    if (!o->subs) return -1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a[0] != '-') { o->subs[o->n_subs++] = argv[i]; continue; }
        if (grade_flag(a, o)) continue;
        int bad = 0;
        if (!strcmp(a, "--router")) bad = cliopt_str(GRADE, a, v, &o->router);
        else if (!strcmp(a, "--rubric")) bad = cliopt_str(GRADE, a, v, &o->rubric_path);
        else if (!strcmp(a, "--analysis-model")) bad = cliopt_str(GRADE, a, v, &o->model_a);
        else if (!strcmp(a, "--feedback-model")) bad = cliopt_str(GRADE, a, v, &o->model_b);
        else if (!strcmp(a, "--out")) bad = cliopt_str(GRADE, a, v, &o->out);
        else if (!strcmp(a, "--api-key")) bad = cliopt_str(GRADE, a, v, &o->api_key);
        else if (!strcmp(a, "--analysis-template")) bad = cliopt_str(GRADE, a, v, &o->tmpl_a_path);
        else if (!strcmp(a, "--feedback-template")) bad = cliopt_str(GRADE, a, v, &o->tmpl_b_path);
        else if (!strcmp(a, "--write-templates")) bad = cliopt_str(GRADE, a, v, &o->write_templates);
        else if (!strcmp(a, "--parallel")) bad = grade_int(a, v, 1, 256, &o->parallel);
        else if (!strcmp(a, "--analysis-tokens")) bad = grade_int(a, v, 1, 1 << 20, &o->tokens_a);
        else if (!strcmp(a, "--feedback-tokens")) bad = grade_int(a, v, 1, 1 << 20, &o->tokens_b);
        else if (!strcmp(a, "--retries")) bad = grade_int(a, v, 0, 100, &o->retries);
        else if (!strcmp(a, "--timeout")) bad = grade_int(a, v, 1, 86400, &o->timeout_s);
        else if (!strcmp(a, "--max-bytes")) bad = grade_int(a, v, 1, 64 << 20, &o->max_bytes);
        else if (!strcmp(a, "--bench")) bad = grade_int(a, v, 1, 10000, &o->bench);
        else if (!strcmp(a, "--analysis-temp")) bad = grade_double(a, v, 0, 2, &o->temp_a);
        else if (!strcmp(a, "--feedback-temp")) bad = grade_double(a, v, 0, 2, &o->temp_b);
        else if (!strcmp(a, "--backoff")) bad = grade_double(a, v, 0, 60, &o->backoff_s);
        else if (cliopt_is_help(a)) { grade_usage(stdout); return 1; }
        else { fprintf(stderr, GRADE ": unknown option %s (see tandem grade --help)\n", a); return -1; }
        if (bad) return -1;   /* the message is out */
        i++;
    }
    if (o->write_templates) return 0;
    if (!o->router || !o->model_a || !o->model_b || !o->out || (!o->bench && (!o->rubric_path || !o->n_subs))) {
        grade_usage(stderr);
        return -1;
    }
    if (o->bench && (o->rubric_path || o->n_subs)) {
        fprintf(stderr, "tandem grade: --bench makes its own rubric and class; give neither --rubric nor submissions\n");
        return -1;
    }
    if (o->bench) { o->force = 1; o->ignore_eos = 1; o->no_schema = 1; }
    if (!o->tokens_a) o->tokens_a = o->bench ? 384 : 1024;
    if (!o->tokens_b) o->tokens_b = o->bench ? 512 : 768;
    return 0;
}

/* ==== Files ==== */

static double grade_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void grade_sleep_ms(double ms) {
    if (ms <= 0) return;
    struct timespec ts = { (time_t)(ms / 1e3), (long)(fmod(ms, 1e3) * 1e6) };
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

/* mkdir -p */
static int grade_mkdirs(const char *path) {
    char p[4096];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0755) && errno != EEXIST) return -1;
        *s = '/';
    }
    return mkdir(p, 0755) && errno != EEXIST ? -1 : 0;
}

FILE *grade_create_file(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return NULL;
    FILE *f = fdopen(fd, "wb");
    if (!f) close(fd);
    return f;
}

/* Folders an output tree may nest and entries it may hold before the
 * symlink check gives up (refusing): grade writes one level of files and
 * feedback/. */
#define GRADE_OUT_MAX_DEPTH 8
#define GRADE_OUT_MAX_ENTRIES 100000

/* 0 when nothing under dir (dir included) is a symbolic link; grade
 * creates none, so one found was planted to redirect a write or a read of
 * an earlier record. -1 with a message. */
static int grade_check_out_tree(const char *dir, int depth, long *seen, char *err, size_t errlen) {
    struct stat st;
    if (lstat(dir, &st)) { snprintf(err, errlen, "cannot read %.400s: %s", dir, strerror(errno)); return -1; }
    if (S_ISLNK(st.st_mode)) { snprintf(err, errlen, "%.400s is a symbolic link: refused in the output folder", dir); return -1; }
    if (!S_ISDIR(st.st_mode)) return 0;
    if (depth > GRADE_OUT_MAX_DEPTH) { snprintf(err, errlen, "%.400s nests too deep for an output folder", dir); return -1; }
    DIR *d = opendir(dir);
    if (!d) { snprintf(err, errlen, "cannot open folder %.400s: %s", dir, strerror(errno)); return -1; }
    struct dirent *e;
    int rc = 0;
    while (!rc && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (++*seen > GRADE_OUT_MAX_ENTRIES) { snprintf(err, errlen, "%.400s holds too many entries", dir); rc = -1; break; }
        char full[4400];
        snprintf(full, sizeof full, "%s/%s", dir, e->d_name);
        rc = grade_check_out_tree(full, depth + 1, seen, err, errlen);
    }
    closedir(d);
    return rc;
}

/* Reads a regular file, never through a symbolic link (O_NOFOLLOW: one
 * swapped in after the folder was listed is refused too), at most max
 * bytes (errno EFBIG past them). NUL-terminated; NULL with a message. */
static char *grade_read_regular(const char *path, size_t max, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        int e = fd < 0 ? errno : 0;
        snprintf(err, errlen, "cannot read %.400s: %s", path, e == ELOOP ? "a symbolic link (not followed)"
                 : e ? strerror(e) : "not a regular file");
        if (fd >= 0) close(fd);
        errno = e ? e : EINVAL;
        return NULL;
    }
    if ((uint64_t)st.st_size > max) {
        snprintf(err, errlen, "%.400s is longer than %zu bytes", path, max);
        close(fd);
        errno = EFBIG;
        return NULL;
    }
    size_t cap = (size_t)st.st_size + 2, n = 0;   /* one past the size shows a file that grew */
    char *buf = malloc(cap);
    while (buf) {
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { snprintf(err, errlen, "cannot read %.400s: %s", path, strerror(errno)); free(buf); buf = NULL; break; }
        if (r == 0) break;
        n += (size_t)r;
        if (n == cap - 1) {
            if (n > max) { snprintf(err, errlen, "%.400s is longer than %zu bytes", path, max); free(buf); buf = NULL; errno = EFBIG; break; }
            char *nb = realloc(buf, cap * 2);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    if (!buf && !err[0]) snprintf(err, errlen, "out of memory reading %.400s", path);
    int e = errno;
    close(fd);
    errno = e;
    if (!buf) return NULL;
    if (n > max) { snprintf(err, errlen, "%.400s is longer than %zu bytes", path, max); free(buf); errno = EFBIG; return NULL; }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int grade_write_text(const char *path, const char *text) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = grade_create_file(tmp);
    if (!f) return -1;
    size_t n = strlen(text);
    int ok = fwrite(text, 1, n, f) == n;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path)) { unlink(tmp); return -1; }
    return 0;
}

/* A JSON string of any text: a message cut at a byte limit may end inside
 * a character, and jansson refuses invalid UTF-8. */
static json_t *grade_json_text(const char *s) {
    char *c = grade_utf8_clean(s, strlen(s));
    json_t *j = json_string(c ? c : "");
    free(c);
    return j;
}

static void grade_sha256_hex(EVP_MD_CTX *c, char out[65]) {
    unsigned char md[32];
    unsigned int n = 0;
    EVP_DigestFinal_ex(c, md, &n);
    for (unsigned i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", md[i]);
}

static void grade_sha256_str(const char *s, char out[65]) {
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    out[0] = 0;
    if (!c) return;
    EVP_DigestInit_ex(c, EVP_sha256(), NULL);
    EVP_DigestUpdate(c, s, strlen(s));
    grade_sha256_hex(c, out);
    EVP_MD_CTX_free(c);
}

/* ==== Submissions ==== */

/* Files a folder may hold before it is refused, and how deep it may nest:
 * a class submission is a small project, not a disk. */
#define GRADE_MAX_FILES 500
#define GRADE_MAX_DEPTH 16
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

typedef struct { char **v; int n, cap; } grade_paths;

static int grade_paths_add(grade_paths *p, const char *s) {
    if (p->n == p->cap) {
        int cap = p->cap ? p->cap * 2 : 16;
        char **v = realloc(p->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        p->v = v;
        p->cap = cap;
    }
    if (!(p->v[p->n] = strdup(s))) return -1;
    p->n++;
    return 0;
}

static int grade_cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Relative paths of the regular files under root/rel (hidden entries,
 * __pycache__ and node_modules are left out; symbolic links and other
 * non-regular entries are never followed, and are listed in skipped as
 * {"path", "skipped": "symlink" | "not a regular file"}). */
static int grade_walk(const char *root, const char *rel, int depth, grade_paths *out, json_t *skipped,
                      char *err, size_t errlen) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s%s%s", root, *rel ? "/" : "", rel);
    DIR *d = opendir(dir);
    if (!d) { snprintf(err, errlen, "cannot open folder %.400s: %s", dir, strerror(errno)); return -1; }
    struct dirent *e;
    int rc = 0;
    while (!rc && (e = readdir(d))) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "__pycache__") || !strcmp(e->d_name, "node_modules")) continue;
        char r2[4096], full[8200];
        snprintf(r2, sizeof r2, "%s%s%s", rel, *rel ? "/" : "", e->d_name);
        snprintf(full, sizeof full, "%s/%s", root, r2);
        struct stat st;
        if (lstat(full, &st)) continue;
        if (S_ISDIR(st.st_mode)) {
            if (depth >= GRADE_MAX_DEPTH) { snprintf(err, errlen, "%s nests deeper than %d folders", root, GRADE_MAX_DEPTH); rc = -1; }
            else rc = grade_walk(root, r2, depth + 1, out, skipped, err, errlen);
        } else if (S_ISREG(st.st_mode)) {
            if (out->n >= GRADE_MAX_FILES) { snprintf(err, errlen, "%s holds more than %d files", root, GRADE_MAX_FILES); rc = -1; }
            else if (grade_paths_add(out, r2)) { snprintf(err, errlen, "out of memory"); rc = -1; }
        } else if (json_array_size(skipped) < GRADE_MAX_FILES) {
            json_array_append_new(skipped, json_pack("{s:s, s:s}", "path", r2, "skipped",
                                                     S_ISLNK(st.st_mode) ? "symlink" : "not a regular file"));
        }
    }
    closedir(d);
    return rc;
}

/* Appends one file as a numbered listing; binary files are noted, not sent. */
static int grade_list_file(grade_sub *s, const char *full, const char *rel, strbuf *b, EVP_MD_CTX *h,
                           size_t max_bytes) {
    size_t n = 0;
    char err[600];
    /* read no further than the limit: a submission may hold a file of any size */
    err[0] = 0;
    char *raw = grade_read_regular(full, max_bytes, &n, err, sizeof err);
    if (!raw) {
        snprintf(s->error, sizeof s->error, "%.440s%s", err, errno == EFBIG ? " (the limit is --max-bytes)" : "");
        return -1;
    }
    EVP_DigestUpdate(h, rel, strlen(rel) + 1);
    EVP_DigestUpdate(h, raw, n);
    if (!grade_is_text(raw, n)) {   /* a NUL or many control bytes: an executable, an image, an archive */
        json_array_append_new(s->files, json_pack("{s:s, s:I, s:s}", "path", rel, "bytes", (json_int_t)n, "skipped", "binary"));
        s->n_binary++;
        free(raw);
        return 0;
    }
    s->n_text++;
    s->n_blank += grade_is_blank(raw, n);
    char *text = grade_utf8_clean(raw, n);
    free(raw);
    if (!text) { snprintf(s->error, sizeof s->error, "out of memory"); return -1; }
    int lines = 0;
    for (const char *p = text; *p; lines++) { const char *e = strchr(p, '\n'); p = e ? e + 1 : p + strlen(p); }
    strbuf_printf(b, "%s--- File: %s (%d lines) ---\n", b->len ? "\n" : "", rel, lines);
    int ln = 1;
    for (const char *p = text; *p; ln++) {
        const char *e = strchr(p, '\n');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l && p[l - 1] == '\r') l--;
        strbuf_printf(b, "%4d | ", ln);
        strbuf_put(b, p, l);
        strbuf_put(b, "\n", 1);
        p = e ? e + 1 : p + strlen(p);
    }
    free(text);
    json_array_append_new(s->files, json_pack("{s:s, s:i, s:I}", "path", rel, "lines", lines, "bytes", (json_int_t)n));
    return 0;
}

/* Reads a submission into its listing; on failure s->error says why (the
 * submission is then recorded as failed, the class goes on). */
static void grade_sub_load(grade_sub *s, size_t max_bytes) {
    s->files = json_array();
    struct stat st;
    if (lstat(s->path, &st)) { snprintf(s->error, sizeof s->error, "cannot read %s: %s", s->path, strerror(errno)); return; }
    if (S_ISLNK(st.st_mode) || !(S_ISDIR(st.st_mode) || S_ISREG(st.st_mode))) {
        /* a link could name any file the grader may read (a key, /etc/shadow) */
        snprintf(s->error, sizeof s->error, "skipped: %s is %s, not followed", s->path,
                 S_ISLNK(st.st_mode) ? "a symbolic link" : "not a regular file or folder");
        json_array_append_new(s->files, json_pack("{s:s, s:s}", "path", s->name, "skipped",
                                                  S_ISLNK(st.st_mode) ? "symlink" : "not a regular file"));
        return;
    }
    grade_paths ps = {0};
    char root[4096];
    if (S_ISDIR(st.st_mode)) {
        snprintf(root, sizeof root, "%s", s->path);
        if (grade_walk(root, "", 0, &ps, s->files, s->error, sizeof s->error)) goto out;
        qsort(ps.v, (size_t)ps.n, sizeof *ps.v, grade_cmp_str);
    } else {
        snprintf(root, sizeof root, "%s", s->path);
        char *slash = strrchr(root, '/');
        const char *base = slash ? s->path + (slash - root) + 1 : s->path;   /* the raw name, not the cleaned one */
        if (slash) *slash = 0; else snprintf(root, sizeof root, ".");
        if (slash == root) snprintf(root, sizeof root, "/");
        grade_paths_add(&ps, base);
    }
    EVP_MD_CTX *h = EVP_MD_CTX_new();
    strbuf b = {0};
    if (!h) { snprintf(s->error, sizeof s->error, "out of memory"); goto out; }
    EVP_DigestInit_ex(h, EVP_sha256(), NULL);
    int rc = 0;
    for (int i = 0; i < ps.n && !rc && b.len <= max_bytes; i++) {   /* over the limit already: stop reading */
        char full[8200];
        snprintf(full, sizeof full, "%s/%s", root, ps.v[i]);
        rc = grade_list_file(s, full, ps.v[i], &b, h, max_bytes);
    }
    grade_sha256_hex(h, s->sha);
    EVP_MD_CTX_free(h);
    if (!rc && s->n_text == s->n_blank) {   /* nothing to grade: flagged, not sent to the models */
        snprintf(s->flag, sizeof s->flag, "%s", s->n_binary && !s->n_text ? "binary" : "empty");
        if (s->n_binary && !s->n_text)
            snprintf(s->error, sizeof s->error, "flagged: %s holds only binary files (%d), no text to grade", s->path, s->n_binary);
        else
            snprintf(s->error, sizeof s->error, "flagged: %s is empty (%d text file%s with nothing but white space%s)", s->path,
                     s->n_text, s->n_text == 1 ? "" : "s", s->n_binary ? ", and binary files" : "");
    } else if (!rc && b.len > max_bytes)
        snprintf(s->error, sizeof s->error, "the listing is %zu bytes (the limit is %zu, --max-bytes)", b.len, max_bytes);
    if (!rc && b.oom) snprintf(s->error, sizeof s->error, "out of memory");
    if (!rc && !s->error[0]) s->listing = strbuf_take(&b, NULL);
    strbuf_free(&b);
out:
    for (int i = 0; i < ps.n; i++) free(ps.v[i]);
    free(ps.v);
}

static void grade_sub_name(grade_sub *s) {
    char p[4096];
    snprintf(p, sizeof p, "%s", s->path);
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') p[--n] = 0;
    const char *b = strrchr(p, '/');
    b = b ? b + 1 : p;
    char *clean = grade_utf8_clean(b, strlen(b));   /* names go into JSON, which must be UTF-8 */
    snprintf(s->name, sizeof s->name, "%s", clean ? clean : "submission");
    free(clean);
    /* a cut may split a character: end at the last whole one */
    size_t n2 = strlen(s->name);
    if (n2 == sizeof s->name - 1) {
        size_t k = n2;
        while (k > 0 && ((unsigned char)s->name[k - 1] & 0xC0) == 0x80) k--;
        unsigned char lead = k > 0 ? (unsigned char)s->name[k - 1] : 0;
        size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
        if (k > 0 && k - 1 + need > n2) s->name[k - 1] = 0;
    }
    grade_file_stem(s->name, s->stem, sizeof s->stem);
}

/* ==== One streamed chat request ==== */

/* Bounds on what the server may send: an SSE event (one chunk of a few
 * tokens is ~300 bytes), the answer text, an error body. */
#define GRADE_MAX_EVENT (1 << 20)
#define GRADE_MAX_TEXT (8 << 20)
#define GRADE_MAX_ERRBODY (64 << 10)

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

static void grade_hdr_value(const char *line, size_t n, const char *name, char *out, size_t outlen) {
    size_t nl = strlen(name);
    if (n <= nl || strncasecmp(line, name, nl) || line[nl] != ':') return;
    const char *v = line + nl + 1;
    size_t vn = n - nl - 1;
    while (vn && (*v == ' ' || *v == '\t')) { v++; vn--; }
    while (vn && (v[vn - 1] == '\r' || v[vn - 1] == '\n' || v[vn - 1] == ' ')) vn--;
    if (vn >= outlen) vn = outlen - 1;
    memcpy(out, v, vn);
    out[vn] = 0;
}

static size_t grade_on_header(char *p, size_t sz, size_t nm, void *ud) {
    grade_call *c = ud;
    size_t n = sz * nm;
    char ra[32] = "";
    grade_hdr_value(p, n, "X-Tandem-Decode-Node", c->decode_node, sizeof c->decode_node);
    grade_hdr_value(p, n, "X-Tandem-Prefill-Plan", c->plan, sizeof c->plan);
    grade_hdr_value(p, n, "X-Tandem-Prefill-Node", c->prefill_node, sizeof c->prefill_node);
    grade_hdr_value(p, n, "Retry-After", ra, sizeof ra);
    if (ra[0]) c->retry_after_s = atof(ra);
    return n;
}

/* One SSE event's data. */
static void grade_on_event(grade_call *c, const char *data) {
    if (!strcmp(data, "[DONE]")) { c->done = 1; return; }
    json_t *o = json_loads(data, 0, NULL);
    if (!o) { snprintf(c->error, sizeof c->error, "malformed stream event"); c->failed = 1; return; }
    json_t *e = json_object_get(o, "error");
    if (e) {
        const char *m = json_string_value(json_object_get(e, "message"));
        snprintf(c->error, sizeof c->error, "stream error: %s", m ? m : "unknown");
        c->failed = 1;
    }
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    const char *t = json_string_value(json_object_get(json_object_get(ch, "delta"), "content"));
    if (t && *t) {
        double now = grade_now_ms();
        if (!c->chunks) c->t_first = now;
        c->t_last = now;
        c->chunks++;
        if (c->text.len + strlen(t) > GRADE_MAX_TEXT) { snprintf(c->error, sizeof c->error, "answer too long"); c->failed = 1; }
        else strbuf_put(&c->text, t, strlen(t));
    }
    const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
    if (fr) snprintf(c->finish, sizeof c->finish, "%s", fr);
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        c->prompt_tokens = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
        c->completion_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
        json_int_t ct = json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
        /* another server's figure is not trusted past the prompt it counts */
        c->cached_tokens = ct > 0 && ct <= c->prompt_tokens ? (int)ct : 0;
    }
    json_decref(o);
}

static void grade_sse_drain(grade_call *c) {
    char *ev;
    while (!c->failed && c->buf.p && (ev = strstr(c->buf.p, "\n\n"))) {
        *ev = 0;
        for (char *line = c->buf.p; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            if (!strncmp(line, "data: ", 6)) grade_on_event(c, line + 6);
            line = nl ? nl + 1 : NULL;
        }
        size_t used = (size_t)(ev + 2 - c->buf.p);
        memmove(c->buf.p, ev + 2, c->buf.len - used + 1);
        c->buf.len -= used;
    }
}

/* The body: SSE events are parsed as they arrive (TTFT is the arrival of
 * the first text), an error reply is kept whole (bounded). */
static size_t grade_on_body(char *p, size_t sz, size_t nm, void *ud) {
    grade_call *c = ud;
    size_t n = sz * nm;
    if (c->status == 0) curl_easy_getinfo(c->h, CURLINFO_RESPONSE_CODE, &c->status);
    if (c->buf.len + n > (c->status == 200 ? GRADE_MAX_EVENT : GRADE_MAX_ERRBODY)) {
        snprintf(c->error, sizeof c->error, "the server sent an oversized %s", c->status == 200 ? "event" : "error body");
        c->failed = 1;
        return 0;
    }
    int oom = 0;
    if (c->status != 200) oom = strbuf_put(&c->buf, p, n);
    /* SSE lines may end in CRLF (other servers): events are parsed without CR */
    for (size_t i = 0, j; c->status == 200 && i < n && !oom; i = j) {
        for (j = i; j < n && p[j] != '\r'; j++) {}
        oom = strbuf_put(&c->buf, p + i, j - i);
        if (j < n) j++;
    }
    if (oom || c->text.oom) { snprintf(c->error, sizeof c->error, "out of memory"); c->failed = 1; return 0; }
    if (c->status == 200) grade_sse_drain(c);
    return c->failed ? 0 : n;
}

/* One attempt; fills c. */
static void grade_attempt(grade_call *c, CURL *h, const char *url, struct curl_slist *hl) {
    c->status = 0;
    strbuf_reset(&c->text);
    strbuf_reset(&c->buf);
    c->prompt_tokens = c->completion_tokens = c->cached_tokens = c->chunks = c->done = c->failed = 0;
    c->t_first = c->t_last = 0;
    c->retry_after_s = 0;
    c->finish[0] = c->decode_node[0] = c->plan[0] = c->prefill_node[0] = c->error[0] = 0;
    c->h = h;
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, c->body);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, grade_on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, grade_on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, c);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, (long)c->o->timeout_s);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 10L);
    c->t_send = grade_now_ms();
    CURLcode rc = curl_easy_perform(h);
    c->t_end = grade_now_ms();
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &c->status);
    if (rc != CURLE_OK && !c->failed) {
        snprintf(c->error, sizeof c->error, "%s", curl_easy_strerror(rc));
        c->failed = rc == CURLE_COULDNT_CONNECT ? 2 : 1;   /* 2: the router is not there (retried) */
        return;
    }
    if (c->failed) return;
    if (c->status != 200) {
        json_t *o = c->buf.p ? json_loads(c->buf.p, 0, NULL) : NULL;
        const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
        snprintf(c->error, sizeof c->error, "HTTP %ld: %.400s", c->status, m ? m : c->buf.p ? c->buf.p : "");
        json_decref(o);
        c->failed = 1;
        return;
    }
    if (c->buf.len) { strbuf_put(&c->buf, "\n\n", 2); grade_sse_drain(c); }
    if (!c->failed && !c->done) { snprintf(c->error, sizeof c->error, "the stream ended before [DONE]"); c->failed = 1; }
    if (!c->completion_tokens) c->completion_tokens = c->chunks;
}

static int grade_retryable(const grade_call *c) {
    return c->failed == 2 || c->status == 429 || c->status == 503;
}

/* Runs the request with retries; 0 when it completed. */
static int grade_call_run(grade_call *c) {
    char url[2048], auth[600];
    snprintf(url, sizeof url, "%s/v1/chat/completions", c->o->router);
    CURL *h = curl_easy_init();
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    if (c->o->api_key) { snprintf(auth, sizeof auth, "Authorization: Bearer %s", c->o->api_key); hl = curl_slist_append(hl, auth); }
    if (!h || !hl) { snprintf(c->error, sizeof c->error, "out of memory"); c->failed = 1; curl_easy_cleanup(h); curl_slist_free_all(hl); return -1; }
    double delay = c->o->backoff_s * 1e3;
    for (c->attempts = 1;; c->attempts++) {
        grade_attempt(c, h, url, hl);
        if (!c->failed || !grade_retryable(c) || c->attempts > c->o->retries) break;
        /* exponential back-off with jitter; a server's Retry-After wins (capped) */
        unsigned seed = (unsigned)c->t_end ^ (unsigned)(uintptr_t)c;
        double wait = c->retry_after_s > 0 ? fmin(c->retry_after_s, 60) * 1e3 : delay * (0.75 + 0.5 * (rand_r(&seed) / (double)RAND_MAX));
        grade_sleep_ms(wait);
        delay = fmin(delay * 2, 30e3);
    }
    curl_easy_cleanup(h);
    curl_slist_free_all(hl);
    if (c->failed && c->attempts > 1 && grade_retryable(c)) {
        size_t l = strlen(c->error);
        snprintf(c->error + l, sizeof c->error - l, " (after %d attempts)", c->attempts);
    }
    return c->failed ? -1 : 0;
}

static void grade_call_free(grade_call *c) {
    free(c->body);
    strbuf_free(&c->text);
    strbuf_free(&c->buf);
}

/* ==== The class ==== */

typedef struct { double *v; int n, cap; } grade_series;

static void grade_series_add(grade_series *s, double x) {
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 64;
        double *v = realloc(s->v, (size_t)cap * sizeof *v);
        if (!v) return;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
}

static int grade_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (p in 0..1); NAN when empty. Sorts in place. */
static double grade_pct(grade_series *s, double p) {
    if (!s->n) return NAN;
    qsort(s->v, (size_t)s->n, sizeof *s->v, grade_cmp_double);
    int i = (int)ceil(p * s->n) - 1;
    return s->v[i < 0 ? 0 : i >= s->n ? s->n - 1 : i];
}

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

static char *grade_request_body(const grade_class *g, int which, const grade_sub *s) {
    const grade_opts *o = g->o;
    grade_vars v = { g->rubric.text, g->schema_text, g->items_text, g->max_total_text, s->name, s->listing };
    char *sys = grade_template_render(g->tmpl[which].system, &v), *usr = grade_template_render(g->tmpl[which].user, &v);
    char *body = NULL;
    json_t *msgs = json_array();
    if (sys && usr && msgs) {
        if (*sys) json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", sys));
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", usr));
        json_t *req = json_pack("{s:s, s:O, s:i, s:f, s:b, s:{s:b}}", "model", which ? o->model_b : o->model_a,
                                "messages", msgs, "max_tokens", which ? o->tokens_b : o->tokens_a,
                                "temperature", which ? o->temp_b : o->temp_a, "stream", 1,
                                "stream_options", "include_usage", 1);
        if (req && which == GRADE_A && !o->no_schema)
            json_object_set_new(req, "response_format",
                                json_pack("{s:s, s:{s:s, s:b, s:o}}", "type", "json_schema", "json_schema",
                                          "name", "rubric_analysis", "strict", 1, "schema",
                                          json_loads(g->schema_text, 0, NULL)));   /* a private copy per thread */
        if (req && o->ignore_eos) json_object_set_new(req, "ignore_eos", json_true());
        body = req ? json_dumps(req, JSON_COMPACT) : NULL;
        json_decref(req);
    }
    json_decref(msgs);
    free(sys);
    free(usr);
    return body;
}

/* Per-request figures; start_ms/end_ms count from the start of the run (t0). */
static json_t *grade_call_timing(const grade_call *c, double t0) {
    double ttft = c->chunks ? c->t_first - c->t_send : -1;
    double tpot = c->completion_tokens > 1 && c->chunks > 1 ? (c->t_last - c->t_first) / (c->completion_tokens - 1) : -1;
    json_t *t = json_pack("{s:i, s:f, s:i, s:i, s:i}", "attempts", c->attempts, "total_ms", c->t_end - c->t_send,
                          "prompt_tokens", c->prompt_tokens, "cached_tokens", c->cached_tokens,
                          "completion_tokens", c->completion_tokens);
    json_object_set_new(t, "ttft_ms", ttft >= 0 ? json_real(ttft) : json_null());
    json_object_set_new(t, "tpot_ms", tpot >= 0 ? json_real(tpot) : json_null());
    json_object_set_new(t, "finish_reason", c->finish[0] ? json_string(c->finish) : json_null());
    json_object_set_new(t, "start_ms", json_real(c->t_send - t0));
    json_object_set_new(t, "end_ms", json_real(c->t_end - t0));
    return t;
}

static json_t *grade_call_nodes(const grade_call *c) {
    json_t *n = json_pack("{s:s}", "model", c->model);
    json_object_set_new(n, "decode_node", c->decode_node[0] ? json_string(c->decode_node) : json_null());
    json_object_set_new(n, "prefill_plan", c->plan[0] ? json_string(c->plan) : json_null());
    json_object_set_new(n, "prefill_node", c->prefill_node[0] ? json_string(c->prefill_node) : json_null());
    json_object_set_new(n, "split", c->plan[0] ? json_boolean(!strcmp(c->plan, "split")) : json_null());
    return n;
}

/* Scores, total and the analysis (or the analysis error) into rec. */
static void grade_fill_analysis(const grade_class *g, json_t *rec, const grade_call *c, json_t *files) {
    char err[512];
    json_t *a = grade_analysis_parse(&g->rubric, g->schema, c->text.p ? c->text.p : "", err, sizeof err);
    json_object_set_new(rec, "analysis_valid", json_boolean(a != NULL));
    if (!a) {
        if (!strcmp(c->finish, "length")) strncat(err, " (the answer was cut at max_tokens)", sizeof err - strlen(err) - 1);
        json_object_set_new(rec, "analysis", json_null());
        json_object_set_new(rec, "analysis_error", json_pack("{s:o, s:o}", "message", grade_json_text(err),
                                                             "raw", grade_json_text(c->text.p ? c->text.p : "")));
        json_object_set_new(rec, "scores", json_null());
        json_object_set_new(rec, "total", json_null());
        return;
    }
    json_t *scores = json_object(), *as = json_object_get(a, "scores");
    json_int_t sum = 0;
    for (int i = 0; i < g->rubric.n_items; i++) {
        const grade_item *it = &g->rubric.items[i];
        json_t *x = json_object_get(as, it->key);
        json_int_t sc = (json_int_t)json_number_value(json_object_get(x, "score"));
        sum += sc;
        json_object_set_new(scores, it->key, json_pack("{s:s, s:I, s:i, s:O}", "item", it->name, "score", sc,
                                                       "max", it->max_points, "justification",
                                                       json_object_get(x, "justification")));
    }
    json_t *mt = json_object_get(a, "total");
    /* a problem must point at a line the submission has */
    int unlocated = 0;
    json_object_set_new(rec, "problem_checks", grade_check_problems(a, files, &unlocated));
    json_object_set_new(rec, "problems_unlocated", json_integer(unlocated));
    json_object_set_new(rec, "scores", scores);
    /* the total is the sum of the item scores; the model's own sum is kept when it differs */
    json_object_set_new(rec, "total", json_integer(sum));
    if ((json_int_t)json_number_value(mt) != sum) json_object_set_new(rec, "model_total", json_integer((json_int_t)json_number_value(mt)));
    json_object_set_new(rec, "analysis", a);
}

static json_t *grade_record_base(const grade_class *g, const grade_sub *s) {
    const grade_opts *o = g->o;
    char when[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    return json_pack("{s:s, s:o, s:s, s:s, s:s, s:s, s:O, s:{s:s, s:s}, s:i}", "submission", s->name, "path", grade_json_text(s->path),
                     "status", "failed", "graded_at", when, "rubric_sha256", g->rubric_sha, "submission_sha256", s->sha,
                     "files", s->files, "models", "analysis", o->model_a, "feedback", o->model_b,
                     "max_total", g->rubric.max_total);
}

static int grade_record_write(const grade_class *g, const grade_sub *s, json_t *rec) {
    char path[4096], *text = json_dumps(rec, JSON_INDENT(2));
    snprintf(path, sizeof path, "%s/%s.json", g->o->out, s->stem);
    int rc = text ? grade_write_text(path, text) : -1;
    free(text);
    if (rc) fprintf(stderr, "\ntandem grade: cannot write %s: %s\n", path, strerror(errno));
    return rc;
}

static void grade_count(grade_class *g, const grade_call *c, int which) {
    if (c->failed) return;
    if (c->chunks) grade_series_add(&g->ttft[which], c->t_first - c->t_send);
    if (c->completion_tokens > 1 && c->chunks > 1) grade_series_add(&g->tpot[which], (c->t_last - c->t_first) / (c->completion_tokens - 1));
    grade_series_add(&g->ptok[which], c->prompt_tokens);
    g->ptok_sum[which] += c->prompt_tokens;
    g->cached_sum[which] += c->cached_tokens;
    grade_series_add(&g->ctok[which], c->completion_tokens);
    if (!strcmp(c->plan, "split")) g->plan_split++;
    else if (c->plan[0]) g->plan_local++;
}

static void *grade_call_thread(void *arg) {
    grade_call_run(arg);
    return NULL;
}

/* Grades one submission: both requests at once, then its record. */
static void grade_one(grade_class *g, grade_sub *s) {
    double t0 = grade_now_ms();
    json_t *rec = grade_record_base(g, s);
    grade_call c[2] = { { .o = g->o, .model = g->o->model_a }, { .o = g->o, .model = g->o->model_b } };
    int ok = 0, need[2] = {1, 1};
    if (s->prev) {   /* a half an earlier run finished is kept: only the other is asked for */
        int have_a, have_b;
        grade_prev_halves(s->prev, g->o->regrade_invalid, &have_a, &have_b);
        need[GRADE_A] = !have_a;
        need[GRADE_B] = !have_b;
    }
    if (!s->error[0]) {
        if (need[GRADE_A]) c[0].body = grade_request_body(g, GRADE_A, s);
        if (need[GRADE_B]) c[1].body = grade_request_body(g, GRADE_B, s);
        if ((need[GRADE_A] && !c[0].body) || (need[GRADE_B] && !c[1].body)) snprintf(s->error, sizeof s->error, "out of memory");
    }
    if (!s->error[0]) {
        pthread_t th;
        int threaded = need[GRADE_B] && need[GRADE_A] && pthread_create(&th, NULL, grade_call_thread, &c[GRADE_B]) == 0;
        if (need[GRADE_A]) grade_call_run(&c[GRADE_A]);
        if (threaded) pthread_join(th, NULL);
        else if (need[GRADE_B]) grade_call_run(&c[GRADE_B]);
        int fa = need[GRADE_A] && c[0].failed, fb = need[GRADE_B] && c[1].failed;
        ok = !fa && !fb;
        if (!ok) snprintf(s->error, sizeof s->error, "%s%.240s%s%s%.240s", fa ? "analysis: " : "", fa ? c[0].error : "",
                          fa && fb ? "; " : "", fb ? "feedback: " : "", fb ? c[1].error : "");
        if (need[GRADE_A] && !fa) grade_fill_analysis(g, rec, &c[0], s->files);
        json_object_set_new(rec, "feedback", need[GRADE_B] && !fb && c[1].text.p ? json_string(c[1].text.p) : json_null());
        json_object_set_new(rec, "timings", json_pack("{s:f, s:o, s:o}", "latency_ms", grade_now_ms() - t0,
                                                      "analysis", grade_call_timing(&c[0], g->t0),
                                                      "feedback", grade_call_timing(&c[1], g->t0)));
        json_object_set_new(rec, "nodes", json_pack("{s:o, s:o}", "analysis", grade_call_nodes(&c[0]), "feedback", grade_call_nodes(&c[1])));
        for (int w = 0; w < 2; w++)
            if (!need[w]) grade_reuse_half(rec, s->prev, w);
    }
    json_object_set_new(rec, "status", json_string(ok ? "graded" : s->flag[0] ? "flagged" : "failed"));
    if (s->flag[0]) json_object_set_new(rec, "flag", json_string(s->flag));
    if (!ok) json_object_set_new(rec, "error", grade_json_text(s->error));
    if (grade_record_write(g, s, rec) && ok) {
        ok = 0;
        json_object_set_new(rec, "status", json_string("failed"));
        json_object_set_new(rec, "error", json_string("cannot write the record"));
    }
    pthread_mutex_lock(&g->mu);
    if (ok) {
        g->graded++;
        g->invalid += !json_is_true(json_object_get(rec, "analysis_valid"));
        grade_series_add(&g->latency, grade_now_ms() - t0);
    } else if (s->flag[0]) {
        g->flagged++;
    } else {
        g->failed++;
    }
    for (int w = 0; w < 2; w++) if (need[w] && c[w].attempts) grade_count(g, &c[w], w);
    s->record = rec;
    pthread_mutex_unlock(&g->mu);
    for (int w = 0; w < 2; w++) grade_call_free(&c[w]);
}

static void *grade_worker(void *arg) {
    grade_class *g = arg;
    for (;;) {
        pthread_mutex_lock(&g->mu);
        while (g->next < g->n && g->subs[g->next].skipped) g->next++;
        int i = g->next < g->n ? g->next++ : -1;
        if (i >= 0) g->running++;
        pthread_mutex_unlock(&g->mu);
        if (i < 0) return NULL;
        grade_one(g, &g->subs[i]);
        pthread_mutex_lock(&g->mu);
        g->running--;
        g->finished++;
        pthread_cond_signal(&g->cv);
        pthread_mutex_unlock(&g->mu);
    }
}

/* ==== Resuming ==== */

/* 1 when DIR/STEM.json already holds this submission graded with the same
 * rubric, files and models (its record is then kept). */
static int grade_already_done(grade_class *g, grade_sub *s) {
    const grade_opts *o = g->o;
    if (o->force || s->error[0]) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.json", o->out, s->stem);
    json_t *r = json_load_file(path, 0, NULL);
    const char *st = json_string_value(json_object_get(r, "status"));
    const char *rs = json_string_value(json_object_get(r, "rubric_sha256"));
    const char *ss = json_string_value(json_object_get(r, "submission_sha256"));
    json_t *m = json_object_get(r, "models");
    const char *ma = json_string_value(json_object_get(m, "analysis")), *mb = json_string_value(json_object_get(m, "feedback"));
    int same = st && !strcmp(st, "graded") && rs && !strcmp(rs, g->rubric_sha) && ss && !strcmp(ss, s->sha) &&
               ma && !strcmp(ma, o->model_a) && mb && !strcmp(mb, o->model_b);
    if (same && o->regrade_invalid && !json_is_true(json_object_get(r, "analysis_valid"))) same = 0;
    int same_but_failed = st && !strcmp(st, "failed") && rs && !strcmp(rs, g->rubric_sha) && ss && !strcmp(ss, s->sha) &&
                          ma && !strcmp(ma, o->model_a) && mb && !strcmp(mb, o->model_b);
    if (same_but_failed) { s->prev = r; return 0; }   /* its finished half is kept (grade_one) */
    if (!same) { json_decref(r); return 0; }
    s->record = r;
    s->skipped = 1;
    return 1;
}

/* ==== Progress and summary ==== */

static void grade_fmt_dur(double s, char *out, size_t n) {
    if (!isfinite(s) || s < 0) { snprintf(out, n, "?"); return; }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, n, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else snprintf(out, n, "%ldm%02lds", t / 60, t % 60);
}

/* One progress line on stderr (rewritten in place on a terminal). Under g->mu. */
static void grade_progress(grade_class *g, int tty) {
    double el = (grade_now_ms() - g->t0) / 1e3;
    double rate = g->finished && el > 0 ? g->graded / el * 3600 : 0;
    char eta[32];
    grade_fmt_dur(g->finished ? (g->to_do - g->finished) * el / g->finished : NAN, eta, sizeof eta);
    fprintf(stderr, "%sgrade: %d/%d done, %d failed, %d in flight, %.1f submissions/h, ETA %s%s",
            tty ? "\r" : "", g->graded + g->failed + g->skipped, g->n, g->failed, g->running, rate,
            g->finished < g->to_do ? eta : "0m00s", tty ? "   " : "\n");
    fflush(stderr);
}

typedef struct { double split, local, dec_split, dec_local; int ok; } grade_router_counts;

static size_t grade_sink(char *p, size_t sz, size_t nm, void *ud) {
    strbuf *b = ud;
    size_t n = sz * nm;
    if (b->len + n > (4u << 20) || strbuf_put(b, p, n)) return 0;
    return n;
}

/* The router's prefill counters from GET /metrics (a tandem router only). */
static grade_router_counts grade_router_metrics(const grade_opts *o) {
    grade_router_counts rc = {0};
    char url[2048], auth[600];
    snprintf(url, sizeof url, "%s/metrics", o->router);
    CURL *h = curl_easy_init();
    strbuf b = {0};
    struct curl_slist *hl = NULL;
    if (o->api_key) { snprintf(auth, sizeof auth, "Authorization: Bearer %s", o->api_key); hl = curl_slist_append(hl, auth); }
    long st = 0;
    if (h) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, grade_sink);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT, 10L);
        if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &st);
    }
    for (char *l = st == 200 ? b.p : NULL; l && *l;) {
        char *e = strchr(l, '\n');
        if (e) *e = 0;
        char *sp = strrchr(l, ' ');
        double v = sp ? atof(sp + 1) : 0;
        /* a tandem router: the family is there even before a series is (series appear when first observed) */
        if (!strcmp(l, "# TYPE tandem_router_prefill_total counter")) rc.ok = 1;
        else if (!strncmp(l, "tandem_router_prefill_total{mode=\"split\"}", 41)) rc.split += v;
        else if (!strncmp(l, "tandem_router_prefill_total{mode=\"local\"}", 41)) rc.local += v;
        else if (!strncmp(l, "tandem_router_decisions_total{decision=\"split\"", 46)) rc.dec_split += v;
        else if (!strncmp(l, "tandem_router_decisions_total{decision=\"local\"", 46)) rc.dec_local += v;
        l = e ? e + 1 : NULL;
    }
    curl_easy_cleanup(h);
    curl_slist_free_all(hl);
    strbuf_free(&b);
    return rc;
}

static double grade_mean(const grade_series *s) {
    double t = 0;
    for (int i = 0; i < s->n; i++) t += s->v[i];
    return s->n ? t / s->n : NAN;
}

/* "12.3" with the given decimals and unit, or "-" without data. */
static const char *grade_fmt(char *buf, size_t n, double v, int decimals, const char *unit) {
    if (!isfinite(v)) snprintf(buf, n, "-");
    else snprintf(buf, n, "%.*f%s", decimals, v, unit);
    return buf;
}

/* How much of this run's prompts the servers had cached (a rubric held in a
 * slot or a decode node's KV store). */
static void grade_print_cached(const grade_class *g) {
    long long p = g->ptok_sum[0] + g->ptok_sum[1], k = g->cached_sum[0] + g->cached_sum[1];
    char a[32], b[32], c[32];
    printf("prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): %lld of %lld (%s); "
           "analysis %s, feedback %s\n", k, p, grade_fmt(a, sizeof a, p ? 100.0 * (double)k / (double)p : NAN, 1, "%"),
           grade_fmt(b, sizeof b, g->ptok_sum[0] ? 100.0 * (double)g->cached_sum[0] / (double)g->ptok_sum[0] : NAN, 1, "%"),
           grade_fmt(c, sizeof c, g->ptok_sum[1] ? 100.0 * (double)g->cached_sum[1] / (double)g->ptok_sum[1] : NAN, 1, "%"));
}

static void grade_summary(grade_class *g, double wall_s, grade_router_counts before, grade_router_counts after) {
    const grade_opts *o = g->o;
    char a[32], b[32], c[32], d[32], e[32], f[32];
    printf("tandem grade: %d submissions: %d graded (%d with an analysis that does not follow the schema), %d failed, "
           "%d flagged (empty or binary, not graded), %d skipped (already graded)\n", g->n, g->graded, g->invalid, g->failed,
           g->flagged, g->skipped);
    printf("wall time %.1f s, %s submissions/hour (graded ones, --parallel %d)\n", wall_s,
           grade_fmt(a, sizeof a, wall_s > 0 && g->finished ? g->graded / wall_s * 3600 : NAN, 1, ""), o->parallel);
    printf("latency per submission: p50 %s, p90 %s, max %s\n", grade_fmt(a, sizeof a, grade_pct(&g->latency, 0.5) / 1e3, 2, " s"),
           grade_fmt(b, sizeof b, grade_pct(&g->latency, 0.9) / 1e3, 2, " s"),
           grade_fmt(c, sizeof c, grade_pct(&g->latency, 1.0) / 1e3, 2, " s"));
    for (int w = 0; w < 2; w++) {
        printf("%s (%s): TTFT p50 %s, p90 %s; TPOT p50 %s, p90 %s; tokens per request: prompt %s, completion %s (mean of %d)\n",
               w ? "feedback" : "analysis", w ? o->model_b : o->model_a,
               grade_fmt(a, sizeof a, grade_pct(&g->ttft[w], 0.5), 0, " ms"), grade_fmt(b, sizeof b, grade_pct(&g->ttft[w], 0.9), 0, " ms"),
               grade_fmt(c, sizeof c, grade_pct(&g->tpot[w], 0.5), 1, " ms"), grade_fmt(d, sizeof d, grade_pct(&g->tpot[w], 0.9), 1, " ms"),
               grade_fmt(e, sizeof e, grade_mean(&g->ptok[w]), 0, ""), grade_fmt(f, sizeof f, grade_mean(&g->ctok[w]), 0, ""),
               g->ptok[w].n);
    }
    grade_print_cached(g);
    printf("prefill plans of this run's requests (X-Tandem-Prefill-Plan): split %d, local %d\n", g->plan_split, g->plan_local);
    if (before.ok && after.ok)
        printf("router during the run (/metrics, all clients): prefilled split %.0f, local %.0f; decisions split %.0f, local %.0f\n",
               after.split - before.split, after.local - before.local, after.dec_split - before.dec_split,
               after.dec_local - before.dec_local);
    else
        printf("router during the run: no tandem /metrics at %s\n", o->router);
    printf("report: %s/report.md, %s/report.html\n", o->out, o->out);
}

/* ==== Synthetic class (--bench) ==== */

static const char *const grade_words[] = {
    "inventory", "order", "price", "stock", "customer", "record", "report", "total", "limit", "batch",
    "invoice", "supplier", "warehouse", "item", "count", "update", "check", "load", "store", "parse",
    "result", "value", "index", "entry", "table", "cache", "queue", "event", "status", "amount",
};
#define GRADE_NWORDS (sizeof grade_words / sizeof grade_words[0])

static unsigned grade_rand(unsigned *s) {
    *s ^= *s << 13; *s ^= *s >> 17; *s ^= *s << 5;
    return *s;
}

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
static int grade_bench_setup(grade_opts *o, char **rubric_path) {
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

/* ==== Setup ==== */

static int grade_write_templates(const char *dir) {
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/analysis.tmpl", dir);
    snprintf(b, sizeof b, "%s/feedback.tmpl", dir);
    if (grade_mkdirs(dir) || grade_write_text(a, grade_default_analysis_template) ||
        grade_write_text(b, grade_default_feedback_template)) {
        fprintf(stderr, "tandem grade: cannot write templates in %s: %s\n", dir, strerror(errno));
        return 1;
    }
    printf("%s\n%s\n", a, b);
    return 0;
}

static int grade_load_template(const char *path, const char *def, grade_template *t) {
    char err[512];
    char *text = path ? cliopt_read_text(path, GRADE_MAX_CONFIG_BYTES, NULL, err, sizeof err) : NULL;
    if (path && !text) { fprintf(stderr, "tandem grade: the template: %s\n", err); return -1; }
    int rc = grade_template_parse(text ? text : def, t, err, sizeof err);
    if (rc) fprintf(stderr, "tandem grade: template %s: %s\n", path ? path : "(built-in)", err);
    free(text);
    return rc;
}

static int grade_setup_rubric(grade_class *g, const char *path) {
    size_t n = 0;
    char err[512];
    char *text = cliopt_read_text(path, GRADE_MAX_CONFIG_BYTES, &n, err, sizeof err);
    if (!text) { fprintf(stderr, "tandem grade: the rubric: %s\n", err); return -1; }
    int rc = grade_rubric_parse(text, n, &g->rubric, err, sizeof err);
    free(text);
    if (rc) { fprintf(stderr, "tandem grade: rubric %s: %s\n", path, err); return -1; }
    g->schema = grade_rubric_schema(&g->rubric);
    g->schema_text = g->schema ? json_dumps(g->schema, JSON_COMPACT) : NULL;
    strbuf items = {0};
    for (int i = 0; i < g->rubric.n_items; i++)
        strbuf_printf(&items, "%s\"%s\" for %s, %d points", i ? "; " : "", g->rubric.items[i].key,
                        g->rubric.items[i].name, g->rubric.items[i].max_points);
    g->items_text = strbuf_take(&items, NULL);
    snprintf(g->max_total_text, sizeof g->max_total_text, "%d", g->rubric.max_total);
    grade_sha256_str(g->rubric.text, g->rubric_sha);
    if (!g->schema_text || !g->items_text) { fprintf(stderr, "tandem grade: out of memory\n"); return -1; }
    char sp[4200];
    snprintf(sp, sizeof sp, "%s/schema.json", g->o->out);
    char *pretty = json_dumps(g->schema, JSON_INDENT(2));
    rc = pretty ? grade_write_text(sp, pretty) : -1;
    free(pretty);
    if (rc) fprintf(stderr, "tandem grade: cannot write %s\n", sp);
    return rc;
}

/* Names, listings and resume state of every submission; -1 on a clash. */
static int grade_setup_subs(grade_class *g) {
    g->subs = calloc((size_t)g->n, sizeof *g->subs);
    if (!g->subs) return -1;
    for (int i = 0; i < g->n; i++) {
        grade_sub *s = &g->subs[i];
        s->path = g->o->subs[i];
        grade_sub_name(s);
        for (int k = 0; k < i; k++)
            if (!strcmp(g->subs[k].stem, s->stem)) {
                fprintf(stderr, "tandem grade: %s and %s would both be written to %s.json; rename one\n",
                        g->subs[k].path, s->path, s->stem);
                return -1;
            }
        if (!strcmp(s->stem, "schema") || !strcmp(s->stem, "report")) {
            fprintf(stderr, "tandem grade: a submission may not be called %s (the name of an output file)\n", s->stem);
            return -1;
        }
        grade_sub_load(s, (size_t)g->o->max_bytes);
        if (grade_already_done(g, s)) g->skipped++;
    }
    return 0;
}

static void grade_class_free(grade_class *g) {
    for (int i = 0; g->subs && i < g->n; i++) {
        free(g->subs[i].listing);
        json_decref(g->subs[i].files);
        json_decref(g->subs[i].record);
        json_decref(g->subs[i].prev);
    }
    free(g->subs);
    grade_rubric_free(&g->rubric);
    json_decref(g->schema);
    free(g->schema_text);
    free(g->items_text);
    for (int w = 0; w < 2; w++) {
        grade_template_free(&g->tmpl[w]);
        free(g->ttft[w].v); free(g->tpot[w].v); free(g->ptok[w].v); free(g->ctok[w].v);
    }
    free(g->latency.v);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

/* ==== Running ==== */

static void grade_run_workers(grade_class *g) {
    int k = g->o->parallel < g->to_do ? g->o->parallel : g->to_do;
    pthread_t *th = calloc((size_t)(k > 0 ? k : 1), sizeof *th);
    int started = 0;
    for (int i = 0; th && i < k; i++) started += pthread_create(&th[started], NULL, grade_worker, g) == 0;
    if (!started && g->to_do) { grade_worker(g); }   /* no thread could start: grade here, one at a time */
    int tty = isatty(2);
    pthread_mutex_lock(&g->mu);
    int shown = -1;
    double last = 0;
    while (g->finished < g->to_do) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        /* a terminal gets a fresh line every second; a log one line per finished
         * submission (and one every 30 s while nothing finishes) */
        double now = grade_now_ms();
        if (!g->o->quiet && (tty || g->finished != shown || now - last > 30e3)) {
            grade_progress(g, tty);
            shown = g->finished;
            last = now;
        }
    }
    pthread_mutex_unlock(&g->mu);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (!g->o->quiet && tty) fputc('\n', stderr);
    free(th);
}

/* Records in class order for the report; a missing one becomes a failure. */
static int grade_report(grade_class *g) {
    json_t **recs = calloc((size_t)g->n, sizeof *recs);
    if (!recs) return -1;
    for (int i = 0; i < g->n; i++) {
        recs[i] = g->subs[i].record;
        if (!recs[i]) recs[i] = g->subs[i].record = json_pack("{s:s, s:s, s:s}", "submission", g->subs[i].name,
                                                              "status", "failed", "error", "not graded");
    }
    char err[512];
    int rc = grade_report_write(g->o->out, &g->rubric, recs, g->n, err, sizeof err);
    if (rc) fprintf(stderr, "tandem grade: report: %s\n", err);
    free(recs);
    return rc;
}

int cli_grade(int argc, char **argv) {
    grade_opts o;
    int pr = grade_parse(argc, argv, &o);
    if (pr) { free(o.subs); return pr > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE; }
    if (o.write_templates) { int rc = grade_write_templates(o.write_templates); free(o.subs); return rc; }
    grade_class g;
    memset(&g, 0, sizeof g);
    g.o = &o;
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    char *bench_rubric = NULL;
    int rc = 2;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (grade_mkdirs(o.out)) { fprintf(stderr, "tandem grade: cannot create %s: %s\n", o.out, strerror(errno)); goto out; }
    char terr[600];
    long seen = 0;
    if (grade_check_out_tree(o.out, 0, &seen, terr, sizeof terr)) { fprintf(stderr, "tandem grade: %s\n", terr); goto out; }
    if (o.bench && grade_bench_setup(&o, &bench_rubric)) goto out;
    if (grade_setup_rubric(&g, o.bench ? bench_rubric : o.rubric_path)) goto out;
    if (grade_load_template(o.tmpl_a_path, grade_default_analysis_template, &g.tmpl[GRADE_A]) ||
        grade_load_template(o.tmpl_b_path, grade_default_feedback_template, &g.tmpl[GRADE_B])) goto out;
    g.n = o.n_subs;
    if (grade_setup_subs(&g)) goto out;
    g.to_do = g.n - g.skipped;
    char perr[1024];
    int to_send = 0;   /* submissions that will send requests: none (all failed to load, flagged), no router needed */
    for (int i = 0; i < g.n; i++) to_send += !g.subs[i].skipped && !g.subs[i].error[0];
    if (to_send > 0 && grade_preflight(o.router, o.api_key, o.model_a, o.model_b, o.no_schema ? NULL : g.schema_text,
                                       o.timeout_s, o.retries < 3 ? o.retries + 1 : 3, o.backoff_s > 0 ? o.backoff_s : 0.5,
                                       perr, sizeof perr)) {
        /* before any submission: nothing is spent on a class that cannot be graded */
        fprintf(stderr, "tandem grade: stopped before the first submission: %s\n", perr);
        rc = 1;
        goto out;
    }
    grade_router_counts before = grade_router_metrics(&o);
    if (!o.quiet)
        fprintf(stderr, "grade: %d submissions (%d already graded), rubric of %d items (%d points), %d in flight\n",
                g.n, g.skipped, g.rubric.n_items, g.rubric.max_total, o.parallel);
    g.t0 = grade_now_ms();
    grade_run_workers(&g);
    double wall = (grade_now_ms() - g.t0) / 1e3;
    grade_router_counts after = grade_router_metrics(&o);
    int rep = grade_report(&g);
    grade_summary(&g, wall, before, after);
    rc = g.failed || rep ? 1 : 0;
out:
    grade_class_free(&g);
    if (o.bench) for (int i = 0; i < o.n_subs; i++) free(o.subs[i]);
    free(o.subs);
    free(bench_rubric);
    curl_global_cleanup();
    return rc;
}
