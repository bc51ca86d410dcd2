/* generate.c - see generate.h. */
#include "engine/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/kvcache.h"

double gen_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int generate_run(model *m, session *s, sampler *smp, const int32_t *prompt, int n_prompt,
                 float *logits, int have_logits, const gen_opts *o, gen_stats *st,
                 char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    const tokenizer *tok = model_get_tokenizer(m);
    double t0 = gen_now_ms();
    if (!have_logits) {
        if (n_prompt <= 0) { snprintf(err, errlen, "empty prompt"); return -1; }
        if (model_eval(m, s, prompt, n_prompt, logits, NULL, NULL, err, errlen)) return -1;
        st->n_prompt = n_prompt;
    }
    double t1 = gen_now_ms();
    st->prompt_ms = t1 - t0;
    double t_first = t1;
    for (int i = 0; i < o->max_tokens; i++) {
        int32_t id = sampler_sample(smp, logits);
        if (!o->ignore_eos && tokenizer_is_eog(tok, id)) { st->stopped_eos = 1; break; }
        st->n_gen++;
        if (i == 0) t_first = gen_now_ms();
        if (o->on_token && o->on_token(o->ud, id)) break;
        if (i + 1 == o->max_tokens) break;
        if (session_pos(s) >= kv_n_ctx(session_kv(s))) { st->stopped_ctx = 1; break; }
        if (model_eval(m, s, &id, 1, logits, NULL, NULL, err, errlen)) return -1;
    }
    st->gen_ms = gen_now_ms() - t_first;
    return 0;
}
