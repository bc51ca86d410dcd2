/* backend_cuda.h - the CUDA implementation of backend.h (built with make CUDA=1).
 *
 * Weights are copied to the device once, at load (be_weight.dev); quantized
 * weights are dequantized there to F16 while device memory allows, else kept
 * in their GGUF blocks and dequantized per product. Matrix products of more
 * than a few rows go through cuBLAS (tensor cores); a few rows (decode) go
 * through a matrix-vector kernel that reads the weights once. KV caches live
 * on the device as mirrors of the host caches: each layer's new rows are
 * copied back to the host cache on a second stream (sync_kv), so the layer
 * hook streams exactly the bytes the CPU backend would have written.
 * See docs/architecture.md, "CUDA backend".
 */
#ifndef TANDEM_BACKEND_CUDA_H
#define TANDEM_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* backend_cuda_create is declared in engine/backend.h, beside the CPU
 * backend's constructor, so that the engine picks a backend without
 * including backend/. */

/* Seconds of one F16 x F16 -> F32 cublasGemmEx of m x n x k (f32
 * accumulation, tensor cores), the layout of the backend's own products:
 * the median of 7 after 2 warm-ups. tandem bench sets the model's
 * products against this ceiling. 0, or -1 with a message. */
int backend_cuda_gemm_seconds(backend *be, int m, int n, int k, double *seconds, char *err, size_t errlen);

/* Host versions of the device's block decoders and KV row encoders (the
 * same __host__ __device__ code), so the tests can check them bit for bit
 * against quant.c on machines without a GPU. */
void backend_cuda_host_dequantize_row(uint32_t type, const void *row, float *y, int64_t n);
void backend_cuda_host_kv_row(uint32_t dtype, const float *x, void *y, int64_t n);
/* The rope angles' cos/sin for one position, as the device computes them. */
void backend_cuda_host_rope_angles(int pos, const rope_cfg *rc, float *cs, float *sn);

#ifdef __cplusplus
}
#endif

#endif
