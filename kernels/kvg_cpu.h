/* kvguard CPU kernels: the functions one source file of the library calls in another
 * (lowbit.c: the GEMMs; cpu_ops.c: the step kernels; decode_layer.c strings them together).
 * Each defining file includes this too, so a definition that drifts from it fails to build. */
#ifndef KVG_CPU_H
#define KVG_CPU_H
#include <stdint.h>

/* A CPU-path switch (`kvg_vnni`, `kvg_amx`, `kvg_amx_bf16`, `kvg_attn512`,
 * `kvg_shared_prefix`): `*state` is -1 until first asked, then what `supported` says; on: 1
 * or 0 sets it (1 only where `supported`), -1 only reads. Returns the state before, or -2
 * when asked for a path this CPU lacks (nothing changed). */
static inline int kvg_switch(int *state, int (*supported)(void), int on) {
    if (*state < 0) *state = supported();
    const int before = *state;
    if (on == 1 && !supported()) return -2;
    if (on == 0 || on == 1) *state = on;
    return before;
}

int kvg_w4a8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
             const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
             int64_t ldo, int threads, int fine);
int kvg_w8a8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *codes,
             const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
             int64_t ldo, int threads, int fine);
int kvg_w4a8_rows(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                  const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
                  int64_t ldo, int threads, int fine, int64_t decode, int64_t count,
                  int64_t short_rows);
int kvg_w8a8_rows(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *codes,
                  const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
                  int64_t ldo, int threads, int fine, int64_t decode, int64_t count,
                  int64_t short_rows);
int kvg_pick_kernel(int bits, int fine, int64_t count, int prompt, int vnni, int bf16);
void kvg_pack4(const uint8_t *q, int64_t n, int64_t k, uint8_t *out, int threads);
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
int kvg_shared_prefix(int on);
int64_t kvg_shared_prefix_calls(void);
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
