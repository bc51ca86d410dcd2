/* quant_avx512_parts.h - part of quant_avx2.c where it builds the avx512 set
 * (QA_ZMM): what its compile units share. The set is four units, along its
 * kernel families: quant_avx512.c (the pair tiles, Q4_1/Q5_1, the K-quant
 * tile, the float formats, activation quantization and the set itself),
 * quant_avx512_r16.c (the 16-row Q8_0 / Q4_0 / Q5_0 products,
 * quant_avx512_r16.h), quant_avx512_kp.c (the packed Q4_K / Q5_K walks and
 * the packed entry point, quant_avx512_kp.h) and quant_avx512_kp6.c (the
 * packed Q6_K walk, quant_avx512_kp6.h). As one unit it was the build's
 * critical path: clang with ASan+UBSan spent some 310 CPU-seconds on it (the
 * library's other objects 70), so a 2-core build waited on one core for it;
 * apart, the units compile side by side (Makefile, KSLOW). The same source
 * and flags: the same code, the calls between units not inlined (each is a
 * matrix, or a walk of 16 rows, which was out of line already).
 * Not a header of its own: it uses quant_avx2.c's helpers and includes. */

/* Fewer activation rows do not repay the gathering: the few-row tile, two
 * rows a pass, against it on Q8_0 keys (scratch program, 28 x 8 heads,
 * one thread of an AMD EPYC; 128-wide rows, 4096 keys): 4 rows 16.3 against
 * 58-60 ms, 8 rows 25.2-25.5 against 57.2-57.7; 1024 keys: 16 rows 10.4
 * against 14.2, 20 rows 12.7 against 13.9, 24 rows 14.4 against 15.0, 28
 * rows 16.6 against 14.9, 32 rows 18.4 against 14.1; 1024-wide rows, 128
 * keys: 4 rows 3.9 against 10.0, 16 rows 9.6 against 11.2. */
#define QA_R16_MIN 17

/* Four activation bytes to every lane, straight from memory (vpbroadcastd
 * m32): a memcpy to an int first made the compiler load 8 bytes, shift and
 * move each half from a general register (four instructions for one). */
QA_INLINE __m512i qa_bcast4(const int8_t *p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

/* ==== Entry points between the units ==== */
/* quant_avx512_r16.h: rows [0, nw16) (a multiple of 16) x na activation
 * rows, Q8_0 rows gathered into the packed layout (packed 0) or Q8_0 /
 * Q4_0 / Q5_0 rows packed already (packed 1); and the few-row Q8_0 walk
 * (na < QA_R16_MIN) */
void quant_avx512_mul_r16(uint32_t type, int64_t n, const uint8_t *w, size_t w_stride, int nw16, const void *a,
                          size_t a_stride, int na, float *out, size_t out_stride, int packed);
void quant_avx512_mul_r16_few(int64_t n, const uint8_t *w, size_t w_stride, int nw16, const void *a,
                              size_t a_stride, int na, float *out, size_t out_stride);
/* quant_avx512_kp.h: the set's mul_mat_tile_packed (quant_kernels.h) */
int quant_avx512_mul_packed(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride);
/* quant_avx512_kp6.h: RA (1-8) activation rows against one group of 16
 * packed Q6_K rows, out[r * os + i] (gn: the next group's distance, 0 for
 * no prefetch of it) */
void quant_avx512_walk_q6k(int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out, size_t os,
                           size_t gn);
