/* fingerprint.h - a model's identity for the wire handshake.
 *
 * Two nodes may exchange KV only if their models would produce bit-identical
 * KV for the same tokens. The fingerprint is SHA-256 over a canonical
 * description of everything that changes the KV:
 *   - a version tag ("tandem-fingerprint-v1"),
 *   - architecture and every hyper-parameter that shapes the computation
 *     (n_layer, n_head, n_head_kv, head dims, n_embd, n_ff, n_vocab, expert
 *     counts, RMS epsilon, RoPE mode / n_rot / freq_base / freq_scale /
 *     per-pair frequency factors), floats by their exact bit patterns,
 *   - every tokenizer.* metadata key with its type and value,
 *   - every tensor's name, type, shape, and an XXH3-128 of its data.
 * The KV cache dtype is NOT included: it travels in HELLO and is checked by
 * the handshake. Nothing is cached on disk: hashing reads every weight byte
 * (XXH3 runs at several GB/s, on the model's threads, so this is a fraction
 * of the load time).
 */
#ifndef TANDEM_FINGERPRINT_H
#define TANDEM_FINGERPRINT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"

/* out: 32-byte fingerprint. desc (optional): a human description such as
 * "qwen3-mini-Q8_0.gguf (qwen3, 4 layers, n_embd 256, Q8_0)"; the file name
 * is found from the model's mapping, falling back to general.name. 0 on
 * success, -1 if hashing failed (desc then holds the reason). */
int model_fingerprint(const model *m, uint8_t out[32], char *desc, size_t desc_len);

/* Lower-case hex of the first n bytes of fp (out holds 2n+1 chars). */
void fingerprint_hex(const uint8_t *fp, size_t n, char *out);

#endif
