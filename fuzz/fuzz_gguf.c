/* fuzz_gguf.c - libFuzzer target for the GGUF reader.
 *
 * Parses the input with gguf_open_memory() and, when it is accepted, touches
 * everything the reader hands out: every kv through every typed getter, every
 * element of every array (each string of string arrays), every tensor's first
 * and last data byte, name lookups, and a copy of each kv into a writer.
 *
 * Build and run (from the repository root; about 60 s, seeded with small fixtures):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -Isrc fuzz/fuzz_gguf.c src/engine/gguf.c -o /tmp/fuzz_gguf
 *   mkdir -p /tmp/gguf_corpus && cp ../shared/fixtures/models/stories260K*.gguf /tmp/gguf_corpus/
 *   head -c 200000 ../shared/fixtures/vocab/ggml-vocab-llama-spm.gguf > /tmp/gguf_corpus/spm-cut.gguf
 *   /tmp/fuzz_gguf -max_total_time=60 -max_len=1100000 -rss_limit_mb=2048 /tmp/gguf_corpus
 * (`make fuzz` builds build/fuzz_gguf the same way, linked with all library sources.)
 */
#include "engine/gguf.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Keeps the compiler from dropping the reads. */
static volatile uint64_t fuzz_sink;

static void fuzz_walk_arr(const gguf_arr *a)
{
    static const uint64_t es[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    uint64_t acc = a->n;
    if (a->elem_type == GGUF_VT_STR) {
        gguf_str_iter it;
        gguf_str_iter_init(&it, a);
        gguf_str s;
        while (gguf_str_iter_next(&it, &s) == 0)
            if (s.len)
                acc += (unsigned char)s.ptr[0] + (unsigned char)s.ptr[s.len - 1];
        /* and at random: the first, the last, one in the middle */
        for (uint64_t j = 0; a->n && j < 3; j++)
            if (gguf_arr_str(a, j == 0 ? 0 : j == 1 ? a->n - 1 : a->n / 2, &s) == 0 && s.len)
                acc += (unsigned char)s.ptr[s.len - 1];
    } else if (a->elem_type < sizeof es / sizeof es[0] && a->n) {
        uint64_t bytes = a->n * es[a->elem_type];
        acc += a->data[0] + a->data[bytes - 1];
    }
    fuzz_sink += acc;
}

static void fuzz_walk_kvs(const gguf_file *f)
{
    gguf_writer *w = gguf_writer_new(0);
    for (int64_t i = 0; i < gguf_count_kv(f); i++) {
        gguf_str k = gguf_kv_key(f, i);
        char key[GGUF_MAX_KEY_LEN + 1];
        memcpy(key, k.ptr, (size_t)k.len);
        key[k.len] = 0;
        uint32_t u;
        int64_t v;
        float x;
        int b;
        gguf_str s;
        gguf_arr a;
        fuzz_sink += (uint64_t)gguf_find_kv(f, key) + gguf_kv_type(f, i);
        if (gguf_get_u32(f, key, &u) == 0) fuzz_sink += u;
        if (gguf_get_i64(f, key, &v) == 0) fuzz_sink += (uint64_t)v;
        if (gguf_get_f32(f, key, &x) == 0) fuzz_sink += (uint64_t)(x == x);
        if (gguf_get_bool(f, key, &b) == 0) fuzz_sink += (uint64_t)b;
        if (gguf_get_str(f, key, &s) == 0 && s.len) fuzz_sink += (unsigned char)s.ptr[s.len - 1];
        if (gguf_get_arr(f, key, &a) == 0) fuzz_walk_arr(&a);
        if (w) gguf_writer_copy_kv(w, f, i);
    }
    gguf_writer_free(w);
}

static void fuzz_walk_tensors(const gguf_file *f)
{
    for (int64_t i = 0; i < gguf_count_tensors(f); i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        char name[GGUF_MAX_TENSOR_NAME + 1];
        memcpy(name, t->name.ptr, (size_t)t->name.len);
        name[t->name.len] = 0;
        const unsigned char *d = t->data;
        fuzz_sink += d[0] + d[t->nbytes - 1] + gguf_row_bytes(t->type, t->ne[0]);
        fuzz_sink += (uintptr_t)gguf_find_tensor(f, name);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    gguf_file *f = NULL;
    char err[256];
    if (gguf_open_memory(&f, data, size, err, sizeof err) != 0)
        return 0;
    fuzz_walk_kvs(f);
    fuzz_walk_tensors(f);
    fuzz_sink += gguf_get_version(f) + gguf_get_alignment(f) + gguf_get_data_offset(f);
    gguf_close(f);
    return 0;
}
