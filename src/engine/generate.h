/* generate.h - the prompt -> tokens loop shared by the CLI and the servers.
 *
 * generate_run() evaluates the prompt (unless the caller already has its
 * logits), then samples and feeds tokens until max_tokens, an end-of-
 * generation token (unless ignore_eos), a full context (stopped_ctx: the
 * last token sampled has no position left to be evaluated at) or the
 * callback asks to stop.
 */
#ifndef TANDEM_GENERATE_H
#define TANDEM_GENERATE_H

#include <stdint.h>

#include "engine/model.h"
#include "engine/sampler.h"

/* Called for every generated token; return non-zero to stop. */
typedef int (*gen_token_fn)(void *ud, int32_t id);

typedef struct {
    int max_tokens;
    int ignore_eos;
    gen_token_fn on_token;
    void *ud;
} gen_opts;

typedef struct {
    int n_prompt;            /* prompt tokens evaluated here */
    int n_gen;               /* tokens generated */
    double prompt_ms;        /* time to evaluate the prompt */
    double gen_ms;           /* time for the generated tokens after the first */
    int stopped_eos;
    int stopped_ctx;         /* the session's context is full */
} gen_stats;

double gen_now_ms(void);


/* logits: n_vocab floats. If `have_logits` is set they already hold the
 * prompt's last-position logits and the prompt is not evaluated here. */
int generate_run(model *m, session *s, sampler *smp, const int32_t *prompt, int n_prompt,
                 float *logits, int have_logits, const gen_opts *o, gen_stats *st,
                 char *err, size_t errlen);

#endif
