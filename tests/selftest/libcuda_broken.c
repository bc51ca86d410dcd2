/* selftest: a libcuda.so.1 that is there but broken (a damaged or mismatched
 * NVIDIA driver install): every driver entry point cudart may look up first
 * fails with CUDA_ERROR_UNKNOWN. On a machine without a GPU, a CUDA build
 * run with this library on LD_LIBRARY_PATH must fail its start-up ("the
 * CUDA driver failed"), not report "no CUDA device" and skip. */
#define CU_UNKNOWN 999
int cuInit(unsigned flags) { (void)flags; return CU_UNKNOWN; }
int cuDriverGetVersion(int *v) { if (v) *v = 0; return CU_UNKNOWN; }
int cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) {
    (void)s; (void)v; (void)f; if (p) *p = 0; return CU_UNKNOWN; }
int cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, int *st) {
    (void)s; (void)v; (void)f; if (p) *p = 0; if (st) *st = 0; return CU_UNKNOWN; }
int cuGetExportTable(const void **t, const void *id) { (void)id; if (t) *t = 0; return CU_UNKNOWN; }
