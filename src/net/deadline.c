/* deadline.c - see deadline.h. */
#include "net/deadline.h"

int deadline_prefill_ms(long long n_positions) {
    if (n_positions <= 0) return DEADLINE_BASE_MS;
    if (n_positions >= DEADLINE_MAX_MS / DEADLINE_MS_PER_POSITION) return DEADLINE_MAX_MS;   /* no overflow */
    long long ms = n_positions * DEADLINE_MS_PER_POSITION;
    if (ms < DEADLINE_BASE_MS) return DEADLINE_BASE_MS;
    return ms > DEADLINE_MAX_MS ? DEADLINE_MAX_MS : (int)ms;
}

int deadline_prefill_extra_ms(long long n_positions) {
    return deadline_prefill_ms(n_positions) - DEADLINE_BASE_MS;
}
