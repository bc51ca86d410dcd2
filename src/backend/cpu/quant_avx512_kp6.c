/* quant_avx512_kp6.c - a compile unit of the avx512 set (quant_avx512.c's
 * flags, quant_avx512_parts.h): the packed Q6_K walk (quant_avx512_kp6.h),
 * built from quant_avx2.c's helpers and quant_avx512_kp.h's constants. */
#define QA_SET avx512
#define QA_WANT_ZMM 1
#define QA_ONLY "quant_avx512_kp.h"
#define QA_KP6 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QA_SET_OK 1
#else
#define QA_SET_OK 0   /* built without the flags: nothing */
#endif
#include "quant_avx2.c"
