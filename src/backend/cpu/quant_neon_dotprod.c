/* quant_neon_dotprod.c - the NEON kernels built for armv8.2-a+dotprod (the
 * Makefile adds the flag on arm64): qn_dot is one sdot instead of two
 * widening multiplies and two pairwise adds. */
#define QN_SET dotprod
#if defined(__ARM_FEATURE_DOTPROD)
#define QN_SET_OK 1
#else
#define QN_SET_OK 0   /* built without the flag (or not for arm64): an empty set */
#endif
#include "quant_neon.c"
