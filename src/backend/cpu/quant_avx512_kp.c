/* quant_avx512_kp.c - a compile unit of the avx512 set (quant_avx512.c's
 * flags, quant_avx512_parts.h): the packed Q4_K / Q5_K walks and the packed
 * entry point (quant_avx512_kp.h; the Q6_K walk: quant_avx512_kp6.c), built from quant_avx2.c's helpers. */
#define QA_SET avx512
#define QA_WANT_ZMM 1
#define QA_ONLY "quant_avx512_kp.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QA_SET_OK 1
#else
#define QA_SET_OK 0   /* built without the flags: nothing */
#endif
#include "quant_avx2.c"
