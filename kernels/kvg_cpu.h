/* kvguard CPU kernels: the functions one source file of the library calls in another
 * (lowbit.c: the GEMMs; cpu_ops.c: the step kernels; decode_layer.c strings them together).
 * Each defining file includes this too, so a definition that drifts from it fails to build. */
#ifndef KVG_CPU_H
#define KVG_CPU_H
#include <stdint.h>

int kvg_w4a8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
             const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
             int64_t ldo, int threads, int fine);
int kvg_w8a8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *codes,
             const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
             int64_t ldo, int threads, int fine);
void kvg_refine8v(float *logits, int64_t M, int64_t ldl, const float *h, int64_t K, int64_t ldh,
                  const int64_t *idx, int64_t k, const uint8_t *codes, const uint16_t *d,
                  const uint16_t *m, int64_t bpg, int threads);
int kvg_paged_decode(const float *q, int64_t ldq, float *out, const int64_t *rows,
                     const int32_t *lens, int64_t B, const void *k, const void *v,
                     const float *ks, const float *vs, int type, int64_t bs, int64_t hkv,
                     int64_t heads, int64_t d, const int32_t *tables, int64_t ldt, float scale,
                     int threads);
int kvg_paged_prefill(const float *q, int64_t ldq, float *out, const int64_t *qrow,
                      const int32_t *qlen, const int32_t *lens, int64_t S, const void *k,
                      const void *v, const float *ks, const float *vs, int type, int64_t bs,
                      int64_t hkv, int64_t heads, int64_t d, const int32_t *tables, int64_t ldt,
                      float scale, int threads);
int kvg_attn512(int on);
int kvg_write_kv(void *pool, float *scales, int type, const float *x, int64_t ldx,
                 const int64_t *slots, int64_t T, int64_t num_slots, int64_t bs, int64_t hkv,
                 int64_t d);
void kvg_rmsnorm(float *x, int64_t ldx, const float *y, int64_t T, int64_t d, const float *w,
                 float eps, float *out, int threads);
void kvg_rope(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t d, const float *cos_t,
              const float *sin_t, int threads);
void kvg_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ldx, int64_t *idx, int threads);
int kvg_topk_rows(const float *x, int64_t M, int64_t N, int64_t ldx, int64_t k, int64_t *idx,
                  int threads);
void kvg_silu_mul(const float *x, int64_t ldx, int64_t T, int64_t inter, float *out, int threads);

#endif
