/* kvguard CPU step kernels (AVX2; prefill attention also in AVX-512 where the CPU has it):
 * paged decode and prefill attention, RMSNorm with the residual add, RoPE.
 *
 * A decode step on CPU is one row per sequence, so each torch op around the projections costs
 * more in dispatch than in arithmetic, and the torch attention path first gathers every
 * sequence's K/V blocks into a contiguous copy. These kernels read the paged pool in place and
 * replace a dozen ops per layer with one call each. fp32 activations only.
 *
 * SiLU-and-multiply: the gated MLP's silu(gate) * up from the fused [gate | up] projection,
 * one call instead of a split, a silu and a multiply.
 *
 * KV write: a step's K or V rows into the pool in its element type, fp8 with the per-block
 * scales grown (and the block requantised) exactly as the torch write does; the decode fast
 * path's write on every pool, and the per-op path's on fp8 pools.
 *
 * Paged decode attention: one query token per sequence; pools [blocks][block_size][kv_heads][d]
 * in fp32, fp16, bf16 or fp8 e4m3 (with one fp32 scale per block and KV head). A work item is
 * (sequence, split of its tokens), every head: a block of tokens at a time, and in it each KV
 * head's query heads (one running max per query head, rescaled once per block), so a block's
 * rows are read whole while the next block's are prefetched; with fewer items than threads x 4
 * a long sequence is split into runs whose partial softmax sums are merged at the end (the
 * split-K of flash decoding). Sequences whose tables begin with the same blocks (a prefix-cache
 * hit) read those blocks once, their queries taken together (`decode_shared`).
 *
 * Paged prefill attention: the prompt chunks of a step, causal, over the same pools, in one call
 * for all of them (torch's attention needed each chunk's K/V gathered and a mask built). A work
 * item is sixteen query positions of one chunk with every head (with one KV head's where items
 * would be too few for the threads); its queries are held transposed, eight to a vector, so
 * scores, softmax and output are vectorised across queries, and blocks no query of the item
 * can see are never read.
 */
#pragma GCC optimize("fp-contract=off") /* RoPE and RMSNorm round like torch's mul-then-add */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvg_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_FP8 = 3 };
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

int kvg_ops_abi(void) { return 1; }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int64_t elem_size(int type) { return type == KV_F32 ? 4 : type == KV_FP8 ? 1 : 2; }

typedef struct {
    const float *q;
    int64_t ldq;
    const void *k, *v;
    const float *ks, *vs;
    int type;
    int64_t bs, hkv, d, g;
    const int32_t *tables;
    int64_t ldt;
    float scale;
} Attn;

/* Eight vectors to one: lane r holds the sum of c[r]'s lanes. */
static inline __m256 reduce8(const __m256 *c) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(c[0], c[1]), _mm256_hadd_ps(c[2], c[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(c[4], c[5]), _mm256_hadd_ps(c[6], c[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* e^x for eight floats: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor
 * polynomial (relative error ~2e-7), 2^n built in the exponent bits; -inf and very negative
 * x give 0, a NaN gives NaN. The clamp takes x as the second operand: maxps/minps return
 * their second operand where either is NaN, so a NaN passes through it (x first turned a NaN
 * score into e^-87, a finite weight, where torch's softmax gives NaN); finite x clamp alike
 * either way. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 split in two */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Eight e4m3fn values as fp32 without a table: the sign-extended byte shifted so its exponent
 * and mantissa bits land on fp32's low exponent and high mantissa bits (bits 20-26) and its sign
 * on bit 31 gives the value times 2^-120 (subnormals included, as fp32 subnormals), then one
 * exact multiply by 2^120; 0x7f/0xff are NaN, as torch reads them. Subnormals need torch's
 * default of denormals kept: under torch.set_flush_denormal(True) they would read as zero. */
static inline __m256 fp8x8(const uint8_t *p) {
    const __m256i b = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), 20);
    const __m256i body = _mm256_and_si256(b, _mm256_set1_epi32(0x07f00000));
    const __m256i nan = _mm256_cmpeq_epi32(body, _mm256_set1_epi32(0x07f00000));
    const __m256i w = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((int)0x87f00000u)), nan);
    return _mm256_mul_ps(_mm256_castsi256_ps(w), _mm256_set1_ps(0x1p120f));
}

/* `n` consecutive token rows of one KV head from element `row0` of `pool`, as fp32: the pool
 * itself for an fp32 pool (rows `*stride` floats apart), else converted into `scratch` (one
 * switch a block, the conversion inline: this runs for every cached token of every layer). */
static const float *block_rows(const Attn *a, const void *pool, int64_t row0, int64_t n,
                               float *scratch, int64_t *stride) {
    const int64_t step = a->hkv * a->d, d = a->d;
    if (a->type == KV_F32) {
        *stride = step;
        return (const float *)pool + row0;
    }
    *stride = d;
    if (a->type == KV_FP8) {
        const uint8_t *p = (const uint8_t *)pool + row0;
        for (int64_t u = 0; u < n; ++u)
            for (int64_t i = 0; i < d; i += 8)
                _mm256_storeu_ps(scratch + u * d + i, fp8x8(p + u * step + i));
    } else if (a->type == KV_F16) {
        const uint16_t *p = (const uint16_t *)pool + row0;
        for (int64_t u = 0; u < n; ++u)
            for (int64_t i = 0; i < d; i += 8)
                _mm256_storeu_ps(scratch + u * d + i,
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + u * step + i))));
    } else {
        const uint16_t *p = (const uint16_t *)pool + row0;
        for (int64_t u = 0; u < n; ++u)
            for (int64_t i = 0; i < d; i += 8) {
                const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + u * step + i)));
                _mm256_storeu_ps(scratch + u * d + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
    }
    return scratch;
}

/* KV head h's K and V rows of the first n tokens of block `blk` as fp32 (the pool itself, or
 * converted into kb and vb), with the block's scales. */
typedef struct {
    const float *k, *v;
    int64_t kstep, vstep; /* floats between rows */
    float ksc, vsc;
} HeadRows;

static inline HeadRows head_rows(const Attn *a, int64_t blk, int64_t h, int64_t n, float *kb,
                                 float *vb) {
    const int64_t row0 = (blk * a->bs * a->hkv + h) * a->d;
    HeadRows r;
    r.k = block_rows(a, a->k, row0, n, kb, &r.kstep);
    r.v = block_rows(a, a->v, row0, n, vb, &r.vstep);
    r.ksc = a->ks ? a->ks[blk * a->hkv + h] : 1.0f;
    r.vsc = a->vs ? a->vs[blk * a->hkv + h] : 1.0f;
    return r;
}

/* The K and V rows of the block after tokens [t, t + n) of a run ending at t1, prefetched
 * into L2 while this block computes (faster than into L1 here, 55 against 61 ms for a step's
 * 30 layers on one core; two to six blocks ahead gained nothing more). */
static inline void prefetch_next(const Attn *a, const int32_t *table, int64_t t, int64_t n,
                                 int64_t t1) {
    if (t + n >= t1)
        return;
    const int64_t bs = a->bs, row_bytes = a->hkv * a->d * elem_size(a->type);
    const int64_t bytes = (t1 - t - n < bs ? t1 - t - n : bs) * row_bytes;
    const char *kp = (const char *)a->k + table[(t + n) / bs] * bs * row_bytes;
    const char *vp = (const char *)a->v + table[(t + n) / bs] * bs * row_bytes;
    for (int64_t i = 0; i < bytes; i += 64) {
        _mm_prefetch(kp + i, _MM_HINT_T1);
        _mm_prefetch(vp + i, _MM_HINT_T1);
    }
}

/* Tokens [t0, t1) of one sequence, every query head: running max m[hq], sum l[hq] and
 * unnormalised output acc[hq][d] of query head hq = h * g + j (KV head h), `qs` [heads][d] a
 * workspace. A block of the table at a time, and in it each KV head in turn: the scores of the
 * block's tokens against that head's g query heads, one max update per query head, then each
 * 8-wide slice of the output accumulated in a register over the block's tokens (V rows stay in
 * L1 for the g heads). A block's K and V rows are thus read whole and in order, and the next
 * block's are prefetched (`prefetch_next`). Items of one KV head
 * each read 1/hkv of every token's row: that pattern streamed from DRAM at a third of the
 * rate of whole rows (measured on a Zen 4 core: 7 vs 24 GB/s). */
static void attend_run(const Attn *a, const float *qrow, const int32_t *table, int64_t t0,
                       int64_t t1, float *m, float *l, float *acc, float *qs) {
    const int64_t d = a->d, g = a->g, bs = a->bs, hkv = a->hkv;
    const int64_t heads = hkv * g;
    float kb[MAX_BLOCK * MAX_DIM], vb[MAX_BLOCK * MAX_DIM]; /* a non-fp32 block as fp32 */
    float s[MAX_GROUP][MAX_BLOCK + 8];
    for (int64_t j = 0; j < heads; ++j) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        for (int64_t i = 0; i < d; ++i) {
            qs[j * d + i] = qrow[j * d + i] * a->scale;
            acc[j * d + i] = 0.0f;
        }
    }
    for (int64_t t = t0; t < t1;) {
        const int64_t blk = table[t / bs], off = t % bs;
        const int64_t n = (t1 - t < bs - off) ? t1 - t : bs - off;
        prefetch_next(a, table, t, n, t1);
        for (int64_t h = 0; h < hkv; ++h) {
            /* KV head h's g query heads: their queries, maxes, sums and outputs */
            const float *qh = qs + h * g * d;
            float *mh = m + h * g, *lh = l + h * g, *acch = acc + h * g * d;
            const float ksc = a->ks ? a->ks[blk * hkv + h] : 1.0f;
            const float vsc = a->vs ? a->vs[blk * hkv + h] : 1.0f;
            const int64_t row0 = ((blk * bs + off) * hkv + h) * d; /* element index of token t */
            int64_t kstep; /* K rows of the block's tokens, `kstep` floats apart */
            const float *kr = block_rows(a, a->k, row0, n, kb, &kstep);
            const __m256 kscv = _mm256_set1_ps(ksc);
            for (int64_t j = 0; j < g; ++j) {
                const float *qj = qh + j * d;
                int64_t u = 0;
                for (; u + 8 <= n; u += 8) { /* eight tokens' dots, reduced together */
                    __m256 c[8];
                    for (int r = 0; r < 8; ++r)
                        c[r] = _mm256_setzero_ps();
                    for (int64_t i = 0; i < d; i += 8) {
                        const __m256 qv = _mm256_loadu_ps(qj + i);
                        for (int r = 0; r < 8; ++r)
                            c[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + (u + r) * kstep + i), c[r]);
                    }
                    _mm256_storeu_ps(&s[j][u], _mm256_mul_ps(reduce8(c), kscv));
                }
                for (; u < n; ++u) {
                    __m256 c = _mm256_setzero_ps();
                    for (int64_t i = 0; i < d; i += 8)
                        c = _mm256_fmadd_ps(_mm256_loadu_ps(qj + i), _mm256_loadu_ps(kr + u * kstep + i), c);
                    s[j][u] = hsum8(c) * ksc;
                }
            }
            for (int64_t j = 0; j < g; ++j) {
                float mx = mh[j];
                /* a NaN score is passed over here but not lost: its exp8 is NaN, and so are the
                 * sum and every output component it reaches, as in torch's softmax */
                for (int64_t u = 0; u < n; ++u)
                    mx = s[j][u] > mx ? s[j][u] : mx;
                const float c = expf(mh[j] - mx); /* 0 on the first block (m = -inf) */
                const __m256 mv = _mm256_set1_ps(mx);
                __m256 sum = _mm256_setzero_ps();
                for (int64_t u = 0; u < n; u += 8) {
                    const int64_t left = n - u;
                    __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(&s[j][u]), mv));
                    if (left < 8) { /* lanes past the block's end count nothing */
                        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), lane);
                        p = _mm256_and_ps(p, _mm256_castsi256_ps(keep));
                    }
                    sum = _mm256_add_ps(sum, p);
                    _mm256_storeu_ps(&s[j][u], _mm256_mul_ps(p, _mm256_set1_ps(vsc)));
                }
                lh[j] = lh[j] * c + hsum8(sum);
                mh[j] = mx;
                if (c != 1.0f) {
                    const __m256 cv = _mm256_set1_ps(c);
                    for (int64_t i = 0; i < d; i += 8)
                        _mm256_storeu_ps(acch + j * d + i, _mm256_mul_ps(_mm256_loadu_ps(acch + j * d + i), cv));
                }
            }
            int64_t vstep;
            const float *vr = block_rows(a, a->v, row0, n, vb, &vstep);
            for (int64_t j = 0; j < g; ++j) {
                int64_t i = 0;
                /* 64 outputs at a time in eight registers, tokens outer: eight independent FMA
                 * chains, where one slice at a time waited on its own FMA's latency per token
                 * (each slice still sums its tokens in the same order: the same bits) */
                for (; i + 64 <= d; i += 64) {
                    __m256 o[8];
                    for (int r = 0; r < 8; ++r)
                        o[r] = _mm256_loadu_ps(acch + j * d + i + 8 * r);
                    for (int64_t u = 0; u < n; ++u) {
                        const __m256 p = _mm256_set1_ps(s[j][u]);
                        for (int r = 0; r < 8; ++r)
                            o[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + u * vstep + i + 8 * r), o[r]);
                    }
                    for (int r = 0; r < 8; ++r)
                        _mm256_storeu_ps(acch + j * d + i + 8 * r, o[r]);
                }
                for (; i < d; i += 8) {
                    __m256 o = _mm256_loadu_ps(acch + j * d + i);
                    for (int64_t u = 0; u < n; ++u)
                        o = _mm256_fmadd_ps(_mm256_set1_ps(s[j][u]), _mm256_loadu_ps(vr + u * vstep + i), o);
                    _mm256_storeu_ps(acch + j * d + i, o);
                }
            }
        }
        t += n;
    }
}

/* One sequence's output from its `n` partials (consecutive, each acc [heads][d], m [heads],
 * l [heads]), each weighted by l * e^(m - max m); an empty one (l == 0) counts nothing. */
static void merge_parts(const float *part, int64_t n, int64_t heads, int64_t d, float *o) {
    const int64_t per = heads * d + 2 * heads;
    for (int64_t j = 0; j < heads; ++j) {
        float mx = -INFINITY;
        for (int64_t sp = 0; sp < n; ++sp) {
            const float mj = part[sp * per + heads * d + j];
            mx = mj > mx ? mj : mx;
        }
        float l = 0.0f;
        for (int64_t i = 0; i < d; ++i)
            o[j * d + i] = 0.0f;
        for (int64_t sp = 0; sp < n; ++sp) {
            const float *p = part + sp * per;
            if (p[heads * d + heads + j] == 0.0f) /* an empty run */
                continue;
            const float c = expf(p[heads * d + j] - mx);
            l += p[heads * d + heads + j] * c;
            for (int64_t i = 0; i < d; ++i)
                o[j * d + i] += p[j * d + i] * c;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t i = 0; i < d; ++i)
            o[j * d + i] *= inv;
    }
}

/* Whether decode row b continues row b - 1's sequence: a verify step's rows (a last token and
 * its drafts) and a grammar's forced rows are one sequence's rows, laid out together, each
 * with the sequence's block table and one token more than the row before. Two sequences'
 * rows look so only where their tables hold the same ids up to the later row's last token,
 * whose block is that sequence's own: only a padding id can make them meet, and then they
 * merely attend alone. */
static int continues(const Attn *a, const int32_t *lens, int64_t b) {
    if (b < 1 || lens[b] != lens[b - 1] + 1)
        return 0;
    int64_t n = (lens[b] + a->bs - 1) / a->bs;
    n = n < a->ldt ? n : a->ldt;
    const int32_t *prev = a->tables + (b - 1) * a->ldt, *own = a->tables + b * a->ldt;
    return memcmp(prev, own, sizeof(int32_t) * (size_t)n) == 0;
}

/* The runs a row of `len` tokens is split into (of at least 4 blocks) until the step's `nseq`
 * sequences have work for every thread: from its own length and the sequence count (a
 * sequence's several rows counting once) only, so each of a sequence's verify rows is split
 * as a one-token step at its length is, the same bits (the step's longest row and row count
 * decided it before). */
static int64_t runs_of(int64_t len, int64_t nseq, int64_t bs, int threads) {
    int64_t split = 1;
    while (nseq * split < 4 * (int64_t)threads && len / (split * 2) >= 4 * bs)
        split *= 2;
    return split;
}

/* Decode attention with every sequence on its own: a work item is a row, or a run of its
 * tokens (split-K) where items would be too few for the threads. */
static int decode_each(const Attn *ap, float *out, const int64_t *rows, const int32_t *lens,
                       int64_t B, int64_t nseq, int threads) {
    const Attn a = *ap;
    const float *q = a.q;
    const int64_t ldq = a.ldq, ldt = a.ldt, bs = a.bs, d = a.d, heads = a.hkv * a.g;
    const int32_t *tables = a.tables;
    if (threads < 1)
        threads = 1;
    const int64_t per = heads * d + 2 * heads; /* one run's partial: acc, then m, then l */
    /* each row's first item (B + 1), then each item's row; rows of one run write no partial */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!first)
        return -1;
    first[0] = 0;
    for (int64_t b = 0; b < B; ++b)
        first[b + 1] = first[b] + runs_of(lens[b], nseq, bs, threads);
    const int64_t items = first[B];
    /* per thread: the scaled queries, and the partial of a run that needs no merge */
    float *ws = malloc(sizeof(float) * (size_t)threads * (heads * d + per));
    int64_t *row_of = malloc(sizeof(int64_t) * (size_t)(items + 1));
    float *part = items > B ? malloc(sizeof(float) * (size_t)(items * per)) : NULL;
    if (!ws || !row_of || (items > B && !part)) {
        free(first), free(ws), free(row_of), free(part);
        return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t it = first[b]; it < first[b + 1]; ++it)
            row_of[it] = b;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = row_of[it], sp = it - first[b], split = first[b + 1] - first[b];
        const int64_t len = lens[b], chunk = (len + split - 1) / split;
        const int64_t t0 = sp * chunk < len ? sp * chunk : len;
        const int64_t t1 = t0 + chunk < len ? t0 + chunk : len;
        int self = 0;
#ifdef _OPENMP
        self = omp_get_thread_num();
#endif
        float *qs = ws + self * (heads * d + per);
        float *acc = split > 1 ? part + it * per : qs + heads * d;
        float *m = acc + heads * d, *l = m + heads;
        attend_run(&a, q + rows[b] * ldq, tables + b * ldt, t0, t1, m, l, acc, qs);
        if (split > 1)
            continue;
        float *o = out + rows[b] * heads * d;
        for (int64_t j = 0; j < heads; ++j) {
            const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
            for (int64_t i = 0; i < d; ++i)
                o[j * d + i] = acc[j * d + i] * inv;
        }
    }
    if (part) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t b = 0; b < B; ++b)
            if (first[b + 1] - first[b] > 1)
                merge_parts(part + first[b] * per, first[b + 1] - first[b], heads, d,
                            out + rows[b] * heads * d);
    }
    free(first), free(row_of), free(part), free(ws);
    return 0;
}

/* ---- Paged prefill attention: the queries of prompt chunks, causal, over the paged pool ---- */

#define PQ 16 /* query positions an item holds: two lane groups of eight */

/* Scores of two lane groups (16 queries, held transposed: qt[i * 16 + lane]) against tokens
 * [t, t + n) of a block (K rows `kstep` floats apart): s[2u + g] holds token t+u's score for
 * group g's eight queries. One broadcast K element feeds both groups, four tokens at a time
 * (eight FMA chains). Lane q is the query at position pos0 + q; token t+u is hidden from it
 * where t + u > pos0 + q (causal), its score -inf. */
static inline void prefill_scores(const float *qt, const float *kr, int64_t kstep, int64_t n,
                                  int64_t d, int64_t t, int64_t pos0, float ksc, __m256 *s) {
    const __m256 kscv = _mm256_set1_ps(ksc);
    int64_t u = 0;
    for (; u + 4 <= n; u += 4) {
        __m256 c[4][2];
        for (int r = 0; r < 4; ++r)
            c[r][0] = c[r][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
            const __m256 q0 = _mm256_loadu_ps(qt + i * PQ), q1 = _mm256_loadu_ps(qt + i * PQ + 8);
            for (int r = 0; r < 4; ++r) {
                const __m256 kv = _mm256_broadcast_ss(kr + (u + r) * kstep + i);
                c[r][0] = _mm256_fmadd_ps(kv, q0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(kv, q1, c[r][1]);
            }
        }
        for (int r = 0; r < 4; ++r) {
            s[2 * (u + r)] = _mm256_mul_ps(c[r][0], kscv);
            s[2 * (u + r) + 1] = _mm256_mul_ps(c[r][1], kscv);
        }
    }
    for (; u < n; ++u) {
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
            const __m256 kv = _mm256_broadcast_ss(kr + u * kstep + i);
            c0 = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qt + i * PQ), c0);
            c1 = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qt + i * PQ + 8), c1);
        }
        s[2 * u] = _mm256_mul_ps(c0, kscv);
        s[2 * u + 1] = _mm256_mul_ps(c1, kscv);
    }
    if (t + n - 1 > pos0) { /* the block reaches past the first query: hide the future */
        const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), ninf = _mm256_set1_ps(-INFINITY);
        for (u = 0; u < n; ++u)
            for (int g = 0; g < 2; ++g) {
                const __m256 lim = _mm256_set1_ps((float)(t + u - pos0 - 8 * g));
                s[2 * u + g] = _mm256_blendv_ps(ninf, s[2 * u + g], _mm256_cmp_ps(lane, lim, _CMP_GE_OQ));
            }
    }
}

/* Eight rows of eight floats (rows `ld` apart) transposed: t[i] holds column i. */
static inline void transpose8(const float *x, int64_t ld, __m256 *t) {
    __m256 r[8], u[8], v[8];
    for (int i = 0; i < 8; ++i)
        r[i] = _mm256_loadu_ps(x + i * ld);
    for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        v[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
        v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xee);
        v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
        v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x31);
    }
}

/* One query head's rows of the item (nq <= 16 of them, `ldq` apart, d components each) into
 * qt[i * 16 + lane], times `scale`; lanes past nq are zero. */
static void transpose_in(const float *q, int64_t ldq, int64_t nq, int64_t d, float scale,
                         float *qt) {
    float pad[8 * MAX_DIM];
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t g8 = 0; g8 < PQ; g8 += 8) {
        const int64_t rows = nq - g8 < 0 ? 0 : nq - g8 < 8 ? nq - g8 : 8;
        const float *src = q + g8 * ldq;
        int64_t ld = ldq;
        if (rows < 8) { /* a short group: its rows padded with zeros */
            memset(pad, 0, sizeof(float) * 8 * d);
            for (int64_t r = 0; r < rows; ++r)
                memcpy(pad + r * d, q + (g8 + r) * ldq, sizeof(float) * d);
            src = pad;
            ld = d;
        }
        for (int64_t i = 0; i < d; i += 8) {
            __m256 t[8];
            transpose8(src + i, ld, t);
            for (int c = 0; c < 8; ++c)
                _mm256_storeu_ps(qt + (i + c) * PQ + g8, _mm256_mul_ps(t[c], sc));
        }
    }
}

/* The item's output of one query head back to rows: row r (of nq, `ldo` apart) gets
 * ot[i * 16 + r] / l[r]. */
static void transpose_out(const float *ot, const float *l, int64_t nq, int64_t d, float *o,
                          int64_t ldo) {
    float pad[8 * MAX_DIM];
    for (int64_t g8 = 0; g8 < nq; g8 += 8) {
        const int64_t rows = nq - g8 < 8 ? nq - g8 : 8;
        const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_loadu_ps(l + g8));
        float *dst = rows < 8 ? pad : o + g8 * ldo;
        const int64_t ld = rows < 8 ? d : ldo;
        for (int64_t i = 0; i < d; i += 8) {
            __m256 t[8]; /* ot's rows i..i+7, lanes g8..g8+7, scaled, then transposed */
            float tmp[64];
            for (int c = 0; c < 8; ++c)
                _mm256_storeu_ps(tmp + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ot + (i + c) * PQ + g8), inv));
            transpose8(tmp, 8, t);
            for (int r = 0; r < 8; ++r)
                _mm256_storeu_ps(dst + r * ld + i, t[r]);
        }
        if (rows < 8)
            for (int64_t r = 0; r < rows; ++r)
                memcpy(o + (g8 + r) * ldo, pad + r * d, sizeof(float) * d);
    }
}

/* An item's start: its query heads of KV heads [h0, h1) transposed into qt (times the scale),
 * their running maxes at -inf and sums and outputs at 0. */
static void prefill_begin(const Attn *a, const float *q, int64_t ldq, int64_t nq, int64_t h0,
                          int64_t h1, float *qt, float *ot, float *ml) {
    const int64_t d = a->d, g = a->g;
    for (int64_t j = h0 * g; j < h1 * g; ++j) {
        transpose_in(q + j * d, ldq, nq, d, a->scale, qt + j * d * PQ);
        for (int64_t r = 0; r < PQ; ++r) {
            ml[j * 2 * PQ + r] = -INFINITY;
            ml[j * 2 * PQ + PQ + r] = 0.0f;
        }
    }
    memset(ot + h0 * g * d * PQ, 0, sizeof(float) * (h1 - h0) * g * d * PQ);
}

/* An item's end: each query head's outputs divided by its sum, back to rows of o. */
static void prefill_end(const Attn *a, int64_t nq, int64_t h0, int64_t h1, const float *ot,
                        const float *ml, float *o, int64_t ldo) {
    const int64_t d = a->d, g = a->g;
    for (int64_t j = h0 * g; j < h1 * g; ++j)
        transpose_out(ot + j * d * PQ, ml + j * 2 * PQ + PQ, nq, d, o + j * d, ldo);
}

/* Sixteen query lanes' running state after a block's scores s (as `prefill_scores` leaves
 * them, n tokens): the lanes' maxes mj[0..16) and sums mj[16..32) updated, the outputs ot
 * (held transposed, ot[i * 16 + lane]) rescaled and the block's V rows (`vstep` floats apart,
 * times `vsc`) added with the new weights. */
static inline void lanes_update(__m256 *s, int64_t n, const float *vr, int64_t vstep, int64_t d,
                                __m256 vsc, float *otj, float *mj) {
    __m256 c[2];
    for (int gi = 0; gi < 2; ++gi) {
        /* token 0 is seen by every query: after the first block each max is finite */
        const __m256 m0 = _mm256_loadu_ps(mj + 8 * gi);
        __m256 mx = m0;
        /* a NaN score may or may not end up in the max (maxps keeps its second operand's NaN
         * only); either way the lane's sum and outputs turn NaN: a NaN max makes every exp8
         * NaN, a finite one that score's */
        for (int64_t u = 0; u < n; ++u)
            mx = _mm256_max_ps(mx, s[2 * u + gi]);
        c[gi] = exp8(_mm256_sub_ps(m0, mx)); /* 0 on the first block */
        __m256 sum = _mm256_setzero_ps();
        for (int64_t u = 0; u < n; ++u) {
            const __m256 p = exp8(_mm256_sub_ps(s[2 * u + gi], mx));
            sum = _mm256_add_ps(sum, p);
            s[2 * u + gi] = _mm256_mul_ps(p, vsc);
        }
        _mm256_storeu_ps(mj + 8 * gi, mx);
        _mm256_storeu_ps(mj + PQ + 8 * gi, _mm256_fmadd_ps(_mm256_loadu_ps(mj + PQ + 8 * gi), c[gi], sum));
    }
    /* four output components of both groups at a time in registers, tokens inner */
    for (int64_t i = 0; i < d; i += 4) {
        __m256 acc[4][2];
        for (int r = 0; r < 4; ++r) {
            acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(otj + (i + r) * PQ), c[0]);
            acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(otj + (i + r) * PQ + 8), c[1]);
        }
        for (int64_t u = 0; u < n; ++u) {
            const float *vu = vr + u * vstep + i;
            const __m256 p0 = s[2 * u], p1 = s[2 * u + 1];
            for (int r = 0; r < 4; ++r) {
                const __m256 vv = _mm256_broadcast_ss(vu + r);
                acc[r][0] = _mm256_fmadd_ps(vv, p0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(vv, p1, acc[r][1]);
            }
        }
        for (int r = 0; r < 4; ++r) {
            _mm256_storeu_ps(otj + (i + r) * PQ, acc[r][0]);
            _mm256_storeu_ps(otj + (i + r) * PQ + 8, acc[r][1]);
        }
    }
}

/* One set of sixteen query lanes (held transposed in qt; lane q at position pos0 + q, causal)
 * over a block's n tokens from t for one KV head: scores, then the running state. */
static void lanes_block(const float *qt, const float *kr, int64_t kstep, const float *vr,
                        int64_t vstep, int64_t n, int64_t d, int64_t t, int64_t pos0, float ksc,
                        float vsc, float *otj, float *mj) {
    __m256 s[2 * MAX_BLOCK];
    prefill_scores(qt, kr, kstep, n, d, t, pos0, ksc, s);
    lanes_update(s, n, vr, vstep, d, _mm256_set1_ps(vsc), otj, mj);
}

/* lanes_block, or its 512-bit copy (`lanes_block512`, same bits) where `kvg_attn512` is on */
typedef void (*LanesFn)(const float *, const float *, int64_t, const float *, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float, float, float *, float *);
#define A512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static A512_FN void lanes_block512(const float *qt, const float *kr, int64_t kstep,
                                   const float *vr, int64_t vstep, int64_t n, int64_t d, int64_t t,
                                   int64_t pos0, float ksc, float vscf, float *otj, float *mj);
static LanesFn lanes_fn(void);

/* One work item: every query head at the nq (<= 16) query positions pos0.. of one sequence,
 * whose query rows start at q (row stride ldq) and output rows at o (row stride ldo). It
 * attends tokens [0, pos0 + nq) a block at a time, and in a block each KV head in turn (a
 * block's rows are read whole, as in decode); per query head a running max, sum and output
 * (held transposed, ot[i * 16 + lane]) as in flash attention. Every FMA takes a broadcast K or
 * V element into two vectors of eight queries: one broadcast per two FMAs, where eight
 * queries an item took one per FMA (1.1-1.4x the speed, 2 Zen 4 cores). ws:
 * (2 * heads * d + 2 * heads) * 16 floats. */
static void prefill_item(const Attn *a, const float *q, int64_t ldq, float *o, int64_t ldo,
                         int64_t nq, int64_t pos0, const int32_t *table, int64_t h0, int64_t h1,
                         float *ws, LanesFn lanes) {
    const int64_t d = a->d, g = a->g, bs = a->bs, hkv = a->hkv, heads = hkv * g, end = pos0 + nq;
    float *qt = ws, *ot = qt + heads * d * PQ, *ml = ot + heads * d * PQ; /* ml: max, then sum */
    float kb[MAX_BLOCK * MAX_DIM], vb[MAX_BLOCK * MAX_DIM];
    prefill_begin(a, q, ldq, nq, h0, h1, qt, ot, ml);
    for (int64_t t = 0; t < end; t += bs) {
        const int64_t blk = table[t / bs], n = end - t < bs ? end - t : bs;
        for (int64_t h = h0; h < h1; ++h) {
            const HeadRows r = head_rows(a, blk, h, n, kb, vb);
            for (int64_t j = h * g; j < (h + 1) * g; ++j)
                lanes(qt + j * d * PQ, r.k, r.kstep, r.v, r.vstep, n, d, t, pos0, r.ksc, r.vsc,
                      ot + j * d * PQ, ml + j * 2 * PQ);
        }
    }
    prefill_end(a, nq, h0, h1, ot, ml, o, ldo);
}

/* Tokens [t0, t1) (t0 at a block's start) of blocks that a group of sequences shares, for
 * `gw` query heads per KV head (the members' heads, qg [hkv][gw][d]): the prefill item's lanes,
 * sixteen queries to a set held transposed, every FMA taking a broadcast K or V element (one
 * query's dot products at a time need a K load per FMA and a horizontal sum per score), no
 * position hidden. Blocks outer, KV heads inner, so a block's rows are read whole.
 * Leaves each query's unnormalised output in acc [hkv][gw][d], its max in m and its sum in
 * l [hkv][gw]. ws: hkv * sets * (2 * d + 2) * 16 floats, sets = gw / 16 rounded up. */
static void group_pass(const Attn *a, const float *qg, int64_t gw, const int32_t *table,
                       int64_t t0, int64_t t1, float *acc, float *m, float *l, float *ws) {
    const int64_t d = a->d, bs = a->bs, hkv = a->hkv, sets = (gw + PQ - 1) / PQ;
    float *qt = ws, *ot = qt + hkv * sets * d * PQ, *ml = ot + hkv * sets * d * PQ;
    float kb[MAX_BLOCK * MAX_DIM], vb[MAX_BLOCK * MAX_DIM], ones[PQ];
    const LanesFn lanes = lanes_fn();
    for (int64_t h = 0; h < hkv; ++h)
        for (int64_t st = 0; st < sets; ++st) {
            const int64_t x = h * sets + st, nq = gw - st * PQ < PQ ? gw - st * PQ : PQ;
            transpose_in(qg + (h * gw + st * PQ) * d, d, nq, d, a->scale, qt + x * d * PQ);
            for (int64_t r = 0; r < PQ; ++r) {
                ml[x * 2 * PQ + r] = -INFINITY;
                ml[x * 2 * PQ + PQ + r] = 0.0f;
            }
        }
    memset(ot, 0, sizeof(float) * (size_t)(hkv * sets * d * PQ));
    for (int64_t t = t0; t < t1; t += bs) {
        const int64_t blk = table[t / bs], n = t1 - t < bs ? t1 - t : bs;
        prefetch_next(a, table, t, n, t1);
        for (int64_t h = 0; h < hkv; ++h) {
            const HeadRows r = head_rows(a, blk, h, n, kb, vb);
            for (int64_t st = 0; st < sets; ++st) { /* every query sees every token */
                const int64_t x = h * sets + st;
                lanes(qt + x * d * PQ, r.k, r.kstep, r.v, r.vstep, n, d, t, t + n, r.ksc, r.vsc,
                      ot + x * d * PQ, ml + x * 2 * PQ);
            }
        }
    }
    for (int64_t r = 0; r < PQ; ++r)
        ones[r] = 1.0f;
    for (int64_t h = 0; h < hkv; ++h)
        for (int64_t st = 0; st < sets; ++st) {
            const int64_t x = h * sets + st, nq = gw - st * PQ < PQ ? gw - st * PQ : PQ;
            const int64_t w = h * gw + st * PQ; /* the set's first query */
            transpose_out(ot + x * d * PQ, ones, nq, d, acc + w * d, d);
            memcpy(m + w, ml + x * 2 * PQ, sizeof(float) * (size_t)nq);
            memcpy(l + w, ml + x * 2 * PQ + PQ, sizeof(float) * (size_t)nq);
        }
}

/* ---- Decode attention over shared prefixes ----
 *
 * Sequences that share leading blocks (a prefix-cache hit: one system prompt before every
 * request, the n choices of one prompt) would each read those blocks' K and V rows on their
 * own. Here such a group reads each shared block once: KV head h's query heads of every
 * member are taken together, sixteen to a set, and `group_pass` computes them as a prefill
 * item computes its query positions (transposed, a broadcast K or V element into two vectors of
 * eight queries), which also does the arithmetic in fewer instructions than one query's dot
 * products at a time. Each member then has a partial for its shared blocks and one for its own
 * tail (or several, where pieces are split for the threads), merged as split-K's are.
 *
 * Groups come from the block tables alone: sequences sorted by their full blocks' ids, the
 * common run of neighbours gives the shared blocks; a group inside a group (the choices of one
 * prompt behind a common system prompt) gets its own deeper piece. Sharing under MIN_SHARED
 * blocks is left to each member (one block saves little and adds a partial to merge), and so
 * is a group whose query heads would fill under half of a set of sixteen: a set's lanes cost
 * about half what one query's dot products do, so two members of three query heads each (six
 * lanes) ran slower together (18.7-19.9 against 16.7-17.2 ms for a layer's calls of 16 such
 * pairs, 2 Zen 4 cores) where four (twelve lanes) ran 9.9 against 14.9. A sequence's own
 * several rows (a verify step's drafts, a grammar's forced tokens) hold all its blocks too,
 * but join no group: each attends as that sequence's one-token step would, bit for bit, so a
 * lone request answers alike with drafts or jump-forward and without. */
#define PASS_FLOATS (1 << 16) /* a group pass's transposed queries and outputs: 256 KiB, in L2 */
#define MIN_SHARED 2 /* blocks a group must share to read them once */

static int shared_on = -1;
static int shared_supported(void) { return 1; }
int kvg_shared_prefix(int on) { return kvg_switch(&shared_on, shared_supported, on); }

/* Decode attention calls (one a layer a step) that read some blocks once for several
 * sequences, since the library loaded: what proves the path serves an engine. */
static int64_t shared_calls = 0;
int64_t kvg_shared_prefix_calls(void) { return __atomic_load_n(&shared_calls, __ATOMIC_RELAXED); }

typedef struct {
    const int32_t *tables;
    int64_t ldt;
    const int64_t *full; /* each sequence's full blocks */
} Tables;

/* The full blocks sequences a and b begin with alike. */
static int64_t common_blocks(const Tables *t, int64_t a, int64_t b) {
    const int32_t *ta = t->tables + a * t->ldt, *tb = t->tables + b * t->ldt;
    const int64_t n = t->full[a] < t->full[b] ? t->full[a] : t->full[b];
    int64_t c = 0;
    while (c < n && ta[c] == tb[c])
        ++c;
    return c;
}

/* Sequences a and b by their full blocks' ids, then the shorter first, then by index. */
static int table_order(const Tables *t, int64_t a, int64_t b) {
    const int64_t c = common_blocks(t, a, b);
    if (c < t->full[a] && c < t->full[b]) {
        const int32_t x = t->tables[a * t->ldt + c], y = t->tables[b * t->ldt + c];
        return x < y ? -1 : 1;
    }
    if (t->full[a] != t->full[b])
        return t->full[a] < t->full[b] ? -1 : 1;
    return a < b ? -1 : a > b;
}

static void sort_by_table(const Tables *t, int64_t *x, int64_t *tmp, int64_t n) {
    if (n < 2)
        return;
    const int64_t h = n / 2;
    sort_by_table(t, x, tmp, h);
    sort_by_table(t, x + h, tmp, n - h);
    int64_t i = 0, j = h, o = 0;
    while (i < h && j < n)
        tmp[o++] = table_order(t, x[i], x[j]) <= 0 ? x[i++] : x[j++];
    while (i < h)
        tmp[o++] = x[i++];
    while (j < n)
        tmp[o++] = x[j++];
    memcpy(x, tmp, sizeof(int64_t) * (size_t)n);
}

typedef struct {
    int64_t first, count; /* members: order[first .. first + count) */
    int64_t t0, t1;       /* tokens */
} Job;

typedef struct {
    const int64_t *order, *lcp; /* lcp[i]: blocks order[i - 1] and order[i] share */
    int64_t *tail;              /* each sequence's first block no group covers */
    Job *jobs;
    int64_t njobs, cap, bs, kmax, kmin; /* cap: the jobs room for groups */
} Plan;

/* Members order[l .. r), which share blocks [0, start) already covered by groups: a group over
 * what they all share beyond that (if worth it), then the same for each run of them that
 * shares more. */
static void plan_range(Plan *p, int64_t l, int64_t r, int64_t start) {
    if (r - l == 1) {
        p->tail[p->order[l]] = start;
        return;
    }
    int64_t common = p->lcp[l + 1];
    for (int64_t i = l + 2; i < r; ++i)
        common = p->lcp[i] < common ? p->lcp[i] : common;
    const int64_t passes = (r - l + p->kmax - 1) / p->kmax;
    if (common - start >= MIN_SHARED && r - l >= p->kmin && p->njobs + passes <= p->cap) {
        const int64_t each = (r - l + passes - 1) / passes; /* members over passes, evenly */
        for (int64_t f = l; f < r; f += each)
            p->jobs[p->njobs++] = (Job){f, r - f < each ? r - f : each, start * p->bs, common * p->bs};
        start = common;
    }
    for (int64_t i = l; i < r;) {
        int64_t j = i + 1;
        while (j < r && p->lcp[j] > common)
            ++j;
        plan_range(p, i, j, start);
        i = j;
    }
}

/* Jobs (groups' shared blocks, every sequence's tail) into pieces of tokens for the threads:
 * a job costs its members times its tokens, and one costing over a (4 x threads)th of the
 * step's attention is cut into runs of at least 4 blocks. Returns the piece count; with
 * `pieces` NULL only counts. */
static int64_t cut_pieces(const Job *jobs, int64_t njobs, int64_t bs, int threads, Job *pieces) {
    int64_t total = 0, n = 0;
    for (int64_t i = 0; i < njobs; ++i)
        total += jobs[i].count * (jobs[i].t1 - jobs[i].t0);
    const int64_t target = total / (4 * (int64_t)threads) + 1;
    for (int64_t i = 0; i < njobs; ++i) {
        const Job jb = jobs[i];
        const int64_t tokens = jb.t1 - jb.t0;
        int64_t cut = (jb.count * tokens + target - 1) / target;
        if (cut > tokens / (4 * bs))
            cut = tokens / (4 * bs);
        if (cut < 1)
            cut = 1;
        const int64_t chunk = ((tokens + cut - 1) / cut + bs - 1) / bs * bs;
        for (int64_t t = jb.t0; t < jb.t1; t += chunk, ++n)
            if (pieces)
                pieces[n] = (Job){jb.first, jb.count, t, t + chunk < jb.t1 ? t + chunk : jb.t1};
    }
    return n;
}

/* Decode attention with groups of sequences that share blocks reading them once. Returns 0,
 * -1 without memory, or 2 where no group was found (nothing done: decode each sequence). */
static int decode_shared(const Attn *ap, float *out, const int64_t *rows, const int32_t *lens,
                         int64_t B, int threads) {
    const Attn a = *ap;
    const int64_t bs = a.bs, d = a.d, g = a.g, hkv = a.hkv, heads = hkv * g;
    const int64_t per = heads * d + 2 * heads;
    if (threads < 1)
        threads = 1;
    int rc = -1; /* without memory, until the end */
    Job *pieces = NULL;
    int64_t *piece_slot = NULL, *slot_of = NULL;
    float *part = NULL, *ws = NULL;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(8 * B + 1));
    Job *jobs = malloc(sizeof(Job) * (size_t)(3 * B));
    if (!idx || !jobs)
        goto done;
    int64_t *full = idx, *order = full + B, *tmp = order + B, *lcp = tmp + B, *tail = lcp + B;
    int64_t *slot0 = tail + B;        /* B + 1: each sequence's first partial */
    int64_t *members = slot0 + B + 1; /* 2 * B: groups' members, then each sequence alone */
    int64_t cand = 0;
    for (int64_t b = 0; b < B; ++b) {
        full[b] = lens[b] / bs;
        tail[b] = 0;
        /* a sequence with several rows (`continues`) attends alone, each row as its one-token
         * step would: its rows grouped read their blocks in another order than one row does */
        const int several = continues(&a, lens, b) || (b + 1 < B && continues(&a, lens, b + 1));
        if (full[b] >= MIN_SHARED && !several)
            order[cand++] = b;
    }
    const Tables t = {a.tables, a.ldt, full};
    sort_by_table(&t, order, tmp, cand);
    for (int64_t i = 1; i < cand; ++i)
        lcp[i] = common_blocks(&t, order[i - 1], order[i]);
    /* members a pass holds: as many sixteen-query sets per KV head as PASS_FLOATS allows */
    const int64_t sets = PASS_FLOATS / (hkv * 2 * PQ * d) > 1 ? PASS_FLOATS / (hkv * 2 * PQ * d) : 1;
    const int64_t kmax = sets * PQ / g > 1 ? sets * PQ / g : 1, gmax = kmax * g;
    const int64_t kmin = (PQ / 2 + g - 1) / g > 2 ? (PQ / 2 + g - 1) / g : 2;
    Plan p = {order, lcp, tail, jobs, 0, 2 * B, bs, kmax, kmin};
    for (int64_t i = 0; i < cand;) { /* runs of neighbours sharing a first block */
        int64_t j = i + 1;
        while (j < cand && lcp[j] > 0)
            ++j;
        plan_range(&p, i, j, 0);
        i = j;
    }
    if (p.njobs == 0) {
        rc = 2;
        goto done;
    }
    __atomic_fetch_add(&shared_calls, 1, __ATOMIC_RELAXED);
    /* every sequence's tail, as a job of one member: the members are order[] (groups' members
     * are runs of it) and then each sequence by its index */
    memcpy(members, order, sizeof(int64_t) * (size_t)cand);
    for (int64_t b = 0; b < B; ++b) {
        members[cand + b] = b;
        if (tail[b] * bs < lens[b])
            jobs[p.njobs++] = (Job){cand + b, 1, tail[b] * bs, lens[b]};
    }
    const int64_t npieces = cut_pieces(jobs, p.njobs, bs, threads, NULL);
    pieces = malloc(sizeof(Job) * (size_t)npieces);
    piece_slot = malloc(sizeof(int64_t) * (size_t)(npieces + 1));
    if (!pieces || !piece_slot)
        goto done;
    cut_pieces(jobs, p.njobs, bs, threads, pieces);
    /* partial slots: each sequence's consecutive, in piece order; a piece's member i writes
     * slot0[b] + (pieces of b before it) */
    for (int64_t b = 0; b <= B; ++b)
        slot0[b] = 0;
    for (int64_t i = 0; i < npieces; ++i)
        for (int64_t m = 0; m < pieces[i].count; ++m)
            ++slot0[members[pieces[i].first + m] + 1];
    for (int64_t b = 0; b < B; ++b)
        slot0[b + 1] += slot0[b];
    int64_t *taken = tmp; /* partials handed out so far, per sequence */
    for (int64_t b = 0; b < B; ++b)
        taken[b] = 0;
    slot_of = malloc(sizeof(int64_t) * (size_t)(slot0[B] + 1));
    part = malloc(sizeof(float) * (size_t)(slot0[B] * per));
    /* per thread: a group's queries and its outputs, maxes and sums, then the scratch of a
     * group pass (or of one sequence's run, smaller) */
    const int64_t wsz = 2 * gmax * hkv * (d + 1) + hkv * sets * (2 * d + 2) * PQ;
    ws = malloc(sizeof(float) * (size_t)(threads * wsz));
    if (!slot_of || !part || !ws)
        goto done;
    for (int64_t i = 0, n = 0; i < npieces; ++i) { /* piece i's members' slots from n on */
        piece_slot[i] = n;
        for (int64_t m = 0; m < pieces[i].count; ++m) {
            const int64_t b = members[pieces[i].first + m];
            slot_of[n++] = slot0[b] + taken[b]++;
        }
    }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (int64_t i = 0; i < npieces; ++i) {
        const Job pc = pieces[i];
        const int64_t *mem = members + pc.first, k = pc.count;
        int self = 0;
#ifdef _OPENMP
        self = omp_get_thread_num();
#endif
        float *qg = ws + self * wsz, *acc = qg + gmax * hkv * d, *m = acc + gmax * hkv * d;
        float *l = m + gmax * hkv, *qs = l + gmax * hkv;
        const int32_t *table = a.tables + mem[0] * a.ldt; /* the shared blocks' ids: any member's */
        if (k == 1) {
            float *pp = part + slot_of[piece_slot[i]] * per;
            attend_run(&a, a.q + rows[mem[0]] * a.ldq, table, pc.t0, pc.t1, pp + heads * d,
                       pp + heads * d + heads, pp, qs);
            continue;
        }
        /* the members' queries as one group of k * g heads per KV head: [hkv][k][g][d] */
        for (int64_t h = 0; h < hkv; ++h)
            for (int64_t s = 0; s < k; ++s)
                memcpy(qg + ((h * k + s) * g) * d, a.q + rows[mem[s]] * a.ldq + h * g * d,
                       sizeof(float) * (size_t)(g * d));
        group_pass(&a, qg, k * g, table, pc.t0, pc.t1, acc, m, l, qs);
        for (int64_t s = 0; s < k; ++s) { /* back to each member's [heads] order */
            float *pp = part + slot_of[piece_slot[i] + s] * per;
            for (int64_t h = 0; h < hkv; ++h)
                for (int64_t j = 0; j < g; ++j) {
                    const int64_t w = (h * k + s) * g + j, o = h * g + j;
                    memcpy(pp + o * d, acc + w * d, sizeof(float) * (size_t)d);
                    pp[heads * d + o] = m[w];
                    pp[heads * d + heads + o] = l[w];
                }
        }
    }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        merge_parts(part + slot0[b] * per, slot0[b + 1] - slot0[b], heads, d,
                    out + rows[b] * heads * d);
    rc = 0;
done:
    free(idx), free(jobs), free(pieces), free(piece_slot), free(slot_of), free(part), free(ws);
    return rc;
}

/* Attention of `B` single-token queries over the paged pool. Sequence b's query is row
 * rows[b] of q ([rows][heads][d], row stride ldq floats) and its output row rows[b] of out
 * ([rows][heads][d], contiguous); it attends to lens[b] cached tokens through its block table
 * (tables + b * ldt). Sequences sharing blocks read them once (`kvg_shared_prefix`, on by
 * default); one sequence's several rows (`continues`) are each attended as its one-token step
 * would be. Returns 0, 1 on an unsupported shape, -1 without memory. */
int kvg_paged_decode(const float *q, int64_t ldq, float *out, const int64_t *rows,
                     const int32_t *lens, int64_t B, const void *k, const void *v,
                     const float *ks, const float *vs, int type, int64_t bs, int64_t hkv,
                     int64_t heads, int64_t d, const int32_t *tables, int64_t ldt, float scale,
                     int threads) {
    if (heads % hkv || heads / hkv > MAX_GROUP || d % 8 || d > MAX_DIM || bs > MAX_BLOCK)
        return 1;
    const Attn a = {q, ldq, k, v, ks, vs, type, bs, hkv, d, heads / hkv, tables, ldt, scale};
    int64_t nseq = 0; /* sequences: a sequence's several rows count once */
    for (int64_t b = 0; b < B; ++b)
        nseq += !continues(&a, lens, b);
    if (nseq > 1 && kvg_shared_prefix(-1) == 1) {
        const int rc = decode_shared(&a, out, rows, lens, B, threads);
        if (rc != 2)
            return rc;
    }
    return decode_each(&a, out, rows, lens, B, nseq, threads);
}

/* ---- The same lanes in 512-bit vectors, where the CPU has AVX-512 --------------------------
 * Prefill items and group passes over shared blocks. Sixteen queries are one vector, not two:
 * each broadcast K or V element feeds one FMA of sixteen lanes where it fed two of eight, and
 * the exponentials go sixteen at a time. Every lane does what `lanes_block` does, in the same
 * order (the same FMA chains, the same polynomial, the same sums), so the bits are the same;
 * only the instruction count halves: 18.5 against 24.0 ms for a layer of eight 544-token prompts (SmolLM2's heads, 2
 * threads, an AVX-512 Xeon). On by default where the CPU has AVX-512 F/BW/VL/DQ
 * (`kvg_attn512`). */
static int attn512_on = -1;

static int attn512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

int kvg_attn512(int on) { return kvg_switch(&attn512_on, attn512_supported, on); }

/* exp8's arithmetic, sixteen lanes (a NaN passes the clamp as there: x second) */
static inline __attribute__((always_inline)) A512_FN __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~zero, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

/* prefill_scores with one vector of sixteen queries: s[u] is token t+u's, eight tokens (eight
 * FMA chains) at a time */
static inline __attribute__((always_inline)) A512_FN void prefill_scores512(
    const float *qt, const float *kr, int64_t kstep, int64_t n, int64_t d, int64_t t,
    int64_t pos0, float ksc, __m512 *s) {
    const __m512 kscv = _mm512_set1_ps(ksc);
    int64_t u = 0;
    for (; u + 8 <= n; u += 8) {
        __m512 c[8];
        for (int r = 0; r < 8; ++r) c[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
            const __m512 q = _mm512_loadu_ps(qt + i * PQ);
            for (int r = 0; r < 8; ++r)
                c[r] = _mm512_fmadd_ps(_mm512_set1_ps(kr[(u + r) * kstep + i]), q, c[r]);
        }
        for (int r = 0; r < 8; ++r) s[u + r] = _mm512_mul_ps(c[r], kscv);
    }
    for (; u < n; ++u) {
        __m512 c = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; ++i)
            c = _mm512_fmadd_ps(_mm512_set1_ps(kr[u * kstep + i]), _mm512_loadu_ps(qt + i * PQ), c);
        s[u] = _mm512_mul_ps(c, kscv);
    }
    if (t + n - 1 > pos0) { /* the block reaches past the first query: hide the future */
        const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (u = 0; u < n; ++u) {
            const __mmask16 seen = _mm512_cmp_ps_mask(lane, _mm512_set1_ps((float)(t + u - pos0)), _CMP_GE_OQ);
            s[u] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), s[u]);
        }
    }
}

/* lanes_block in 512-bit vectors: one vector of sixteen queries, each lane's arithmetic in the
 * same order (the same FMA chains, the same polynomial, the same sums): the same bits */
static A512_FN void lanes_block512(const float *qt, const float *kr, int64_t kstep,
                                   const float *vr, int64_t vstep, int64_t n, int64_t d, int64_t t,
                                   int64_t pos0, float ksc, float vscf, float *otj, float *mj) {
    __m512 s[MAX_BLOCK];
    const __m512 vsc = _mm512_set1_ps(vscf);
    prefill_scores512(qt, kr, kstep, n, d, t, pos0, ksc, s);
    const __m512 m0 = _mm512_loadu_ps(mj);
    __m512 mx = m0;
    for (int64_t u = 0; u < n; ++u) mx = _mm512_max_ps(mx, s[u]);
    const __m512 c = exp16(_mm512_sub_ps(m0, mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t u = 0; u < n; ++u) {
        const __m512 p = exp16(_mm512_sub_ps(s[u], mx));
        sum = _mm512_add_ps(sum, p);
        s[u] = _mm512_mul_ps(p, vsc);
    }
    _mm512_storeu_ps(mj, mx);
    _mm512_storeu_ps(mj + PQ, _mm512_fmadd_ps(_mm512_loadu_ps(mj + PQ), c, sum));
    /* eight output components at a time in registers, tokens inner */
    for (int64_t i = 0; i < d; i += 8) {
        __m512 acc[8];
        for (int r = 0; r < 8; ++r)
            acc[r] = _mm512_mul_ps(_mm512_loadu_ps(otj + (i + r) * PQ), c);
        for (int64_t u = 0; u < n; ++u) {
            const float *vu = vr + u * vstep + i;
            for (int r = 0; r < 8; ++r)
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(vu[r]), s[u], acc[r]);
        }
        for (int r = 0; r < 8; ++r) _mm512_storeu_ps(otj + (i + r) * PQ, acc[r]);
    }
}

static LanesFn lanes_fn(void) { return kvg_attn512(-1) == 1 ? lanes_block512 : lanes_block; }

typedef struct {
    int64_t cost, seq, pos, h0, h1; /* KV heads [h0, h1) */
} PrefillItem;

static int by_cost(const void *x, const void *y) {
    const int64_t a = ((const PrefillItem *)x)->cost, b = ((const PrefillItem *)y)->cost;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* Causal attention of S prompt chunks over the paged pool. Chunk s's qlen[s] queries are rows
 * qrow[s].. of q ([rows][heads][d], row stride ldq), at the last positions of its lens[s] cached
 * tokens (this step's included, already written); its outputs go to the same rows of out
 * ([rows][heads][d], contiguous), its block table at tables + s * ldt. A work item is sixteen
 * positions of one chunk with every head, or with one KV head's query heads where there would
 * be fewer than two items a thread; the longest first. Returns 0, 1 on an unsupported shape,
 * -1 without memory. */
int kvg_paged_prefill(const float *q, int64_t ldq, float *out, const int64_t *qrow,
                      const int32_t *qlen, const int32_t *lens, int64_t S, const void *k,
                      const void *v, const float *ks, const float *vs, int type, int64_t bs,
                      int64_t hkv, int64_t heads, int64_t d, const int32_t *tables, int64_t ldt,
                      float scale, int threads) {
    if (heads % hkv || heads / hkv > MAX_GROUP || d % 8 || d > MAX_DIM || bs > MAX_BLOCK)
        return 1;
    const Attn a = {q, ldq, k, v, ks, vs, type, bs, hkv, d, heads / hkv, tables, ldt, scale};
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s) {
        if (qlen[s] < 1 || qlen[s] > lens[s])
            return 1;
        n += (qlen[s] + PQ - 1) / PQ;
    }
    if (threads < 1)
        threads = 1;
    const int64_t split = n < 2 * (int64_t)threads ? hkv : 1; /* items a tile of positions */
    n *= split;
    const int64_t per = (2 * heads * d + 2 * heads) * PQ;
    PrefillItem *items = malloc(sizeof(PrefillItem) * (size_t)(n ? n : 1));
    float *ws = malloc(sizeof(float) * (size_t)(threads * per));
    if (!items || !ws) {
        free(items);
        free(ws);
        return -1;
    }
    int64_t it = 0;
    for (int64_t s = 0; s < S; ++s)
        for (int64_t p = 0; p < qlen[s]; p += PQ)
            for (int64_t h = 0; h < split; ++h) {
                const int64_t h0 = split == 1 ? 0 : h, h1 = split == 1 ? hkv : h + 1;
                items[it++] = (PrefillItem){lens[s] - qlen[s] + p + PQ, s, p, h0, h1};
            }
    qsort(items, (size_t)n, sizeof(PrefillItem), by_cost);
    const LanesFn lanes = lanes_fn();
#pragma omp parallel for num_threads(threads) if (threads > 1 && n > 1) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
        const PrefillItem w = items[i];
        int self = 0;
#ifdef _OPENMP
        self = omp_get_thread_num();
#endif
        const int64_t left = qlen[w.seq] - w.pos, nq = left < PQ ? left : PQ;
        const int64_t row = qrow[w.seq] + w.pos;
        prefill_item(&a, q + row * ldq, ldq, out + row * heads * d, heads * d, nq,
                     lens[w.seq] - qlen[w.seq] + w.pos, tables + w.seq * ldt, w.h0, w.h1,
                     ws + self * per, lanes);
    }
    free(items);
    free(ws);
    return 0;
}

/* ---- KV writes: this step's K or V rows into the pool, converted to its element type ----- */

/* Eight fp32 values to e4m3fn bytes (in the low 8 bytes), rounding to nearest even as torch's
 * cast does: clamped to +-448 first (NaN passes), |v| >= 480 would be NaN (e4m3fn has no
 * infinity); below 2^-6 a subnormal, rounded by adding 2^14 (whose ulp is e4m3's 2^-9);
 * else the mantissa rounded to three bits and the exponent rebiased from 127 to 7. */
static inline __m128i fp8_from8(__m256 v) {
    v = _mm256_max_ps(_mm256_set1_ps(-448.0f), _mm256_min_ps(_mm256_set1_ps(448.0f), v));
    const __m256i w = _mm256_castps_si256(v);
    const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(w, _mm256_set1_epi32((int)0x80000000u)), 24);
    const __m256i a = _mm256_and_si256(w, _mm256_set1_epi32(0x7fffffff));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7ffffu));
    const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), 20);
    const __m256 magic = _mm256_castsi256_ps(_mm256_set1_epi32(0x46800000)); /* 2^14 */
    const __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), magic)), _mm256_castps_si256(magic));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a);
    const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43efffff));
    __m256i r = _mm256_blendv_epi8(normal, sub, is_sub);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), is_nan);
    r = _mm256_or_si256(r, sign);
    /* byte 0 of each 32-bit lane, the two 128-bit halves joined */
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    r = _mm256_shuffle_epi8(r, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* fp32 to bf16 bits, nearest even as torch rounds (NaN to 0x7fc0). */
static inline uint16_t bf16_from(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f))
        return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* `n` floats of `x` to the pool's type at `dst` (fp8: x / scale, as torch's quantise does;
 * n a multiple of 8). */
static void store_row(void *dst, const float *x, int64_t n, int type, float scale) {
    int64_t i = 0;
    switch (type) {
    case KV_F32:
        memcpy(dst, x, (size_t)n * sizeof(float));
        return;
    case KV_F16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; ++i)
            ((uint16_t *)dst)[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
        return;
    case KV_BF16:
        for (; i < n; ++i)
            ((uint16_t *)dst)[i] = bf16_from(x[i]);
        return;
    default: { /* n a multiple of 8: kvg_write_kv refuses other fp8 rows */
        const __m256 sv = _mm256_set1_ps(scale);
        for (; i < n; i += 8)
            _mm_storel_epi64((__m128i *)((uint8_t *)dst + i), fp8_from8(_mm256_div_ps(_mm256_loadu_ps(x + i), sv)));
    }
    }
}

/* One fp8 block's `n` e4m3 values of head row `p` requantised to a grown scale: v * ratio. */
static void requantise(uint8_t *p, int64_t n, float ratio) {
    const __m256 r = _mm256_set1_ps(ratio);
    for (int64_t i = 0; i + 8 <= n; i += 8)
        _mm_storel_epi64((__m128i *)(p + i), fp8_from8(_mm256_mul_ps(fp8x8(p + i), r)));
}

#define MAX_KV_HEADS 256

/* Rows x[t] (hkv * d floats, row stride ldx) into `pool` ([blocks][bs][hkv][d] of `type`) at
 * flat slots[t]. An fp8 pool keeps one scale per block and KV head (`scales` [blocks][hkv]),
 * which only grows while the block fills, exactly as kvguard.kernels.fp8.write_kv_fp8 does it:
 * for each block this call touches (its tokens are consecutive rows here, as a sequence's are
 * within a step), a write at offset 0 starts the block afresh, the new scale is
 * max(old, amax / 448) (at least 1e-12; NaN where x holds a NaN, or the old scale is one, as
 * torch's amax and maximum propagate it), a block any of whose scales grew has its stored values
 * requantised by old / new first, then the tokens are stored as x / scale. Returns 0, 1 on a
 * shape this does not serve, -3 on a slot outside the pool (before anything is written). */
int kvg_write_kv(void *pool, float *scales, int type, const float *x, int64_t ldx,
                 const int64_t *slots, int64_t T, int64_t num_slots, int64_t bs, int64_t hkv,
                 int64_t d) {
    const int64_t row = hkv * d, es = elem_size(type);
    if (bs < 1 || hkv < 1 || hkv > MAX_KV_HEADS || (type == KV_FP8 && (d % 8 || !scales)))
        return 1;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -3;
    if (type != KV_FP8) {
        for (int64_t t = 0; t < T; ++t)
            store_row((char *)pool + slots[t] * row * es, x + t * ldx, row, type, 1.0f);
        return 0;
    }
    uint8_t *p8 = (uint8_t *)pool;
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        const int64_t blk = slots[t0] / bs;
        int fresh = 0;
        for (t1 = t0; t1 < T && slots[t1] / bs == blk; ++t1)
            fresh |= slots[t1] % bs == 0;
        float *sc = scales + blk * hkv, nw[MAX_KV_HEADS];
        int grow = 0;
        for (int64_t h = 0; h < hkv; ++h) {
            /* amax of |x|'s bits as integers (as lowbit.c's quantize_row takes it): without a
             * sign the integer order is the float order, and a NaN's bits exceed +inf's, so a
             * NaN wins the maximum in whatever lane it sits, as in torch's amax (maxps kept or
             * dropped it by lane, and a dropped one left the block scaled to its other values) */
            __m256i m = _mm256_setzero_si256();
            const __m256i abs = _mm256_set1_epi32(0x7fffffff);
            for (int64_t t = t0; t < t1; ++t)
                for (int64_t i = 0; i < d; i += 8)
                    m = _mm256_max_epi32(m, _mm256_and_si256(abs, _mm256_castps_si256(_mm256_loadu_ps(x + t * ldx + h * d + i))));
            __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
            m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
            m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
            const float old = fresh ? 0.0f : sc[h], want = _mm_cvtss_f32(_mm_castsi128_ps(m4)) / 448.0f;
            /* torch.maximum(old, want): a NaN on either side wins (then the floor keeps it, as
             * clamp_min does, and a NaN scale never counts as grown: the block's stored values
             * stay, its new tokens store as NaN) */
            nw[h] = old != old ? old : want != want ? want : want > old ? want : old;
            if (nw[h] < 1e-12f)
                nw[h] = 1e-12f;
            grow |= nw[h] > old && old > 0.0f;
        }
        if (grow)
            for (int64_t u = 0; u < bs; ++u)
                for (int64_t h = 0; h < hkv; ++h)
                    requantise(p8 + ((blk * bs + u) * hkv + h) * d, d, sc[h] / nw[h]);
        for (int64_t h = 0; h < hkv; ++h)
            sc[h] = nw[h];
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t h = 0; h < hkv; ++h)
                store_row(p8 + slots[t] * row + h * d, x + t * ldx + h * d, d, KV_FP8, nw[h]);
    }
    return 0;
}

/* Elements from which RMSNorm, RoPE and SiLU-and-multiply split their rows over the threads
 * (64 Ki before): a batch-32 decode step's calls (18-49 thousand elements for SmolLM2) took
 * 1.3-1.4x less time on two threads than on one, call overhead included (SiLU-and-multiply
 * 16.4 against 21.9 us, RMSNorm 4.3 against 6.0, 2 Zen 4 cores), the workers spinning
 * between regions; a single row stays on one thread. */
#define PAR_MIN (1 << 14)

/* RMSNorm of T rows of width d (row stride ldx), optionally after the residual add
 * x += y (y contiguous [T][d], x updated in place): out = w * (x / sqrt(mean(x^2) + eps)). */
void kvg_rmsnorm(float *x, int64_t ldx, const float *y, int64_t T, int64_t d, const float *w,
                 float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && T * d >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float *xr = x + t * ldx;
        if (y)
            for (int64_t i = 0; i < d; ++i)
                xr[i] = xr[i] + y[t * d + i];
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        float ss = hsum8(acc);
        for (; i < d; ++i)
            ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        float *o = out + t * d;
        for (i = 0; i < d; ++i)
            o[i] = w[i] * (xr[i] * r);
    }
}

/* Rotate-half RoPE in place on the first `heads` heads (width d) of T rows (row stride ldx),
 * with per-row tables cos/sin [T][d] (the two halves repeat the same frequencies). */
void kvg_rope(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t d, const float *cos_t,
              const float *sin_t, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && T * heads * d >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_t + t * d, *s = sin_t + t * d;
        for (int64_t hh = 0; hh < heads; ++hh) {
            float *p = x + t * ldx + hh * d;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = p[i], x2 = p[i + half];
                const float a = x1 * c[i], b = -x2 * s[i];
                const float e = x2 * c[i + half], f = x1 * s[i + half];
                p[i] = a + b;
                p[i + half] = e + f;
            }
        }
    }
}

/* out[t] = silu(g) * u for T rows of the fused projection [g | u] (each half `inter` wide,
 * row stride ldx), silu(g) = g / (1 + e^-g); out is contiguous [T][inter]. */
void kvg_silu_mul(const float *x, int64_t ldx, int64_t T, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && T * inter >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float *g = x + t * ldx, *u = g + inter;
        float *o = out + t * inter;
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; ++i)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---- Pool conversion: whole blocks into a pool of another element type (the KV switch) ----- */

/* `n` values (a multiple of 8) of `type` at `src` as fp32 into `out`; fp8 times `scale`, as
 * torch's dequantise does (widened exactly, then one fp32 multiply). */
static void load_row(float *out, const void *src, int64_t n, int type, float scale) {
    switch (type) {
    case KV_F32:
        memcpy(out, src, (size_t)n * sizeof(float));
        return;
    case KV_F16:
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))));
        return;
    case KV_BF16:
        for (int64_t i = 0; i < n; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        return;
    default: {
        const __m256 sv = _mm256_set1_ps(scale);
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(fp8x8((const uint8_t *)src + i), sv));
    }
    }
}

/* The largest |x| of `n` floats (a multiple of 8), NaN where one is (as torch's amax): the
 * maximum of the bits as integers, as kvg_write_kv takes it. */
static float amax_abs(const float *x, int64_t n) {
    __m256i m = _mm256_setzero_si256();
    const __m256i abs = _mm256_set1_epi32(0x7fffffff);
    for (int64_t i = 0; i < n; i += 8)
        m = _mm256_max_epi32(m, _mm256_and_si256(abs, _mm256_castps_si256(_mm256_loadu_ps(x + i))));
    __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
    return _mm_cvtss_f32(_mm_castsi128_ps(m4));
}

/* Blocks src_ids[i] of `src` ([src_blocks][bs][hkv][d] of src_type, fp8 with `src_scales`
 * [src_blocks][hkv]) into blocks dst_ids[i] of `dst` (dst_type, fp8 with `dst_scales`), i < n,
 * in one pass: each KV head's rows of a block widened to fp32, then stored in the new type; an
 * fp8 block and head gets the fresh scale max(amax / 448, 1e-12) (NaN where the rows hold a
 * NaN), and its values x / scale. The values are kvguard.engine.kv_cache's read_blocks then
 * write_blocks, bit for bit (tests), without their whole-layer temporaries and a dozen passes:
 * the live KV dtype switch converts only the blocks in use, and holds the engine meanwhile.
 * d a multiple of 8, bs <= MAX_BLOCK, d <= MAX_DIM. Returns 0, 1 on a shape this does not
 * serve, -3 on an id outside its pool (before anything is written), -1 without memory for the
 * threads' rows. */
int kvg_convert_blocks(const void *src, const float *src_scales, int src_type, int64_t src_blocks,
                       void *dst, float *dst_scales, int dst_type, int64_t dst_blocks,
                       const int64_t *src_ids, const int64_t *dst_ids, int64_t n, int64_t bs,
                       int64_t hkv, int64_t d, int threads) {
    if (bs < 1 || bs > MAX_BLOCK || hkv < 1 || d < 8 || d > MAX_DIM || d % 8 ||
        (src_type == KV_FP8 && !src_scales) || (dst_type == KV_FP8 && !dst_scales))
        return 1;
    for (int64_t i = 0; i < n; ++i)
        if (src_ids[i] < 0 || src_ids[i] >= src_blocks || dst_ids[i] < 0 || dst_ids[i] >= dst_blocks)
            return -3;
    if (threads < 1)
        threads = 1;
    const int64_t row = hkv * d, ses = elem_size(src_type), des = elem_size(dst_type);
    float *ws = malloc(sizeof(float) * (size_t)(threads * bs * d)); /* one head's rows a thread */
    if (!ws)
        return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1 && n * bs * row >= PAR_MIN) schedule(static)
    for (int64_t item = 0; item < n * hkv; ++item) {
        const int64_t i = item / hkv, h = item % hkv, sb = src_ids[i], db = dst_ids[i];
        int self = 0;
#ifdef _OPENMP
        self = omp_get_thread_num();
#endif
        float *vals = ws + self * bs * d;
        const float in_scale = src_type == KV_FP8 ? src_scales[sb * hkv + h] : 1.0f;
        for (int64_t u = 0; u < bs; ++u)
            load_row(vals + u * d, (const char *)src + ((sb * bs + u) * row + h * d) * ses, d,
                     src_type, in_scale);
        float out_scale = 1.0f;
        if (dst_type == KV_FP8) {
            out_scale = amax_abs(vals, bs * d) / 448.0f;
            if (out_scale < 1e-12f) /* clamp_min_: a NaN stays NaN */
                out_scale = 1e-12f;
            dst_scales[db * hkv + h] = out_scale;
        }
        for (int64_t u = 0; u < bs; ++u)
            store_row((char *)dst + ((db * bs + u) * row + h * d) * des, vals + u * d, d, dst_type,
                      out_scale);
    }
    free(ws);
    return 0;
}

/* ---- Row maxima: the sampler's greedy choice and the lm_head's candidates ---------------- */

/* The index of row x's largest value, the first where several are equal (torch.argmax); of
 * its first NaN where it holds one. */
static int64_t argmax_row(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = at;
    const __m256i eight = _mm256_set1_epi32(8);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { /* each lane keeps its first largest value and its index */
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, v, gt);
        at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(cur), gt));
        cur = _mm256_add_epi32(cur, eight);
    }
    float b[8];
    int32_t a[8];
    _mm256_storeu_ps(b, best);
    _mm256_storeu_si256((__m256i *)a, at);
    float m = b[0];
    int64_t arg = a[0];
    for (int j = 1; j < 8; ++j) /* the largest lane; among equal ones the lowest index */
        if (b[j] > m || (b[j] == m && a[j] < arg)) {
            m = b[j];
            arg = a[j];
        }
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < n; ++i) {
        any_nan |= x[i] != x[i];
        if (x[i] > m) {
            m = x[i];
            arg = i;
        }
    }
    if (any_nan)
        for (i = 0; i < n; ++i)
            if (x[i] != x[i])
                return i;
    return arg;
}

void kvg_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ldx, int64_t *idx, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && M > 1) schedule(static)
    for (int64_t r = 0; r < M; ++r)
        idx[r] = argmax_row(x + r * ldx, N);
}

/* v[0..k) descending (equal values in the order they came), ids alongside: (val, id) in its
 * place, the last one dropped where all k were held. */
static inline void top_insert(float *v, int64_t *ids, int64_t *held, int64_t k, float val,
                              int64_t id) {
    int64_t p = *held < k ? (*held)++ : k - 1;
    while (p > 0 && v[p - 1] < val) {
        v[p] = v[p - 1];
        ids[p] = ids[p - 1];
        --p;
    }
    v[p] = val;
    ids[p] = id;
}

/* The indices of row x's k largest values (k <= n), largest first; of equal values the lower
 * index is taken. Eight values at a time are compared with the k-th largest so far, and only
 * those above it are inserted. Returns 1 where the row holds a NaN (its indices then unset). */
static int topk_row(const float *x, int64_t n, int64_t k, int64_t *ids, float *v) {
    int64_t held = 0, i = 0;
    __m256 nan = _mm256_setzero_ps();
    for (; i < k; ++i) {
        if (x[i] != x[i])
            return 1;
        top_insert(v, ids, &held, k, x[i], i);
    }
    for (; i < n && (i & 7); ++i) { /* up to an 8-aligned index */
        if (x[i] != x[i])
            return 1;
        if (x[i] > v[k - 1])
            top_insert(v, ids, &held, k, x[i], i);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 w = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(w, w, _CMP_UNORD_Q));
        unsigned above = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(w, _mm256_set1_ps(v[k - 1]), _CMP_GT_OQ));
        while (above) {
            const int j = __builtin_ctz(above);
            above &= above - 1;
            if (x[i + j] > v[k - 1]) /* the k-th largest may have risen meanwhile */
                top_insert(v, ids, &held, k, x[i + j], i + j);
        }
    }
    for (; i < n; ++i) {
        if (x[i] != x[i])
            return 1;
        if (x[i] > v[k - 1])
            top_insert(v, ids, &held, k, x[i], i);
    }
    return _mm256_movemask_ps(nan) != 0;
}

/* idx [M][k]: each row's k largest (1 <= k <= N, at most 256), largest first, ties to the
 * lower index. Returns 0, 1 where a row holds a NaN (the caller then asks torch), 2 on a bad
 * k. */
int kvg_topk_rows(const float *x, int64_t M, int64_t N, int64_t ldx, int64_t k, int64_t *idx,
                  int threads) {
    if (k < 1 || k > N || k > 256)
        return 2;
    int bad = 0;
#pragma omp parallel for num_threads(threads) if (threads > 1 && M > 1) schedule(static) reduction(| : bad)
    for (int64_t r = 0; r < M; ++r) {
        float v[256];
        bad |= topk_row(x + r * ldx, N, k, idx + r * k, v);
    }
    return bad;
}

/* ---- Sampling: a draw from a row's tempered softmax within its top-p nucleus -------------- */

/* The edge of a nucleus among the n values `a` (reordered): as sorted largest first, the
 * values whose sum of the values before it is below `target`, i.e. the fewest largest values
 * whose sum reaches it. Its least value goes to *least, how many of the values equal to it
 * the set takes to *ties (it takes every value above), the set's sum to *sum. A quickselect
 * on mass with three-way partitions. Returns 0 where all the values together fall short of
 * `target` (then nothing is set). */
static int select_edge(float *a, int64_t n, double target, float *least, int64_t *ties,
                       double *sum) {
    int64_t lo = 0, hi = n;
    double mass = 0.0; /* of the values above a[lo..hi): all in the set, and below target */
    while (lo < hi) {
        const float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
        const float pv = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t g = lo, i = lo, l = hi; /* a[lo..g) > pv, a[g..i) == pv, a[l..hi) < pv */
        double mg = 0.0;
        while (i < l) {
            const float v = a[i];
            if (v > pv) {
                mg += v;
                a[i++] = a[g];
                a[g++] = v;
            } else if (v < pv) {
                a[i] = a[--l];
                a[l] = v;
            } else {
                ++i;
            }
        }
        if (g > lo && mass + mg >= target) { /* the edge lies among the values above pv */
            hi = g;
            continue;
        }
        const int64_t ne = l - g;
        if (mass + mg + (double)pv * (double)ne >= target) { /* at pv: the first m ties */
            double acc = mass + mg;
            int64_t m = 0;
            while (m < ne && acc < target) {
                acc += pv;
                ++m;
            }
            *least = pv;
            *ties = m;
            *sum = acc;
            return 1;
        }
        mass += mg + (double)pv * (double)ne;
        lo = l;
    }
    return 0;
}

#define EDGE_BINS 2048 /* a probability's float bits >> 19: its exponent and 4 mantissa bits */

/* The nucleus of mass `target` of the n probabilities p (in (0, 1] or 0): as `select_edge`,
 * with *least = -1 where all of p falls short of target (rounding: all are taken). One pass
 * sums the mass of each bin of values (their bits' order is their values' order); the bins
 * from the top find the one the edge lies in, and only that bin's values (`a`: scratch) are
 * selected among. A quickselect over the whole row cost a flat row 0.6 ms over a 49k
 * vocabulary, more than a sort; this 0.16 ms (2 threads, 32 rows: 11.3 against 4.0 ms). */
static void nucleus_edge(const float *p, int64_t n, double target, float *a, float *least,
                         int64_t *ties, double *sum) {
    double mass[EDGE_BINS] = {0};
    for (int64_t i = 0; i < n; ++i) {
        uint32_t b;
        memcpy(&b, p + i, 4);
        mass[b >> 19] += p[i];
    }
    double above = 0.0;
    int bin = EDGE_BINS - 1;
    for (; bin >= 0 && above + mass[bin] < target; --bin)
        above += mass[bin];
    if (bin < 0) {
        *least = -1.0f;
        *ties = 0;
        *sum = above;
        return;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t b;
        memcpy(&b, p + i, 4);
        if ((int)(b >> 19) == bin)
            a[m++] = p[i];
    }
    if (select_edge(a, m, target - above, least, ties, sum)) {
        *sum += above;
        return;
    }
    /* the bin's own sum fell short by rounding: the whole bin, down to its least value (it
     * holds a value: its mass reached target - above > 0, the caller's target being > 0) */
    float lo = a[0];
    double all = 0.0;
    for (int64_t i = 0; i < m; ++i) {
        lo = a[i] < lo ? a[i] : lo;
        all += a[i];
    }
    int64_t t = 0;
    for (int64_t i = 0; i < m; ++i)
        t += a[i] == lo;
    *least = lo;
    *ties = t;
    *sum = above + all;
}

/* Row x's token: p = exp((x - max) / temp), the nucleus of mass top_p * sum(p) (ties at its
 * edge taken in id order), then by inverse CDF over the nucleus in id order the first token
 * whose running mass exceeds u times the nucleus's. `p` and `a` are n floats of scratch.
 * Returns 1 where the row has a NaN, no finite largest value or no mass. */
static int topp_row(const float *x, int64_t n, float temp, float top_p, float u, float *p,
                    float *a, int64_t *tok) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
        if (x[i] != x[i])
            return 1;
        mx = x[i] > mx ? x[i] : mx;
    }
    if (!(mx > -INFINITY && mx < INFINITY))
        return 1;
    const float s = 1.0f / temp;
    const __m256 mv = _mm256_set1_ps(mx), sv = _mm256_set1_ps(s);
    double total = 0.0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), sv));
        _mm256_storeu_ps(p + i, e);
        total += hsum8(e);
    }
    for (; i < n; ++i) {
        p[i] = expf((x[i] - mx) * s);
        total += p[i];
    }
    if (!(total > 0.0 && total < INFINITY))
        return 1;
    float least = -1.0f;
    int64_t ties = 0;
    double kept = total;
    if (top_p < 1.0f && (double)top_p * total > 0.0) {
        nucleus_edge(p, n, (double)top_p * total, a, &least, &ties, &kept);
    } else if (top_p < 1.0f) { /* no mass to reach (a denormal top_p read as 0): the first */
        least = 1.0f;          /* largest alone, whose p is exp(0) = 1 exactly */
        ties = 1;
        kept = 1.0;
    }
    const double r = (double)u * kept;
    double acc = 0.0;
    int64_t t = ties;
    *tok = -1;
    for (i = 0; i < n; ++i)
        if (p[i] > least || (p[i] == least && t-- > 0)) {
            acc += p[i];
            *tok = i;
            if (acc > r)
                return 0;
        }
    return *tok < 0; /* u * kept rounded up to the whole mass: the last token of the set */
}

/* tok[M]: row r of x (row stride ldx) drawn at temps[r] within its top_ps[r] nucleus with the
 * uniform u[r] in [0, 1). Returns 0, 1 where a row could not be drawn (NaN, inf or no mass),
 * -1 without memory. */
int kvg_topp_rows(const float *x, int64_t M, int64_t N, int64_t ldx, const float *temps,
                  const float *top_ps, const float *u, int64_t *tok, int threads) {
    int bad = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && M > 1) reduction(| : bad)
    {
        float *p = malloc(sizeof(float) * 2 * (size_t)N);
        if (!p)
            bad |= 2;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < M; ++r)
            if (p)
                bad |= topp_row(x + r * ldx, N, temps[r], top_ps[r], u[r], p, p + N, tok + r);
        free(p);
    }
    return bad & 2 ? -1 : bad;
}
