/* quant_avxvnni.c - the AVX2 kernels built with AVX-VNNI (the Makefile adds
 * -mavxvnni): vpdpbusd on ymm registers for CPUs that have it without
 * AVX-512 (Alder Lake and later clients). */
#define QA_SET avxvnni
#if defined(__AVXVNNI__)
#define QA_SET_OK 1
#else
#define QA_SET_OK 0   /* built without the flags: an empty set */
#endif
#include "quant_avx2.c"
