/* grade_files.c - the files of `tandem grade`: clocks, the output folder
 * (created, and refused when a symbolic link was planted in it), bounded
 * reads of regular files, atomic writes, SHA-256; and the submissions: a
 * folder walked (bounded in files and depth), its text files numbered into
 * the listing the models read, binary and blank ones flagged, the hash over
 * paths and contents, the output stem.
 */
#include "grade/grade_internal.h"
#include "grade/grade_check.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ==== Files ==== */

double grade_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void grade_sleep_ms(double ms) {
    if (ms <= 0) return;
    struct timespec ts = { (time_t)(ms / 1e3), (long)(fmod(ms, 1e3) * 1e6) };
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

/* mkdir -p */
int grade_mkdirs(const char *path) {
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
int grade_check_out_tree(const char *dir, int depth, long *seen, char *err, size_t errlen) {
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
char *grade_read_regular(const char *path, size_t max, size_t *len, char *err, size_t errlen) {
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

int grade_write_text(const char *path, const char *text) {
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
json_t *grade_json_text(const char *s) {
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

void grade_sha256_str(const char *s, char out[65]) {
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
void grade_sub_load(grade_sub *s, size_t max_bytes) {
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

void grade_sub_name(grade_sub *s) {
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
