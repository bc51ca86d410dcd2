/* fuzz_model.c - libFuzzer target for model loading: GGUF bytes -> model_load
 * -> one token through the forward pass.
 *
 * fuzz_gguf stops at the GGUF reader; this one goes on through what trusts
 * it: hyper-parameters, tokenizer, weight binding, then session_new (a small
 * context, so the KV cache and activation buffers are sized from the file's
 * widths) and model_eval of one token, which touches every bound weight. A
 * file is either refused with a message or runs without a sanitizer report.
 *
 * The input is written to a memfd and loaded through /proc/self/fd/N, the
 * same mmap path as a real file (elsewhere than Linux: a temporary file).
 * Inputs over FUZZ_MAX_BYTES are skipped: the interesting files are tiny
 * models (tools/test.sh seeds it with gen-model output of about 40 KB per
 * architecture), and every weight must lie inside the file, so big inputs
 * only make iterations slow.
 *
 * Run (from the repository root, after `make fuzz`):
 *   mkdir -p /tmp/model_seeds && build/tandem gen-model --arch qwen3 \
 *     --vocab-from ../shared/fixtures/models/stories260K.gguf --n-embd 32 --n-layer 1 \
 *     --n-head 2 --n-head-kv 1 --head-dim 32 --n-ff 32 -q -o /tmp/model_seeds/qwen3.gguf
 *   build/fuzz_model -max_total_time=60 -max_len=65536 -rss_limit_mb=2048 /tmp/model_corpus /tmp/model_seeds
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/model.h"

/* Larger inputs are ignored (see above); -max_len should not exceed it. */
#define FUZZ_MAX_BYTES (256u * 1024u)

static volatile float fuzz_sink;
static int fuzz_fd = -1;
static char fuzz_path[64];

#if !defined(__linux__)
static void fuzz_unlink(void) { unlink(fuzz_path); }
#endif

/* Opens the file the inputs go through (once), names it in fuzz_path. */
static int fuzz_open_file(void) {
#if defined(__linux__)
    fuzz_fd = memfd_create("fuzz_model", MFD_CLOEXEC);
    snprintf(fuzz_path, sizeof fuzz_path, "/proc/self/fd/%d", fuzz_fd);
#else
    snprintf(fuzz_path, sizeof fuzz_path, "/tmp/fuzz_model.XXXXXX");
    fuzz_fd = mkstemp(fuzz_path);
    if (fuzz_fd >= 0) atexit(fuzz_unlink);
#endif
    return fuzz_fd;
}

static int fuzz_write_file(const uint8_t *data, size_t size) {
    if (fuzz_fd < 0) fuzz_open_file();
    if (fuzz_fd < 0 || ftruncate(fuzz_fd, 0) != 0) return -1;
    size_t off = 0;
    while (off < size) {
        ssize_t n = pwrite(fuzz_fd, data + off, size - off, (off_t)off);
        if (n <= 0) return -1;
        off += (size_t)n;
    }
    return 0;
}

static void fuzz_run_token(model *m) {
    char err[256];
    session *s = NULL;
    /* 8 positions: the KV cache stays small whatever context_length says */
    if (session_new(&s, m, 8, GGML_TYPE_F16, err, sizeof err) != 0) return;
    const model_hparams *hp = model_get_hparams(m);
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    int32_t id = hp->n_vocab > 1 ? 1 : 0;
    if (logits && model_eval(m, s, &id, 1, logits, NULL, NULL, err, sizeof err) == 0)
        fuzz_sink += logits[0] + logits[hp->n_vocab - 1];
    free(logits);
    session_free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0 || size > FUZZ_MAX_BYTES || fuzz_write_file(data, size) != 0) return 0;
    char err[256];
    model_opts o = { .n_threads = 1, .n_batch = 4 };   /* one thread, chunks of 4 tokens: small activation buffers */
    model *m = NULL;
    if (model_load(&m, fuzz_path, &o, err, sizeof err) == 0) {
        fuzz_run_token(m);
        model_free(m);
    }
    return 0;
}
