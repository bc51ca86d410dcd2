/* metrics.h - Prometheus metrics shared by the router and the nodes.
 *
 * A registry holds families (counter, gauge, histogram), each with a fixed
 * list of label names; a family's series (one per set of label values) are
 * created when first observed, so only label combinations that occur are
 * exported. metrics_render() writes the text exposition format 0.0.4: every
 * family gets "# HELP" and "# TYPE" (also while it has no series), label
 * values and help text are escaped, histogram buckets are cumulative and end
 * with le="+Inf".
 *
 * Conventions, enforced when a family is registered: names match
 * [a-zA-Z_:][a-zA-Z0-9_:]*, counters end in _total, no name ends in _ms
 * (durations are seconds: _seconds; sizes bytes: _bytes), histogram bounds
 * are finite and strictly increasing, a histogram has no label "le".
 *
 * Thread safety: one mutex per registry guards every family and series;
 * observations and rendering may come from any thread. No call blocks on
 * I/O. A family holds at most METRICS_MAX_SERIES series and a label value at
 * most METRICS_MAX_VALUE bytes of valid UTF-8: beyond that an observation is
 * dropped (-1), never allocated, so label values that come from outside
 * cannot grow a server's memory without bound.
 */
#ifndef TANDEM_METRICS_H
#define TANDEM_METRICS_H

#include <stddef.h>

#define METRICS_MAX_LABELS 4       /* label names per family */
#define METRICS_MAX_BUCKETS 24     /* histogram bounds (le="+Inf" comes on top) */
#define METRICS_MAX_SERIES 1024    /* series per family */
#define METRICS_MAX_VALUE 255      /* bytes per label value */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Bucket bounds in seconds: request-scale latencies (5 ms .. 5 min) and
 * per-token or per-transfer times (0.5 ms .. 5 s). */
extern const double metrics_buckets_latency[];
#define METRICS_N_LATENCY 15
extern const double metrics_buckets_fast[];
#define METRICS_N_FAST 13

typedef struct metrics metrics;
typedef struct metrics_family metrics_family;

metrics *metrics_new(void);
void metrics_free(metrics *m);

/* Registers a family. labels: NULL-terminated label names, or NULL for
 * none. NULL when a name breaks the conventions above, is registered
 * already, or memory runs out (err says which). */
metrics_family *metrics_counter(metrics *m, const char *name, const char *help, const char *const *labels,
                                char *err, size_t errlen);
metrics_family *metrics_gauge(metrics *m, const char *name, const char *help, const char *const *labels,
                              char *err, size_t errlen);
metrics_family *metrics_histogram(metrics *m, const char *name, const char *help, const char *const *labels,
                                  const double *bounds, int n_bounds, char *err, size_t errlen);

/* Observations. lv: one value per label name, in order (NULL for a family
 * without labels). 0, or -1 when the observation was dropped (NULL family,
 * wrong kind, negative counter increment, NaN, an infinite increment or
 * observation, series cap, bad label value, out
 * of memory). */
int metrics_add(metrics_family *f, const char *const *lv, double v);     /* counter (v >= 0) or gauge */
int metrics_set(metrics_family *f, const char *const *lv, double v);     /* gauge; or a counter copied
                                                                          * from a monotonic source */
int metrics_observe(metrics_family *f, const char *const *lv, double x); /* histogram */
/* Creates the series at zero if it does not exist yet (a combination that
 * is certain to occur, exported before it does). */
int metrics_touch(metrics_family *f, const char *const *lv);
/* Drops every series of the family (gauges rebuilt at each scrape). */
void metrics_clear(metrics_family *f);

/* The exposition text (malloc'd, NUL-terminated; *len without the NUL), or
 * NULL when out of memory. */
char *metrics_render(metrics *m, size_t *len);

#endif
