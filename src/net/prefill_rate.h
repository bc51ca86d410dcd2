/* prefill_rate.h - a node's measured prompt-processing rate, which the
 * router's cost model compares across nodes (docs/router.md).
 *
 * A node measures it once at start-up (a short calibration pass on the
 * loaded model, so the router can judge a split before any request ran)
 * and then follows its real prefills with an exponential moving average.
 * Shared by the prefill node (which reports it in its HELLO) and the decode
 * node (in GET /v1/stats).
 */
#ifndef TANDEM_PREFILL_RATE_H
#define TANDEM_PREFILL_RATE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"

/* Prompt positions in the calibration pass: long enough that per-pass
 * costs (thread start-up, the output layer) are a small part of it, and
 * the length of a prompt worth splitting (attention makes the rate fall
 * with length: a 256-position pass overstated the rate of 800-token
 * prompts by ~30% on the fixture model); short enough to cost well under a
 * second on a small model. */
#define PREFILL_RATE_CALIB_TOKENS 512
/* Weight of a new request in the moving average. */
#define PREFILL_RATE_ALPHA 0.3
/* Requests computing fewer positions than this are not counted: their time
 * is mostly per-pass cost, not the prompt's. */
#define PREFILL_RATE_MIN_TOKENS 16

/* Evaluates n_tokens synthetic positions in a fresh session (chunks of the
 * model's n_batch, as a real prefill); *tps = positions per second.
 * 0, or -1 with a message. */
int prefill_rate_calibrate(model *m, int n_tokens, uint32_t kv_dtype, double *tps, char *err, size_t errlen);

/* Folds one request (n positions computed in ms) into *avg. */
void prefill_rate_update(double *avg, int n, double ms);

/* A prefill node's HELLO carries its rate at the end of model_desc, after
 * PREFILL_RATE_TAG ("...; prefill 2345 t/s"): the router reads it from the
 * HELLO its health probe already gets, with no protocol change. */
#define PREFILL_RATE_TAG "; prefill "
/* base + the tag into out (base alone when tps <= 0). */
void prefill_rate_format(char *out, size_t outlen, const char *base, double tps);
/* The rate in a description, or -1 when it carries none (bounded: a rate
 * outside (0, 1e9) is no rate). */
double prefill_rate_parse(const char *desc);

/* A prefill node's context (the longest prompt it takes) rides in the same
 * description, before the rate: "...; ctx 4096; prefill 2345 t/s". The
 * router plans no split of a longer prompt to it (docs/router.md). */
#define PREFILL_CTX_TAG "; ctx "
/* base + "; ctx N" into out (base alone when n_ctx <= 0). */
void prefill_ctx_format(char *out, size_t outlen, const char *base, int n_ctx);
/* The context in a description, or 0 when it carries none (bounded: a
 * value outside 1..PREFILL_CTX_MAX, or one not ending its clause, is none). */
#define PREFILL_CTX_MAX (1 << 24)
int prefill_ctx_parse(const char *desc);

#endif
