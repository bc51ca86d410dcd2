/* quant_avx512.c - the AVX2 kernels built with AVX-512 F/BW/VL/DQ/VNNI (the
 * Makefile adds the flags): vpdpbusd, and the zmm kernels quant_avx2.c
 * enables under __AVX512F__. */
#define QA_SET avx512
#define QA_WANT_ZMM 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QA_SET_OK 1
#else
#define QA_SET_OK 0   /* built without the flags: an empty set */
#endif
#include "quant_avx2.c"
