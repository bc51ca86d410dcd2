/* quant_neon_i8mm.c - the NEON kernels built for armv8.2-a+dotprod+i8mm (the
 * Makefile adds the flags on arm64): sdot for one weight row, and smmla for
 * two weight rows against two activation rows in the prefill tiles. */
#define QN_SET i8mm
#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
#define QN_SET_OK 1
#else
#define QN_SET_OK 0   /* built without the flags (or not for arm64): an empty set */
#endif
#include "quant_neon.c"
