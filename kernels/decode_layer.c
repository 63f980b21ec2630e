/* kvguard CPU step layer: one call for a whole decoder layer of a CPU step (decode rows,
 * prompt chunks, or both).
 *
 * On a 2-core CPU a batch-1 decode step of a 135M model spends more time between kernels
 * (Python, torch dispatch, a dozen small tensors a layer) than in them; a step with prompt
 * chunks paid the same 7 ms or so. This file strings the same kernels together in C: RMSNorm
 * (with the previous layer's MLP output added to the stream), the fused qkv projection, RoPE,
 * the K/V write into the pool (fp32, fp16, bf16, or fp8 with its per-block scales), paged
 * decode attention for the decode rows and paged prefill attention for the chunks, the output
 * projection and its residual add, the second RMSNorm, gate/up, SiLU and multiply, down. Each
 * piece is the very function the per-op path calls, in the same order, so the two paths give
 * the same bits. The layer's MLP output is left in `mlp_out` for the next layer's norm (or
 * the final norm) to add.
 */
#include <stdint.h>

#include "kvg_cpu.h"

/* One quantized projection as the GEMMs take it (`bias` may be NULL). */
typedef struct {
    int64_t bits, fine, n, k, bpg;
    const void *codes;
    const uint16_t *d, *m;
    const float *bias;
} KvgLinear;

/* A decoder layer's weights and shapes, built once. */
typedef struct {
    KvgLinear qkv, o, gate_up, down;
    const float *norm1, *norm2;
    float eps, scale;
    int64_t hidden, heads, kv_heads, head_dim, inter;
} KvgLayer;

/* One step: T rows, each a token of a sequence: B decode sequences of one row each and S
 * prompt chunks of several consecutive rows. `work` holds
 * T * (3*hidden + qkv.n + heads*head_dim + 3*inter) floats. */
typedef struct {
    int64_t T, block_size, ldt, num_slots; /* num_slots: the pools' blocks * block_size */
    const float *cos, *sin;  /* [T][head_dim] */
    const int64_t *slots;    /* [T] flat pool slot of each row's new token */
    int64_t B;               /* decode sequences */
    const int64_t *rows;     /* [B] the query row of each */
    const int32_t *lens;     /* [B] tokens cached after this step's write */
    const int32_t *tables;   /* [B][ldt] block tables */
    int64_t S;               /* prompt chunks */
    const int64_t *chunk_rows;  /* [S] the first query row of each */
    const int32_t *chunk_qlens; /* [S] its rows */
    const int32_t *chunk_lens;  /* [S] tokens cached after this step's write */
    const int32_t *chunk_tables; /* [S][chunk_ldt] block tables */
    int64_t chunk_ldt;
    float *work;
    int64_t threads;
    int64_t kv_type; /* the pools' element type: cpu_ops.c's KV_F32 .. KV_FP8 */
    /* The rows' kinds, as the projections pick their kernels (`kvg_pick_kernel`): with
     * `kinds` 1, rows [0, decode_rows) are decode rows picking by `decode_count` (the step's
     * decoding sequences), the next `short_rows` short prompts' rows and the rest prompt
     * rows; with 0, every projection picks by T. */
    int64_t kinds, decode_rows, decode_count, short_rows;
} KvgStep;

static int linear(const KvgLinear *w, const KvgStep *s, const float *x, int64_t T, int64_t ldx,
                  float *out, int threads) {
    const int64_t dr = s->kinds ? s->decode_rows : T, dc = s->kinds ? s->decode_count : T;
    const int64_t sr = s->kinds ? s->short_rows : 0;
    const int rc = w->bits == 4
        ? kvg_w4a8_rows(x, T, w->k, ldx, (const uint8_t *)w->codes, w->d, w->m, w->n, w->bpg,
                        out, w->n, threads, (int)w->fine, dr, dc, sr)
        : kvg_w8a8_rows(x, T, w->k, ldx, (const int8_t *)w->codes, w->d, w->m, w->n, w->bpg,
                        out, w->n, threads, (int)w->fine, dr, dc, sr);
    if (rc == 0 && w->bias)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < w->n; ++i)
                out[t * w->n + i] = out[t * w->n + i] + w->bias[i];
    return rc;
}

/* x [T][hidden] is the stream (updated in place: + pending, + attention); `pending` (may be
 * NULL) the previous layer's MLP output; the pools [blocks][block_size][kv_heads][d] of
 * `s->kv_type`, an fp8 pool with its scales [blocks][kv_heads] (else NULL).
 * Returns 0, -1 when a workspace could not be allocated, -2 on a shape a kernel refuses, -3
 * on a slot outside the pool. */
int kvg_decode_layer(const KvgLayer *L, const KvgStep *s, float *x, const float *pending,
                     void *k_pool, void *v_pool, float *k_scales, float *v_scales,
                     float *mlp_out) {
    const int64_t T = s->T, H = L->hidden, d = L->head_dim, nq = L->heads * d;
    const int64_t nkv = L->kv_heads * d, nqkv = L->qkv.n;
    const int threads = (int)s->threads;
    float *h = s->work, *qkv = h + T * H, *attn = qkv + T * nqkv, *o = attn + T * nq;
    float *h2 = o + T * H, *gu = h2 + T * H, *act = gu + T * 2 * L->inter;
    int rc;
    for (int64_t t = 0; t < T; ++t)
        if (s->slots[t] < 0 || s->slots[t] >= s->num_slots)
            return -3; /* a slot outside the pool: refuse before writing anything */
    kvg_rmsnorm(x, H, pending, T, H, L->norm1, L->eps, h, threads);
    if ((rc = linear(&L->qkv, s, h, T, H, qkv, threads)))
        return rc;
    kvg_rope(qkv, nqkv, T, L->heads + L->kv_heads, d, s->cos, s->sin, threads);
    const int type = (int)s->kv_type;
    if ((rc = kvg_write_kv(k_pool, k_scales, type, qkv + nq, nqkv, s->slots, T, s->num_slots,
                           s->block_size, L->kv_heads, d)) ||
        (rc = kvg_write_kv(v_pool, v_scales, type, qkv + nq + nkv, nqkv, s->slots, T,
                           s->num_slots, s->block_size, L->kv_heads, d)))
        return rc == 1 ? -2 : rc;
    if (s->B && (rc = kvg_paged_decode(qkv, nqkv, attn, s->rows, s->lens, s->B, k_pool, v_pool,
                                       k_scales, v_scales, type, s->block_size, L->kv_heads,
                                       L->heads, d, s->tables, s->ldt, L->scale, threads)))
        return rc;
    if (s->S && (rc = kvg_paged_prefill(qkv, nqkv, attn, s->chunk_rows, s->chunk_qlens,
                                        s->chunk_lens, s->S, k_pool, v_pool, k_scales, v_scales,
                                        type, s->block_size, L->kv_heads, L->heads, d,
                                        s->chunk_tables, s->chunk_ldt, L->scale, threads)))
        return rc == 1 ? -2 : rc;
    if ((rc = linear(&L->o, s, attn, T, nq, o, threads)))
        return rc;
    kvg_rmsnorm(x, H, o, T, H, L->norm2, L->eps, h2, threads);
    if ((rc = linear(&L->gate_up, s, h2, T, H, gu, threads)))
        return rc;
    kvg_silu_mul(gu, 2 * L->inter, T, L->inter, act, threads);
    return linear(&L->down, s, act, T, L->inter, mlp_out, threads);
}
