/* fuzz_tokenizer.c - libFuzzer target: arbitrary bytes through the BPE and
 * SPM tokenizers (encode with and without special-token parsing), then back
 * through token decoding and the UTF-8-safe stream.
 *
 * The vocabularies are llama.cpp's test vocab files from the fixtures
 * ($TANDEM_FIXTURES or ../shared/fixtures). Build and run:
 *   make fuzz && build/fuzz_tokenizer -max_total_time=60
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"

typedef struct { gguf_file *f; tokenizer *t; } vocab;
static vocab V[3];
static int n_vocab_files;

static void fuzz_load(void) {
    static const char *names[] = { "ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf" };
    const char *dir = getenv("TANDEM_FIXTURES");
    if (!dir) dir = "../shared/fixtures";
    for (int i = 0; i < 3; i++) {
        char path[1024], err[256];
        snprintf(path, sizeof path, "%s/vocab/%s", dir, names[i]);
        if (gguf_open_file(&V[n_vocab_files].f, path, err, sizeof err)) continue;
        if (tokenizer_load(&V[n_vocab_files].t, V[n_vocab_files].f, err, sizeof err)) {
            gguf_close(V[n_vocab_files].f);
            continue;
        }
        n_vocab_files++;
    }
    if (!n_vocab_files) abort();   /* fixtures missing: nothing to fuzz */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!n_vocab_files) fuzz_load();
    if (size < 1) return 0;
    const tokenizer *t = V[data[0] % n_vocab_files].t;
    int special = data[0] & 0x80;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t ids[4096];
    int64_t n = tokenizer_encode(t, text, len, 1, special, ids, 4096);
    if (n < 0) return 0;
    if (n > 4096) n = 4096;
    tok_stream s;
    tok_stream_init(&s, t);
    char out[1024];
    for (int64_t i = 0; i < n; i++) {
        char piece[512];
        tokenizer_token_bytes(t, ids[i], 1, piece, sizeof piece);
        tok_stream_push(&s, ids[i], out, sizeof out);
    }
    tok_stream_flush(&s, out, sizeof out);
    return 0;
}
