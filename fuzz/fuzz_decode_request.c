/* fuzz_decode_request.c - libFuzzer target: arbitrary bytes as the body of a
 * decode node's POST /v1/generate, through the same parser and validator the
 * node uses (JSON, field types and ranges, "messages" rendered with the chat
 * template, prompt tokenization, context limit).
 *
 * Models from the fixtures ($TANDEM_FIXTURES or ../shared/fixtures): the
 * first input byte picks stories260K (SPM, no chat template) or
 * qwen3-mini-Q8_0 (byte-level BPE, ChatML). Run:
 *   make fuzz && build/fuzz_decode_request -max_total_time=60
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model.h"
#include "node/node_decode.h"

static model *M[2];
static decode_node_opts O[2];

static void fuzz_load(void) {
    static const char *names[] = { "stories260K.gguf", "qwen3-mini-Q8_0.gguf" };
    const char *dir = getenv("TANDEM_FIXTURES");
    if (!dir) dir = "../shared/fixtures";
    for (int i = 0; i < 2; i++) {
        char path[1024], err[256];
        snprintf(path, sizeof path, "%s/models/%s", dir, names[i]);
        model_opts mo = { .n_threads = 1, .n_batch = 64 };
        if (model_load(&M[i], path, &mo, err, sizeof err)) { fprintf(stderr, "%s: %s\n", path, err); abort(); }
        O[i].n_ctx = 256;                /* small, so overlong prompts are reachable */
        O[i].local_only = i;             /* both kinds of prefill policy */
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!M[0]) fuzz_load();
    if (size < 1) return 0;
    int k = data[0] & 1;
    char err[512];
    decode_node_check_request(M[k], &O[k], (const char *)data + 1, size - 1, err, sizeof err);
    return 0;
}
