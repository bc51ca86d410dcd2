/* fingerprint.c - SHA-256 identity of everything in a model that changes
 * its KV cache (see fingerprint.h for what is covered and why).
 */
#include "engine/fingerprint.h"
#include "base/platform.h"
#include "engine/model_internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include <openssl/evp.h>
#include <xxhash.h>

/* Bump when the canonical description changes: old and new nodes must
 * then refuse each other rather than compare unlike digests. */
#define FP_VERSION_TAG "tandem-fingerprint-v1"

/* ==== Canonical stream ==== */

typedef struct {
    EVP_MD_CTX *md;
    int failed;
} fp_ctx;

static void fp_bytes(fp_ctx *c, const void *p, size_t n) {
    if (!c->failed && n && EVP_DigestUpdate(c->md, p, n) != 1) c->failed = 1;
}

/* Fields are "name=value\n" lines; binary values are length-prefixed. */
static void fp_line(fp_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));


static void fp_line(fp_ctx *c, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) { c->failed = 1; return; }
    fp_bytes(c, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    fp_bytes(c, "\n", 1);
}

static void fp_u64(fp_ctx *c, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    fp_bytes(c, b, 8);
}

/* Length-prefixed byte string (no ambiguity between adjacent fields). */
static void fp_blob(fp_ctx *c, const void *p, uint64_t n) {
    fp_u64(c, n);
    fp_bytes(c, p, (size_t)n);
}

static uint32_t fp_fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ==== Hyper-parameters ==== */

static void fp_hparams(fp_ctx *c, const model_hparams *h) {
    fp_line(c, "arch=%s", h->arch_name ? h->arch_name : "?");
    fp_line(c, "arch_id=%d", (int)h->arch);
    fp_line(c, "n_vocab=%d n_embd=%d n_layer=%d n_head=%d n_head_kv=%d", h->n_vocab, h->n_embd,
            h->n_layer, h->n_head, h->n_head_kv);
    fp_line(c, "head_dim_k=%d head_dim_v=%d n_ff=%d", h->head_dim_k, h->head_dim_v, h->n_ff);
    fp_line(c, "n_expert=%d n_expert_used=%d n_ff_exp=%d expert_norm=%d", h->n_expert, h->n_expert_used,
            h->n_ff_exp, h->expert_norm);
    fp_line(c, "rms_eps=%08x", fp_fbits(h->rms_eps));
    fp_line(c, "rope_mode=%d n_rot=%d freq_base=%08x freq_scale=%08x", h->rope.mode, h->rope.n_rot,
            fp_fbits(h->rope.freq_base), fp_fbits(h->rope.freq_scale));
    int nf = h->rope.freq_factors && h->rope.n_rot > 0 ? h->rope.n_rot / 2 : 0;
    fp_line(c, "freq_factors=%d", nf);
    for (int i = 0; i < nf; i++) fp_line(c, "%08x", fp_fbits(h->rope.freq_factors[i]));
}

/* ==== Tokenizer metadata ==== */

/* One tokenizer.* key: key, value type, and its value in a canonical form
 * (strings and fixed-size arrays by their bytes, scalars widened). */
static void fp_kv_value(fp_ctx *c, const gguf_file *f, const char *key, uint32_t vt) {
    gguf_str s;
    gguf_arr a;
    int64_t iv;
    float fv;
    int bv;
    fp_u64(c, vt);
    switch (vt) {
    case GGUF_VT_STR:
        if (gguf_get_str(f, key, &s) == 0) fp_blob(c, s.ptr, s.len);
        else fp_line(c, "unreadable");
        return;
    case GGUF_VT_ARR:
        if (gguf_get_arr(f, key, &a) != 0) { fp_line(c, "unreadable"); return; }
        fp_u64(c, a.elem_type);
        fp_u64(c, a.n);
        if (a.elem_type == GGUF_VT_STR) {
            gguf_str_iter it;
            gguf_str_iter_init(&it, &a);
            for (uint64_t i = 0; i < a.n; i++) {
                if (gguf_str_iter_next(&it, &s) == 0) fp_blob(c, s.ptr, s.len);
                else fp_line(c, "unreadable");
            }
        } else {
            static const uint8_t esz[] = { 1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8 };
            uint64_t sz = a.elem_type < sizeof esz ? esz[a.elem_type] : 0;
            if (sz && a.data) fp_blob(c, a.data, a.n * sz);
        }
        return;
    case GGUF_VT_F32: case GGUF_VT_F64:
        if (gguf_get_f32(f, key, &fv) == 0) fp_line(c, "%08x", fp_fbits(fv));
        return;
    case GGUF_VT_BOOL:
        if (gguf_get_bool(f, key, &bv) == 0) fp_line(c, "%d", bv);
        return;
    default:
        if (gguf_get_i64(f, key, &iv) == 0) fp_line(c, "%" PRId64, iv);
        else fp_line(c, "out-of-range");
        return;
    }
}

static void fp_tokenizer(fp_ctx *c, const gguf_file *f) {
    int64_t n = gguf_count_kv(f);
    for (int64_t i = 0; i < n; i++) {
        gguf_str k = gguf_kv_key(f, i);
        if (k.len < 10 || k.len > 255 || memcmp(k.ptr, "tokenizer.", 10) != 0) continue;
        char key[256];
        memcpy(key, k.ptr, k.len);
        key[k.len] = 0;
        fp_blob(c, key, k.len);
        fp_kv_value(c, f, key, gguf_kv_type(f, i));
    }
}

/* ==== Tensor digests ====
 * Every tensor's XXH3-128 is independent of the others, so they are taken
 * on the model's threads, largest tensors first (each thread takes the next
 * one), then fed to the SHA-256 stream in file order. One thread read the
 * 3.2 GB of the 30B-A3B-shape test file in about a second. */

typedef struct { uint64_t bytes; int64_t index; } fp_size;

typedef struct {
    const gguf_file *f;
    const model *m;
    int64_t n;
    const fp_size *order;             /* the tensors, largest first */
    _Atomic int64_t next;             /* next position in order */
    XXH128_canonical_t *out;          /* [n], by tensor index */
} fp_hash_job;

/* A slice node hashes the whole file (its fingerprint must be the whole
 * model's, which every node of a chain and the decode node agree on) but
 * holds only its own layers: the pages of a tensor it does not use leave
 * its resident set once hashed (plat_map_drop on the read-only file
 * mapping drops them from this process; the page cache keeps them), so the
 * hashing never holds the whole file. Pages shared with a neighbour tensor
 * are kept (rounded inward); model_drop_unused_pages sweeps those, and the
 * pages a neighbour's fault mapped again, once every thread is done. */
static void fp_hash_run(fp_hash_job *j) {
    for (;;) {
        int64_t k = atomic_fetch_add(&j->next, 1);
        if (k >= j->n) return;
        int64_t i = j->order[k].index;
        const gguf_tensor *t = gguf_get_tensor(j->f, i);
        if (!t) continue;
        XXH128_canonicalFromHash(&j->out[i], XXH3_128bits(t->data, (size_t)t->nbytes));
        if (j->m->sliced && !model_tensor_bound(j->m, t->name.ptr, t->name.len)) plat_map_drop(t->data, (size_t)t->nbytes);
    }
}

static void *fp_hash_thread(void *arg) {
    fp_hash_run(arg);
    return NULL;
}

static int fp_by_size(const void *a, const void *b) {
    const fp_size *x = a, *y = b;
    return x->bytes < y->bytes ? 1 : x->bytes > y->bytes ? -1 : (x->index > y->index) - (x->index < y->index);
}

/* Digests of all n tensors into out, on up to nth threads (the caller is
 * one; a thread that cannot start leaves its share to the others). */
static int fp_hash_tensors(const model *m, const gguf_file *f, int64_t n, int nth, XXH128_canonical_t *out) {
    fp_size *order = malloc(sizeof *order * (size_t)(n ? n : 1));
    if (!order) return -1;
    for (int64_t i = 0; i < n; i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        order[i] = (fp_size){ t ? t->nbytes : 0, i };
    }
    qsort(order, (size_t)n, sizeof *order, fp_by_size);
    fp_hash_job j = { .f = f, .m = m, .n = n, .order = order, .out = out };
    atomic_init(&j.next, 0);
    enum { FP_MAX_THREADS = 64 };
    pthread_t th[FP_MAX_THREADS];
    int started = 0;
    for (int t = 1; t < nth && t < FP_MAX_THREADS && t < n; t++)
        if (pthread_create(&th[started], NULL, fp_hash_thread, &j) == 0) started++;
    fp_hash_run(&j);
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    free(order);
    return 0;
}

/* ==== Tensors ==== */

static void fp_tensors(fp_ctx *c, const model *m, const gguf_file *f, int nth) {
    int64_t n = gguf_count_tensors(f);
    fp_line(c, "tensors=%" PRId64, n);
    XXH128_canonical_t *dg = malloc(sizeof *dg * (size_t)(n ? n : 1));
    if (!dg || fp_hash_tensors(m, f, n, nth, dg)) { free(dg); c->failed = 1; return; }
    for (int64_t i = 0; i < n; i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        if (!t) { c->failed = 1; break; }
        fp_blob(c, t->name.ptr, t->name.len);
        fp_line(c, "type=%u dims=%u ne=%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 " bytes=%" PRIu64,
                t->type, t->n_dims, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nbytes);
        fp_bytes(c, dg[i].digest, sizeof dg[i].digest);
    }
    free(dg);
}

/* ==== Description ==== */

/* The model's file name: the path of the mapping that holds the GGUF bytes
 * (model.h keeps no path), else general.name, else "model". */
static void fp_model_name(const gguf_file *f, char *out, size_t outlen) {
    snprintf(out, outlen, "model");
    gguf_str gn;
    if (gguf_get_str(f, "general.name", &gn) == 0 && gn.len > 0)
        snprintf(out, outlen, "%.*s", (int)(gn.len > 200 ? 200 : gn.len), gn.ptr);
    uintptr_t base = (uintptr_t)gguf_get_base(f);
    FILE *mf = fopen("/proc/self/maps", "r");
    if (!mf || !base) { if (mf) fclose(mf); return; }
    char line[4096];
    while (fgets(line, sizeof line, mf)) {
        unsigned long lo, hi;
        int off = 0;
        if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %n", &lo, &hi, &off) < 2 || !off) continue;
        if (base < lo || base >= hi) continue;
        char *path = line + off;
        path[strcspn(path, "\n")] = 0;
        if (path[0] == '/') {
            const char *slash = strrchr(path, '/');
            snprintf(out, outlen, "%s", slash + 1);
        }
        break;
    }
    fclose(mf);
}

static void fp_describe(const model *m, char *desc, size_t desc_len) {
    const model_hparams *h = model_get_hparams(m);
    char name[256];
    fp_model_name(model_get_gguf(m), name, sizeof name);
    snprintf(desc, desc_len, "%s (%s, %d layers, n_embd %d, %s)", name, h->arch_name ? h->arch_name : "?",
             h->n_layer, h->n_embd, model_type_summary(m));
}

/* ==== Public ==== */

void fingerprint_hex(const uint8_t *fp, size_t n, char *out) {
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hx[fp[i] >> 4];
        out[2 * i + 1] = hx[fp[i] & 15];
    }
    out[2 * n] = 0;
}

static int fp_compute(const model *m, uint8_t out[32], char *desc, size_t desc_len) {
    fp_ctx c = { EVP_MD_CTX_new(), 0 };
    memset(out, 0, 32);
    if (!c.md || EVP_DigestInit_ex(c.md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(c.md);
        if (desc && desc_len) snprintf(desc, desc_len, "cannot initialise SHA-256");
        return -1;
    }
    const gguf_file *f = model_get_gguf(m);
    fp_line(&c, FP_VERSION_TAG);
    fp_hparams(&c, model_get_hparams(m));
    fp_line(&c, "tokenizer");
    fp_tokenizer(&c, f);
    fp_tensors(&c, m, f, m->fp->n_threads);
    unsigned int olen = 0;
    if (!c.failed && EVP_DigestFinal_ex(c.md, out, &olen) != 1) c.failed = 1;
    EVP_MD_CTX_free(c.md);
    if (c.failed || olen != 32) {
        memset(out, 0, 32);
        if (desc && desc_len) snprintf(desc, desc_len, "model fingerprint: hashing failed");
        return -1;
    }
    if (desc && desc_len) fp_describe(m, desc, desc_len);
    model_drop_unused_pages(m);   /* a slice: what the hashing and the description left resident */
    return 0;
}

/* Computed once per model (model_fp_memo); every later call copies it. */
int model_fingerprint(const model *m, uint8_t out[32], char *desc, size_t desc_len) {
    model_fp_memo *fm = m->fp;
    pthread_mutex_lock(&fm->mu);
    int rc = 0;
    if (!fm->done) {
        rc = fp_compute(m, fm->fp, fm->desc, sizeof fm->desc);
        fm->done = rc == 0;
    }
    memcpy(out, fm->fp, 32);
    if (desc && desc_len) snprintf(desc, desc_len, "%s", fm->desc);
    pthread_mutex_unlock(&fm->mu);
    return rc;
}
