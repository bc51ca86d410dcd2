/* spec.h - speculative decoding: what does not depend on where drafts come
 * from or on the serving loop.
 *
 * A verification step evaluates, for one sequence, the last accepted token
 * and k drafted tokens in one pass (model_batch_item with n = 1 + k and
 * n_logits = 1 + k): row i's logits are the target's next-token logits
 * after draft i (row 0: after the accepted token). Row 0 is sampled as in
 * plain decoding; while the sampled token equals the next draft, that
 * draft's row is valid too and the next row is sampled; the first mismatch
 * (or row k) gives the target's own token, and the cache keeps the rows up
 * to the last accepted draft (session_reset drops the others).
 *
 * Prompt lookup, and a draft model for a greedy sequence, propose drafts
 * deterministically from the context, so the draft distribution q is a
 * point mass on the proposed token (a draft model for a sampled sequence
 * draws its drafts from its own q instead: engine/spec_sample.h). For a point mass the speculative-sampling rule (accept x with
 * probability min(1, p(x)/q(x)) = p(x); on rejection draw from
 * norm(max(0, p - q)), which is p without x) gives the same joint law as
 * drawing t ~ p with the sequence's sampler and accepting iff t == x: that is
 * what the callers do. Under it, a step's tokens have exactly the target's
 * distribution (temperature, top-k/p, min-p, penalties, bias and grammar
 * masks included, since the sampler sees the same logits in the same state
 * as it would without drafts), and with the same seed the very same tokens
 * come out as without drafts.
 *
 * Prompt lookup (spec_lookup): the longest n-gram (SPEC_NGRAM_MAX down to
 * SPEC_NGRAM_MIN tokens) ending the history that occurred before, at its
 * most recent earlier occurrence; the tokens that followed it are the drafts.
 *
 * Adaptive draft length (spec_adapt): per sequence, an estimate of the
 * probability that a draft is accepted given its predecessors were (alpha,
 * an exponentially weighted count of accepted and rejected drafts), and the
 * draft length k in 0..k_max that maximises expected tokens per step
 * (1 - alpha^(k+1)) / (1 - alpha) over the step's relative cost 1 + c k
 * (c: one more verified row plus one draft's cost, as a fraction of a plain
 * step). When no k > 0 pays, the sequence decodes plainly and tries one
 * draft every 8 steps (less often as c grows: spec.c), so a text that turns
 * repetitive later is noticed.
 */
#ifndef TANDEM_SPEC_H
#define TANDEM_SPEC_H

#include <stdint.h>

/* Drafts per step at most (the verification's rows are 1 + k). */
#define SPEC_MAX_DRAFT 16

/* Prompt lookup n-gram lengths, longest first. */
#define SPEC_NGRAM_MAX 4
#define SPEC_NGRAM_MIN 1

/* Up to k drafts for hist[0, n): the continuation of the most recent
 * earlier occurrence of the longest n-gram that ends hist. Returns how many
 * (0: no n-gram recurs). */
int spec_lookup(const int32_t *hist, int n, int k, int32_t *out);

typedef struct {
    double acc, rej;         /* weighted counts of accepted / rejected drafts */
    int idle;                /* steps since the last draft while k is 0 */
    uint64_t drafted, accepted, steps, step_tokens;   /* totals, for reports */
} spec_adapt;

void spec_adapt_init(spec_adapt *a);
/* Drafts to ask for this step: 0..k_max. cost: c above (> 0; 0 asks for
 * k_max every step). */
int spec_adapt_k(spec_adapt *a, int k_max, double cost);
/* After a step that verified `drafted` drafts, of which `accepted` were
 * kept (a prefix), and produced `tokens` tokens. */
void spec_adapt_update(spec_adapt *a, int drafted, int accepted, int tokens);

/* ==== What a verified row costs ====
 * The scheduler's passes timed against the rows they carried, fitted to
 * t = a + b rows (exponentially weighted least squares, about the last 64
 * passes). One more row costs b; a decoding sequence's share of a pass is
 * a / n_seq + b, so c = b / (a / n_seq + b): drafts are cheap beside one
 * stream on a memory-bound machine and dearer when many streams already
 * fill the pass. Until the rows have varied enough to fit, the prior; a
 * fixed part under a quarter of the mean pass is taken as that quarter. */
typedef struct {
    double w, r, t, rr, rt;  /* weighted sums: 1, rows, ms, rows^2, rows * ms */
} spec_cost;

void spec_cost_init(spec_cost *c);
void spec_cost_add(spec_cost *c, int rows, double ms);
double spec_cost_row(const spec_cost *c, int n_seq, double prior);

#endif
