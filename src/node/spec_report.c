/* spec_report.c - see spec_report.h. */
#include "node/spec_report.h"

#include <stdio.h>
#include <string.h>

/* ==== /metrics ==== */

int spec_metrics_init(spec_metrics *sm, metrics *reg, char *err, size_t errlen) {
    static const char *const ls[] = {"model", "source", NULL};
    return !(sm->drafted = metrics_counter(reg, "tandem_decode_spec_drafted_tokens_total",
                                           "Speculative drafts verified by the model.", ls, err, errlen)) ||
           !(sm->accepted = metrics_counter(reg, "tandem_decode_spec_accepted_tokens_total",
                                            "Speculative drafts kept (equal to the model's own token).", ls, err, errlen)) ||
           !(sm->steps = metrics_counter(reg, "tandem_decode_spec_steps_total",
                                         "Decode steps of single sequences (their rows in one model pass).", ls, err,
                                         errlen)) ||
           !(sm->step_tokens = metrics_counter(reg, "tandem_decode_spec_step_tokens_total",
                                               "Tokens those decode steps produced.", ls, err, errlen)) ||
           !(sm->rate = metrics_gauge(reg, "tandem_decode_spec_acceptance_ratio",
                                      "Drafts kept / drafts verified, since start.", ls, err, errlen)) ||
           !(sm->per_step = metrics_gauge(reg, "tandem_decode_spec_tokens_per_step",
                                          "Tokens per sequence decode step, since start (1 without drafts).", ls, err,
                                          errlen))
               ? -1 : 0;
}

void spec_metrics_set(spec_metrics *sm, const char *model, const char *source, const sched_stats *ss) {
    const char *const lv[] = {model, source};
    metrics_set(sm->drafted, lv, (double)ss->spec_drafted);
    metrics_set(sm->accepted, lv, (double)ss->spec_accepted);
    metrics_set(sm->steps, lv, (double)ss->spec_steps);
    metrics_set(sm->step_tokens, lv, (double)ss->spec_tokens);
    metrics_set(sm->rate, lv, ss->spec_drafted ? (double)ss->spec_accepted / (double)ss->spec_drafted : 0.0);
    metrics_set(sm->per_step, lv, ss->spec_steps ? (double)ss->spec_tokens / (double)ss->spec_steps : 0.0);
}

/* ==== JSON and log ==== */

void spec_stats_json(json_t *o, const char *source, const sched_stats *ss) {
    json_object_set_new(o, "spec_source", json_string(source));
    json_object_set_new(o, "spec_drafted", json_integer((json_int_t)ss->spec_drafted));
    json_object_set_new(o, "spec_accepted", json_integer((json_int_t)ss->spec_accepted));
    json_object_set_new(o, "spec_steps", json_integer((json_int_t)ss->spec_steps));
    json_object_set_new(o, "spec_step_tokens", json_integer((json_int_t)ss->spec_tokens));
    json_object_set_new(o, "spec_acceptance",
                        json_real(ss->spec_drafted ? (double)ss->spec_accepted / (double)ss->spec_drafted : 0.0));
    json_object_set_new(o, "spec_tokens_per_step",
                        json_real(ss->spec_steps ? (double)ss->spec_tokens / (double)ss->spec_steps : 0.0));
}

void spec_result_json(json_t *o, const char *source, const sched_view *v) {
    if (!strcmp(source, "none")) return;
    json_t *s = json_object();
    json_object_set_new(s, "source", json_string(source));
    json_object_set_new(s, "drafted", json_integer(v->drafted));
    json_object_set_new(s, "accepted", json_integer(v->accepted));
    json_object_set_new(o, "speculative", s);
}

void spec_log_fields(char *buf, size_t cap, const char *source, const sched_view *v) {
    if (!cap) return;
    buf[0] = 0;
    if (strcmp(source, "none")) snprintf(buf, cap, " spec=%s drafted=%d accepted=%d", source, v->drafted, v->accepted);
}
