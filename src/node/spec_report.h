/* spec_report.h - a decode node's speculative-decoding figures: /metrics
 * families, /v1/stats members, the request's "speculative" member and log
 * fields (kept out of node_decode.c).
 *
 * /metrics (labels model, source: the node's draft source, "lookup",
 * "model", "lookup+model" or "none"):
 *   tandem_decode_spec_drafted_tokens_total   drafts verified
 *   tandem_decode_spec_accepted_tokens_total  drafts kept
 *   tandem_decode_spec_steps_total            sequence decode steps (one
 *                                             sequence's rows in one pass)
 *   tandem_decode_spec_step_tokens_total      tokens those steps produced
 *   tandem_decode_spec_acceptance_ratio       accepted / drafted
 *   tandem_decode_spec_tokens_per_step        step tokens / steps (1.0
 *                                             without drafts)
 */
#ifndef TANDEM_SPEC_REPORT_H
#define TANDEM_SPEC_REPORT_H

#include <jansson.h>
#include <stddef.h>

#include "base/metrics.h"
#include "node/scheduler.h"

typedef struct {
    metrics_family *drafted, *accepted, *steps, *step_tokens, *rate, *per_step;
} spec_metrics;

int spec_metrics_init(spec_metrics *sm, metrics *reg, char *err, size_t errlen);
/* Copies the scheduler's counts into the families (at each scrape). */
void spec_metrics_set(spec_metrics *sm, const char *model, const char *source, const sched_stats *ss);
/* /v1/stats: "spec_source", "spec_drafted", "spec_accepted", "spec_steps",
 * "spec_step_tokens", "spec_acceptance", "spec_tokens_per_step". */
void spec_stats_json(json_t *o, const char *source, const sched_stats *ss);
/* A request's result: "speculative": {"source", "drafted", "accepted"}
 * (nothing without a draft source). */
void spec_result_json(json_t *o, const char *source, const sched_view *v);
/* " spec=SOURCE drafted=N accepted=M" for the request's log line ("" without
 * a draft source). */
void spec_log_fields(char *buf, size_t cap, const char *source, const sched_view *v);

#endif
