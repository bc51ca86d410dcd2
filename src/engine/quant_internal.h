/* quant_internal.h - what the block-format files share (not part of their
 * interface: quant.h is; quant_kernels.h is the kernel sets'). The quant_
 * functions one file calls in another:
 *   quant.c           scalar conversions, block decoders, reference kernels
 *   quant_write.c     weight quantization for model files
 *   quant_dispatch.c  CPU features, walk prefetch, the kernel set in use
 *   quant_pack.c      the packed layouts and their product
 */

#ifndef TANDEM_ENGINE_QUANT_INTERNAL_H
#define TANDEM_ENGINE_QUANT_INTERNAL_H

#include "engine/quant.h"
#include "engine/quant_kernels.h"

/* ==== quant.c ==== */

/* Sub-blocks' 6-bit scales and mins packed into a K-quant's 12 bytes. */
void quant_put_scale_min_k4(uint8_t *q, const uint8_t *sc, const uint8_t *m);
/* The 256 levels of a Q6_K super-block, each 0..63. */
void quant_q6_K_levels(const block_q6_K *b, uint8_t lv[QK_K]);
/* Q8_0 activation blocks (llama.cpp's reference). */
void quant_ref_act_q8_0(const float *x, block_q8_0 *y, int64_t nb);

/* ==== quant_dispatch.c ==== */

/* The active kernel set (decided at first use). */
const quant_kset *quant_kset_get(void);

#endif /* TANDEM_ENGINE_QUANT_INTERNAL_H */
