/* kvguard CPU low-bit GEMMs: int8 activations times 4-bit or 8-bit grouped weights (AVX2).
 *
 * Decode on CPU streams every weight once per step, and a batch is compute-bound, so both
 * want the weight small and the inner product in integers: activations are quantised per row
 * in blocks of 32 to int8 (one float scale per block, and the block's dequantised sum for
 * asymmetric weights), each block's integer dot is exact in int32, and scaled once per block
 * in float. `fine` quantises to int16 instead (about as precise as the fp32 input for a block
 * of 32).
 *
 * 4-bit weights are stored "vertically": a 32-bit lane holds four consecutive weights of one
 * output column, a register eight columns side by side, so `vpmaddubsw` (codes 0..15 as the
 * unsigned operand) against four activation bytes broadcast to every lane gives each column's
 * partial dot in its own lane, and a block needs no horizontal reduction. The products stay in
 * int16 across a block (8 x 2 x 15 x 128 < 2^15). `fine` activations (|x| <= 32639) are split
 * into two signed bytes, x = 256 h + l with h and l in -128..127: both take the codes as the
 * unsigned operand against the activation bytes as the signed one, exactly as int8 activations
 * do, and 256 * dot(h) + dot(l) is the int16 dot exactly, so both activation precisions give
 * the same integers as a plain widening dot would. (The signed operand is the one a VNNI dot
 * can read from memory itself: see `dot_bcast16` in `lowbit_dots.h`.)
 *
 * Weight layout (built by kvguard/kernels/cpu_lowbit.py), tiles of eight output columns:
 *   4-bit: codes[tile][K/32][4][32]: block b's quarter j holds, in byte 4c+i, weight
 *          32b+8j+i of column c in the low nibble and weight 32b+8j+4+i in the high one
 *          (unsigned 0..15); w = d*q + m.
 *   8-bit: codes[n][K], row-major by output column: signed int8; w = d*q + m. Its dots run
 *          per column (`vpsignb` then `vpmaddubsw`) and eight columns' sums are reduced to one
 *          vector per block; `fine` widens the codes to int16 (`vpmaddwd`) once per block for
 *          up to four rows.
 *   8-bit vertical (`kvg_w8a8v`, int8 activations only: the refined lm_head): codes[tile][K/32]
 *          [8][32]: block b's eighth j holds, in byte 4c+i, weight 32b+4j+i of column c as
 *          the unsigned code w + 128, so a block's dots need no horizontal sums either (the
 *          row-major VNNI tile spends over two instructions on column sums for each dot one).
 *   d, m: fp16 [N/8][K/group][8], one per group of `bpg` blocks of 32 (m may be NULL: zero).
 * With activation block x ~ e*p (p integer) the block's contribution is
 *   d*e*sum(q*p) + m*e*sum(p).
 *
 * From `kvg_panel_rows` rows a `fine` GEMM leaves the integers: see `gemm_panels`. Which
 * kernel a row takes depends on its kind, not on what else the call holds: see `kvg_pick_kernel`.
 *
 * The integer dots (`lowbit_dots.h`) are compiled twice into this file: for AVX2, and for
 * AVX-512 VNNI under a function target attribute, picked per call (`kvg_vnni`: the CPU's
 * answer by default), the same integers and so the same bits either way.
 *
 * Threads: one OpenMP region per call, linked against the OpenMP runtime torch itself loaded
 * (one thread team for torch's ops and ours, no second runtime spinning beside it). Rows are
 * quantised split over threads, then output columns are split; each thread walks its columns
 * in cache-sized chunks and, inside a chunk, tiles of up to four activation rows (six on the
 * VNNI copy's sixteen-column tiles: MRV), so a weight block is unpacked once for that many.
 */
#define _GNU_SOURCE /* syscall(): the AMX tile state is granted by arch_prctl */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvg_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#define MR 4
/* `bits` of the vertical 8-bit layout (`kvg_w8a8v`) */
#define BITS_8V 9
/* Few rows stream the weights once and wait on memory, so the tile loop prefetches: 4-bit
 * codes (one stream per tile, tiles back to back) this many bytes ahead, 8-bit codes (eight
 * column streams a tile, each a row of K bytes) at the next tile's same block. Measured at
 * batch 1 on SmolLM2's projections: the 4-bit sweep about 10% faster, the 8-bit lm_head
 * about twice as fast (eight short streams the hardware prefetcher did not follow). 4-bit
 * GEMMs of more than one row group keep this distance; those of one go further (below). */
#define AHEAD4 2048
/* A GEMM of at most one row group (decode of a few sequences) waits on the stream alone, and
 * 2 KiB is less than one tile pair of a 576-wide projection's 4-bit codes ahead: well under
 * the memory's latency at one row's pace. It prefetches this far ahead instead; with more
 * rows far prefetches competed with the column chunk the next row group reads from L1
 * (batch 32 ran 6% slower with 12 KiB for every GEMM). The 4-bit prefetches fill L2,
 * not L1 (`_MM_HINT_T1`): into L1 they held the few L1 miss buffers the loads wait on. One row
 * over 26 MB of codes (2 Zen 4 cores): 16-18 GB/s with 2 KiB into L1, 24 with 12 KiB into L2;
 * engine decode in alternating rounds, batch 1 132 -> 152 tok/s, batch 4 level, batch 32 and
 * prefill level. */
#define AHEAD4_FEW 12288
/* Vertical 8-bit codes (the lm_head, 256 bytes a tile a block) are prefetched further ahead.
 * One row of them takes eight-column tiles even on VNNI (256-bit `vpdpbusd`): sixteen columns
 * a tile pair read two streams at once and ran a single row 1.3-1.5x slower than the AVX2
 * copy's eight-column tiles (SmolLM2's head, 2 Zen 4 cores); from two rows the pairs are
 * level or ahead. */
#define AHEAD8V 8192

int kvg_lowbit_abi(void) { return 1; }

/* From this many rows a `fine` GEMM multiplies fp32 panels (`gemm_panels`): below it the
 * int16 dots win, the dequantisation shared by too few rows (measured, SmolLM2's shapes).
 * For 8-bit codes, and for 4-bit ones on the AVX2 dots. A step's decode rows count its
 * decoding sequences against it; its prompt rows take panels at any length unless it is
 * INT32_MAX (`kvg_pick_kernel`). */
int kvg_panel_rows = 16;
/* The same for 4-bit codes on the VNNI dots: measured, they lead or tie the panels at every
 * batch up to 2048 rows once their rows go in L2-sized stretches, so panels only when asked
 * (8-bit codes keep `kvg_panel_rows`: their panels win from 32 rows even against VNNI). */
int kvg_panel_rows_vnni4 = INT32_MAX;

/* Whether the integer dots run their AVX-512 VNNI copy (lowbit_dots.h): -1 until the first
 * GEMM asks the CPU, then 0 or 1; `kvg_vnni` sets or reads it. */
static int vnni_on = -1;

static int vnni_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

int kvg_vnni(int on) { return kvg_switch(&vnni_on, vnni_supported, on); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* This thread's place in its team: (0, 1) outside a parallel region or without OpenMP. */
static inline void team_place(int *t, int *T) {
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *T = omp_get_num_threads();
#else
    *t = 0;
    *T = 1;
#endif
}

static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i pack_i8(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    /* packs interleave 128-bit lanes; the permute restores element order; saturates */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(w, order);
}

/* How a row of activations is stored for the kernels. */
enum { Q_INT8 = 0, Q_INT16 = 1, Q_HILO = 2 };

/* The largest `fine` (int16) code: 127 * 256 + 127, so that every code is 256 h + l with h and
 * l both signed bytes (`Q_HILO`). The 8-bit kernels' int16 codes take the same levels: one
 * `fine` quantisation for both. */
#define FINE_LEVELS 32639

/* A block's largest |x| is taken on the floats' bits as integers: for values without their
 * sign the integer order is the float order, and a NaN's bits (above +inf's, 0x7f800000)
 * win it, where `maxps` drops a NaN unless it is the second operand. So a block holding a NaN
 * or an infinity has a maximum of at least NONFINITE, found with no per-element check. */
#define NONFINITE 0x7f800000

/* One row of K floats to blocks of 32: with e = amax/L and y = x * (L/amax), codes
 * p = round_half_even(y), L = 127 (`Q_INT8`: int8 in `q8`) or L = FINE_LEVELS, stored as int16
 * in `q16` (`Q_INT16`, each block as elements 0-7,16-23 then 8-15,24-31: the order
 * `vpunpck[lh]bw` widens 8-bit codes to) or as bytes (`Q_HILO`: p = 256 h + l, h in `q8` and
 * l in `lo`, both signed). Per block: e, and es = e * sum(p) for the weights' mins, and
 * (`is`, where not NULL) sum(p) itself. Two kinds of block have codes 0: one whose L/amax is
 * not a finite float (all zeros, or values so small, amax below about L / FLT_MAX, that the
 * scale overflowed and turned every code to the most negative one) with e = es = 0, and one
 * holding a NaN or an infinity, with e = es = NaN, so that every output the row feeds is NaN
 * (as x W^T in fp32 would be; a NaN code was INT_MIN, a finite garbage value). */
static void quantize_row(const float *x, int64_t K, int mode, int8_t *q8, int16_t *q16,
                         int8_t *lo, float *e, float *es, int32_t *is) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const float levels = mode == Q_INT8 ? 127.0f : (float)FINE_LEVELS;
    for (int64_t b = 0; b < K / QK; ++b) {
        const float *xb = x + b * QK;
        __m256 v[4];
        __m256i mx = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            mx = _mm256_max_epi32(mx, _mm256_and_si256(_mm256_castps_si256(v[j]), abs_mask));
        }
        __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
        m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
        m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
        const int32_t abits = _mm_cvtsi128_si32(m4);
        const float amax = _mm_cvtss_f32(_mm_castsi128_ps(m4));
        float inv = levels / amax, d = amax / levels;
        if (!(inv <= FLT_MAX) || abits >= NONFINITE) { /* rare: see above */
            d = abits >= NONFINITE ? NAN : 0.0f;
            inv = 0.0f;
            for (int j = 0; j < 4; ++j) v[j] = _mm256_setzero_ps();
        }
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i i[4];
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], iv), rnd));
            sum = _mm256_add_epi32(sum, i[j]);
        }
        if (mode == Q_INT16) {
            /* packs works per 128-bit lane: (0-3,16-19 | 4-7,20-23) -> 0-7,16-23 */
            const __m256i l = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[2]), 0xd8);
            const __m256i h = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[1], i[3]), 0xd8);
            _mm256_storeu_si256((__m256i *)(q16 + b * QK), l);
            _mm256_storeu_si256((__m256i *)(q16 + b * QK + 16), h);
        } else if (mode == Q_HILO) {
            const __m256i half = _mm256_set1_epi32(128);
            __m256i h[4], l[4];
            for (int j = 0; j < 4; ++j) {
                h[j] = _mm256_srai_epi32(_mm256_add_epi32(i[j], half), 8); /* -127..127 */
                l[j] = _mm256_sub_epi32(i[j], _mm256_slli_epi32(h[j], 8)); /* -128..127 */
            }
            _mm256_storeu_si256((__m256i *)(q8 + b * QK), pack_i8(h[0], h[1], h[2], h[3]));
            _mm256_storeu_si256((__m256i *)(lo + b * QK), pack_i8(l[0], l[1], l[2], l[3]));
        } else {
            _mm256_storeu_si256((__m256i *)(q8 + b * QK), pack_i8(i[0], i[1], i[2], i[3]));
        }
        const int32_t total = hsum_i32(sum);
        e[b] = d;
        es[b] = d * (float)total;
        if (is) is[b] = total;
    }
}

/* `quantize_row` on AVX-512 (the VNNI copy's CPUs), four blocks at a time: the same codes and
 * scales bit for bit (maxima and integer sums do not depend on their order; each division,
 * product and rounding is the scalar one's, lane by lane), in about half the instructions.
 * The AVX2 copy reduces each block's maximum and code sum across a register on its own and
 * divides twice in scalar; here four blocks' partial maxima and sums are reduced together
 * (three shuffle steps for all four), and their scales are divided, converted and stored as
 * one vector. One thread, rows in L1: 0.24 against 0.39 ns an element for the 4-bit
 * kernels' two bytes, 0.18 against 0.24 for int8; SmolLM2's GEMMs, 2 Zen 4 threads, same
 * bits: 1.01-1.04x (most at 32-512 rows of the 1536-wide down projection). */
#define Q512_FN __attribute__((target("avx512f,avx512bw,avx512vl")))

/* Four blocks' 16-lane partials to [b0 x4 | b1 x4 | b2 x4 | b3 x4]: each block's maximum
 * (`max4`: of |x|'s bits as integers, as `quantize_row` takes it, so a NaN wins) or integer
 * sum (`sum4`) in all four lanes of its 128-bit quarter. */
static inline __attribute__((always_inline)) Q512_FN __m512i max4(const __m512i *a) {
    const __m512i m01 = _mm512_max_epi32(_mm512_shuffle_i32x4(a[0], a[1], 0x44), _mm512_shuffle_i32x4(a[0], a[1], 0xee));
    const __m512i m23 = _mm512_max_epi32(_mm512_shuffle_i32x4(a[2], a[3], 0x44), _mm512_shuffle_i32x4(a[2], a[3], 0xee));
    __m512i m = _mm512_max_epi32(_mm512_shuffle_i32x4(m01, m23, 0x88), _mm512_shuffle_i32x4(m01, m23, 0xdd));
    m = _mm512_max_epi32(m, _mm512_shuffle_epi32(m, (_MM_PERM_ENUM)0x4e));
    return _mm512_max_epi32(m, _mm512_shuffle_epi32(m, (_MM_PERM_ENUM)0xb1));
}

static inline __attribute__((always_inline)) Q512_FN __m512i sum4(const __m512i *a) {
    const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(a[0], a[1], 0x44), _mm512_shuffle_i32x4(a[0], a[1], 0xee));
    const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2], a[3], 0x44), _mm512_shuffle_i32x4(a[2], a[3], 0xee));
    __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xdd));
    s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0x4e));
    return _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0xb1));
}

static Q512_FN void quantize_row512(const float *x, int64_t K, int mode, int8_t *q8, int16_t *q16,
                                    int8_t *lo, float *e, float *es, int32_t *is) {
    const float levels = mode == Q_INT8 ? 127.0f : (float)FINE_LEVELS;
    const __m512 lv = _mm512_set1_ps(levels), zero = _mm512_setzero_ps();
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), half = _mm512_set1_epi32(128);
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t nb = K / QK;
    for (int64_t b0 = 0; b0 < nb; b0 += 4) {
        const int n = nb - b0 < 4 ? (int)(nb - b0) : 4;
        __m512 v[8];
        __m512i a[4];
        for (int j = 0; j < 4; ++j) { /* blocks past the row's end read as zeros */
            const float *xb = x + (b0 + j) * QK;
            v[2 * j] = j < n ? _mm512_loadu_ps(xb) : zero;
            v[2 * j + 1] = j < n ? _mm512_loadu_ps(xb + 16) : zero;
            a[j] = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(v[2 * j]), abs_mask),
                                    _mm512_and_si512(_mm512_castps_si512(v[2 * j + 1]), abs_mask));
        }
        /* as `quantize_row`: codes 0 where L/amax is not finite (e 0) or the block holds a NaN
         * or an infinity (e NaN) */
        const __m512i abits = max4(a);
        const __m512 amax = _mm512_castsi512_ps(abits);
        const __mmask16 bad = _mm512_cmpge_epi32_mask(abits, _mm512_set1_epi32(NONFINITE));
        __m512 iv = _mm512_div_ps(lv, amax);
        const __mmask16 ok = _mm512_cmp_ps_mask(iv, _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ) & ~bad;
        iv = _mm512_maskz_mov_ps(ok, iv);
        if (bad) /* rare: the codes of a block with a NaN or an infinity are zeros */
            for (int j = 0; j < 4; ++j)
                if (bad >> (4 * j) & 1) v[2 * j] = v[2 * j + 1] = zero;
        __m512i s[4];
        for (int j = 0; j < 4; ++j) {
            const __m512 ivj = _mm512_shuffle_f32x4(iv, iv, 0x55 * j);
            const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[2 * j], ivj), rnd);
            const __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[2 * j + 1], ivj), rnd);
            s[j] = _mm512_add_epi32(i0, i1);
            if (j >= n) continue;
            const int64_t o = (b0 + j) * QK;
            if (mode == Q_INT16) { /* elements 0-7,16-23 then 8-15,24-31 (see quantize_row) */
                const __m256i c0 = _mm512_cvtepi32_epi16(i0), c1 = _mm512_cvtepi32_epi16(i1);
                _mm256_storeu_si256((__m256i *)(q16 + o), _mm256_permute2x128_si256(c0, c1, 0x20));
                _mm256_storeu_si256((__m256i *)(q16 + o + 16), _mm256_permute2x128_si256(c0, c1, 0x31));
            } else if (mode == Q_HILO) {
                const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(i0, half), 8);
                const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(i1, half), 8);
                const __m512i l0 = _mm512_sub_epi32(i0, _mm512_slli_epi32(h0, 8));
                const __m512i l1 = _mm512_sub_epi32(i1, _mm512_slli_epi32(h1, 8));
                _mm_storeu_si128((__m128i *)(q8 + o), _mm512_cvtepi32_epi8(h0));
                _mm_storeu_si128((__m128i *)(q8 + o + 16), _mm512_cvtepi32_epi8(h1));
                _mm_storeu_si128((__m128i *)(lo + o), _mm512_cvtepi32_epi8(l0));
                _mm_storeu_si128((__m128i *)(lo + o + 16), _mm512_cvtepi32_epi8(l1));
            } else {
                _mm_storeu_si128((__m128i *)(q8 + o), _mm512_cvtepi32_epi8(i0));
                _mm_storeu_si128((__m128i *)(q8 + o + 16), _mm512_cvtepi32_epi8(i1));
            }
        }
        const __m512i total = sum4(s);
        const __m512 d = _mm512_mask_mov_ps(_mm512_maskz_div_ps(ok, amax, lv), bad, _mm512_set1_ps(NAN));
        const __mmask16 keep = (__mmask16)((1u << n) - 1);
        _mm512_mask_storeu_ps(e + b0, keep, _mm512_permutexvar_ps(firsts, d));
        _mm512_mask_storeu_ps(es + b0, keep, _mm512_permutexvar_ps(firsts, _mm512_mul_ps(d, _mm512_cvtepi32_ps(total))));
        if (is) _mm512_mask_storeu_epi32(is + b0, keep, _mm512_permutexvar_epi32(firsts, total));
    }
}

/* Eight int32 vectors to one: lane c holds the sum of all of d[c]'s lanes. */
static inline __m256i reduce8(__m256i d0, __m256i d1, __m256i d2, __m256i d3, __m256i d4,
                              __m256i d5, __m256i d6, __m256i d7) {
    const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
    const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d4, d5), _mm256_hadd_epi32(d6, d7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                            _mm256_permute2x128_si256(q0, q1, 0x31));
}

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The integer-dot kernels (few rows): compiled twice, AVX2 and AVX-512 VNNI, picked per call. */
#define DOTS(name) name
#include "lowbit_dots.h"
#undef DOTS
#define DOTS_VNNI 1
#define DOTS(name) name##_vnni
#include "lowbit_dots.h"
#undef DOTS
#undef DOTS_VNNI

/* ---- AMX: 4-bit weights times int16 activations from 16 rows, on Intel's tile unit ---------
 * Where the CPU has AMX-INT8 (Sapphire Rapids and later) and Linux grants the tile state, a
 * `fine` 4-bit GEMM takes its rows sixteen at a time through the tile unit: per 32-weight
 * block, one tile of sixteen rows' high activation bytes and one of their low bytes (32 bytes
 * a row, read in place from the quantised rows), one tile of sixteen columns' codes (the
 * VNNI copy's two unpacked tiles, `w[0..7]`, are already the tile unit's layout: row q holds
 * each column's weights 4q..4q+3), and `tdpbssd` gives each (row, column) its exact int32 dot,
 * high and low. Then each row's sums go through what `tile16_vnni` does with its own: 256
 * times the high dot plus the low one, converted and scaled by the block's d e into the row's
 * accumulator, m es into its correction, block after block, so the bits are the VNNI
 * copy's. Rows past the last sixteen and a thread's lone last column tile go to the VNNI
 * copy. One tile of codes serves every sixteen-row group of a row stretch.
 * The per-block float work (a store of each tile's sums, then per row: shift, add, convert,
 * two FMAs) is most of the time: the tile unit does a block's 16 x 16 x 32 dots in two
 * instructions where the VNNI copy spends sixteen `vpdpbusd` a row. Measured on SmolLM2's
 * projections (2 threads of an Intel Xeon with AMX, same bits): 1.1-1.27x the VNNI dots'
 * GMAC/s at 16-512 rows, and the engine's prompt steps 1303 against 1157 tok/s (medians of
 * five alternating rounds, same tokens). Keeping all blocks' sums and scaling each row in
 * registers afterwards (no accumulator stores) ran 0.74-0.97x: the sums' round trip through
 * L2 and one FMA chain a row cost more than they saved. */
#define AMX_FN __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
#define AMX_ROWS 16
#define AMX_STRETCH 128 /* rows whose accumulators (16 columns, 8 KiB each way) stay in L1 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

/* Whether 4-bit `fine` GEMMs of 16 rows or more use AMX: -1 until the first asks, then 0 or 1;
 * `kvg_amx` sets or reads it. */
static int amx_on = -1;

static int amx_supported(void) {
    static int granted = -1;
    if (granted < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        const int cpu = (d >> 24 & 1) && (d >> 25 & 1); /* AMX-TILE, AMX-INT8 */
        /* Linux hands out the tile state only to a process that asks (arch_prctl
         * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the grant covers every thread */
        granted = cpu && vnni_supported() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return granted;
}

int kvg_amx(int on) { return kvg_switch(&amx_on, amx_supported, on); }

static AMX_FN void amx_begin(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    /* sums (high, low) of an even row group in 0 and 1, of an odd one in 5 and 6; their
     * activations in 2 and 3 (high, then low, bytes); the codes in 4 */
    for (int t = 0; t < 8; ++t) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
    c.colsb[2] = c.colsb[3] = QK;
    c.rows[4] = QK / 4; /* a block's 8 quads x 16 columns x 4 */
    _tile_loadconfig(&c);
}

#define AMX_SUMS (2 * AMX_ROWS * 16) /* int32s a row group leaves a block: high, low */

/* Two row groups' dots with the codes in tmm4: sums of group 2i in tiles 0/1, 2i+1 in 5/6,
 * each issued before the other's results are stored, so one's dots run while the other's
 * results leave. */
#define AMX_DOTS(C_HI, C_LO, A, xrow)                                                        \
    _tile_zero(C_HI);                                                                        \
    _tile_zero(C_LO);                                                                        \
    _tile_loadd(A, xh + (xrow), K);                                                          \
    _tile_dpbssd(C_HI, A, 4);                                                                \
    _tile_loadd(A, xl + (xrow), K);                                                          \
    _tile_dpbssd(C_LO, A, 4);

/* A row group's integer sums (high, low, from tiles C_HI and C_LO, stored to `sums`) into its
 * rows' accumulators: what `tile16_vnni` does with its own sums, in its order. */
static inline __attribute__((always_inline)) AMX_FN void amx_scale(const int32_t *sums,
    int64_t row, int64_t nb, int64_t b, __m512 dv, __m512 mv, int has_m, const float *xe,
    const float *xes, float *acc, float *corr) {
    for (int r = 0; r < AMX_ROWS; ++r) {
        const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums + 16 * r), 8),
                                           _mm512_load_si512(sums + AMX_SUMS / 2 + 16 * r));
        __m512 a = _mm512_load_ps(acc + 16 * r), c = _mm512_load_ps(corr + 16 * r);
        scale16(s, dv, mv, has_m, xe[(row + r) * nb + b], xes[(row + r) * nb + b], &a, &c);
        _mm512_store_ps(acc + 16 * r, a);
        if (has_m) _mm512_store_ps(corr + 16 * r, c);
    }
}

/* Sixteen columns (tiles t and t + 1, `tile_bytes` apart) for rows m0..m1 (m1 - m0 a multiple of
 * 16, at most AMX_STRETCH), into out. Per block the codes are unpacked and loaded once for all
 * the stretch's row groups; two groups' dots are in flight at a time (tiles 0/1 and 5/6), each
 * group's sums scaled while the next group's dots run. `acc` holds 2 * AMX_STRETCH * 16
 * floats. */
static AMX_FN void amx_pair(int64_t m0, int64_t m1, int64_t K, const int8_t *xh, const int8_t *xl,
                            const float *xe, const float *xes, const uint8_t *wc,
                            int64_t tile_bytes, const uint16_t *wd, const uint16_t *wm,
                            const uint16_t *wd1, const uint16_t *wm1, int64_t bpg, float *out,
                            int64_t ldo, float *acc) {
    const int64_t nb = K / QK, rows = m1 - m0, groups = rows / AMX_ROWS;
    float *corr = acc + AMX_STRETCH * 16;
    const int has_m = wm != NULL;
    int32_t sums[2][AMX_SUMS] __attribute__((aligned(64)));
    __m512i codes[8] __attribute__((aligned(64)));
    for (int64_t i = 0; i < rows * 16; i += 16)
        _mm512_store_ps(acc + i, _mm512_setzero_ps()), _mm512_store_ps(corr + i, _mm512_setzero_ps());
    __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    int64_t g = 0, k = 0; /* group of block b, and b's place in it */
    for (int64_t b = 0; b < nb; ++b) {
        if (k == 0) {
            dv = cols16(wd + g * 8, wd1 + g * 8);
            if (has_m) mv = cols16(wm + g * 8, wm1 + g * 8);
        }
        const uint8_t *p = wc + b * (8 * QK / 2);
        unpack16(p, p + tile_bytes, codes);
        __asm__ volatile("" ::: "memory"); /* tileloadd reads memory GCC does not see it read */
        _tile_loadd(4, codes, 64);
        const int64_t x = m0 * K + b * QK, step = AMX_ROWS * K;
        AMX_DOTS(0, 1, 2, x)
        for (int64_t i = 0; i < groups; i += 2) {
            if (i + 1 < groups) {
                AMX_DOTS(5, 6, 3, x + (i + 1) * step)
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[0] + AMX_SUMS / 2, 64);
            if (i + 2 < groups) {
                AMX_DOTS(0, 1, 2, x + (i + 2) * step)
            }
            amx_scale(sums[0], m0 + i * AMX_ROWS, nb, b, dv, mv, has_m, xe, xes,
                      acc + i * AMX_ROWS * 16, corr + i * AMX_ROWS * 16);
            if (i + 1 < groups) {
                _tile_stored(5, sums[1], 64);
                _tile_stored(6, sums[1] + AMX_SUMS / 2, 64);
                amx_scale(sums[1], m0 + (i + 1) * AMX_ROWS, nb, b, dv, mv, has_m, xe, xes,
                          acc + (i + 1) * AMX_ROWS * 16, corr + (i + 1) * AMX_ROWS * 16);
            }
        }
        if (++k == bpg) {
            k = 0;
            ++g;
        }
    }
    for (int64_t i = 0; i < rows; ++i)
        _mm512_storeu_ps(out + (m0 + i) * ldo,
                         _mm512_add_ps(_mm512_load_ps(acc + 16 * i), _mm512_load_ps(corr + 16 * i)));
}
#undef AMX_DOTS

/* A thread's column tiles t0..t1 of a `fine` 4-bit GEMM: pairs of tiles through AMX for the
 * rows in whole sixteens, the rest (a lone last tile, a pair holding padding columns, the last
 * M % 16 rows) on the VNNI dots, as is everything where the workspace cannot be had. */
static AMX_FN void columns_amx(int64_t M, int64_t K, const int8_t *xh, const int8_t *xl,
                               const float *xe, const float *xes, const uint8_t *wc,
                               const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t bpg,
                               int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const int64_t nb = K / QK, groups = nb / bpg, tile_bytes = 8 * K / 2;
    int64_t whole = M / AMX_ROWS * AMX_ROWS;
    const int64_t pairs_end = t0 + (t1 - t0) / 2 * 2;
    float *ws = aligned_alloc(64, 2 * AMX_STRETCH * 16 * sizeof(float));
    if (!ws) whole = 0;
    __asm__ volatile("" ::: "memory"); /* the quantised rows are in memory before the loads */
    if (whole) amx_begin();
    for (int64_t r0 = 0; r0 < whole; r0 += AMX_STRETCH) {
        const int64_t r1 = r0 + AMX_STRETCH < whole ? r0 + AMX_STRETCH : whole;
        for (int64_t t = t0; t < pairs_end; t += 2) {
            const uint16_t *d = wd + t * groups * 8, *m = wm ? wm + t * groups * 8 : NULL;
            const int64_t next = groups * 8;
            if (N - t * 8 < 16) { /* the last pair holds padding columns: VNNI's masked store */
                columns_vnni(4, 1, r1 - r0, K, xh + r0 * K, xl + r0 * K, xe + r0 * nb,
                             xes + r0 * nb, NULL, wc, wd, wm, N, bpg, t, t + 2, out + r0 * ldo,
                             ldo);
                continue;
            }
            amx_pair(r0, r1, K, xh, xl, xe, xes, wc + t * tile_bytes, tile_bytes, d, m, d + next,
                     m ? m + next : NULL, bpg, out + t * 8, ldo, ws);
        }
    }
    if (whole) _tile_release();
    free(ws);
    if (pairs_end < t1 && whole) /* a lone last tile */
        columns_vnni(4, 1, whole, K, xh, xl, xe, xes, NULL, wc, wd, wm, N, bpg, pairs_end, t1,
                     out, ldo);
    if (whole < M)
        columns_vnni(4, 1, M - whole, K, xh + whole * K, xl + whole * K, xe + whole * nb,
                     xes + whole * nb, NULL, wc, wd, wm, N, bpg, t0, t1, out + whole * ldo, ldo);
}

/* ---- fp32 panels: the `fine` GEMM from `kvg_panel_rows` activation rows ----------------------
 * int16 activations cost two `vpmaddubsw` (high and low bytes) per 32 multiply-adds, plus the
 * int16 sums, their widening and the per-block scaling: at best what fp32 FMAs do (eight a
 * pipe, two pipes), and well below it in practice. Once enough rows share it, dequantising the
 * weight costs less than quantising the activations: each thread turns sixteen output columns
 * at a time into an fp32 panel [K][16] (w = d*q + m; 36-96 KiB for K 576-1536, in L2) and
 * multiplies the activations, unquantised, by it: six rows a step in twelve accumulators, k in
 * stretches of PANEL_KC whose panel rows stay in L1 while every six-row group passes, rows in
 * chunks of PANEL_MC so a chunk's activations stay cached across the thread's panels (a panel
 * is dequantised once per chunk). No whole-matrix copy is written. Measured on SmolLM2's
 * projections (2 threads; 4-bit and 8-bit codes alike, crossing over just below 16 rows):
 * 1.2-1.5x the int16 dots from 32 rows, level with a dequantised weight plus MKL's sgemm at a
 * thousand rows and well ahead of it below. */
#define PANEL 16
#define PANEL_ROWS 6
#define PANEL_KC 256
#define PANEL_MC 192

/* Eight 4-bit columns (one tile) into panel columns p[k*PANEL + 0..7]. */
static void panel4(const uint8_t *wc, const uint16_t *wd, const uint16_t *wm, int64_t nb,
                   int64_t bpg, float *p) {
    /* within a 128-bit lane, byte 4c+i (column c, weight i) to byte 4i+c */
    const __m256i by_weight = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                               0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t g = b / bpg;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g * 8)));
        const __m256 mv = wm ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g * 8)))
                             : _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wc + b * (8 * QK / 2) + 32 * j));
            for (int half = 0; half < 2; ++half) { /* low nibbles: weights 8j+i, high: 8j+4+i */
                const __m256i q = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4)
                                       : _mm256_and_si256(v, lo4);
                /* eight bytes per weight i, columns 0..7 in order */
                const __m256i t = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, by_weight), order);
                const __m128i a = _mm256_castsi256_si128(t), c = _mm256_extracti128_si256(t, 1);
                const __m128i r[4] = {a, _mm_srli_si128(a, 8), c, _mm_srli_si128(c, 8)};
                float *o = p + (b * QK + 8 * j + 4 * half) * PANEL;
                for (int i = 0; i < 4; ++i)
                    _mm256_storeu_ps(o + i * PANEL,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(r[i])), dv, mv));
            }
        }
    }
}

/* Eight 8-bit columns (codes of column c at wc + c*K) into panel columns p[k*PANEL + 0..7]:
 * eight codes of each column to floats, an 8x8 transpose, then d*q + m per column. */
static void panel8(const uint8_t *wc, const uint16_t *wd, const uint16_t *wm, int64_t K,
                   int64_t bpg, float *p) {
    for (int64_t k = 0; k < K; k += 8) {
        const int64_t g = k / QK / bpg;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g * 8)));
        const __m256 mv = wm ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g * 8)))
                             : _mm256_setzero_ps();
        __m256 r[8], s[8], t[8];
        for (int c = 0; c < 8; ++c)
            r[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wc + c * K + k))));
        for (int c = 0; c < 8; c += 2) {
            s[c] = _mm256_unpacklo_ps(r[c], r[c + 1]);
            s[c + 1] = _mm256_unpackhi_ps(r[c], r[c + 1]);
        }
        for (int c = 0; c < 8; c += 4)
            for (int h = 0; h < 2; ++h) {
                t[c + h] = _mm256_shuffle_ps(s[c + h], s[c + 2 + h], 0x44);
                t[c + 2 + h] = _mm256_shuffle_ps(s[c + h], s[c + 2 + h], 0xee);
            }
        /* t[0..3]: weights (0,4) (2,6) (1,5) (3,7) of columns 0-3 | of the same, columns 4-7 */
        static const int at[4] = {0, 2, 1, 3};
        for (int i = 0; i < 4; ++i) {
            const __m256 lo = _mm256_permute2f128_ps(t[at[i]], t[4 + at[i]], 0x20);
            const __m256 hi = _mm256_permute2f128_ps(t[at[i]], t[4 + at[i]], 0x31);
            _mm256_storeu_ps(p + (k + i) * PANEL, _mm256_fmadd_ps(lo, dv, mv));
            _mm256_storeu_ps(p + (k + 4 + i) * PANEL, _mm256_fmadd_ps(hi, dv, mv));
        }
    }
}

/* Panel q of a GEMM's weight: its two column tiles (2q, 2q + 1) into p[K][PANEL], the second
 * half zero where the tile count is odd. */
static void fill_panel(const int bits, const uint8_t *wc, const uint16_t *wd, const uint16_t *wm,
                       int64_t q, int64_t tiles, int64_t K, int64_t bpg, float *p) {
    const int64_t nb = K / QK, groups = nb / bpg, tile_bytes = 8 * (bits == 4 ? K / 2 : K);
    for (int h = 0; h < 2; ++h) {
        const int64_t tl = 2 * q + h;
        if (tl >= tiles) {
            for (int64_t k = 0; k < K; ++k) _mm256_store_ps(p + k * PANEL + 8, _mm256_setzero_ps());
            continue;
        }
        const uint16_t *d = wd + tl * groups * 8, *m = wm ? wm + tl * groups * 8 : NULL;
        if (bits == 4) panel4(wc + tl * tile_bytes, d, m, nb, bpg, p + 8 * h);
        else panel8(wc + tl * tile_bytes, d, m, K, bpg, p + 8 * h);
    }
}

/* out[rows][0..valid) (+)= x[rows][k0..k1) times the panel's rows k0..k1; `rows` 1..PANEL_ROWS,
 * a constant once inlined; `add`: accumulate onto what an earlier stretch of k wrote. */
static inline __attribute__((always_inline)) void panel_block(const int rows, const float *x,
                                                              int64_t ldx, const float *p, int64_t k0,
                                                              int64_t k1, int add, float *out,
                                                              int64_t ldo, int64_t valid) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid - 8), lane);
    __m256 a[PANEL_ROWS][2];
    for (int r = 0; r < rows; ++r) {
        if (!add) a[r][0] = a[r][1] = _mm256_setzero_ps();
        else if (valid >= PANEL) {
            a[r][0] = _mm256_loadu_ps(out + r * ldo);
            a[r][1] = _mm256_loadu_ps(out + r * ldo + 8);
        } else {
            a[r][0] = _mm256_maskload_ps(out + r * ldo, m0);
            a[r][1] = _mm256_maskload_ps(out + r * ldo + 8, m1);
        }
    }
    for (int64_t k = k0; k < k1; ++k) {
        const __m256 w0 = _mm256_load_ps(p + k * PANEL), w1 = _mm256_load_ps(p + k * PANEL + 8);
        for (int r = 0; r < rows; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        if (valid >= PANEL) {
            _mm256_storeu_ps(out + r * ldo, a[r][0]);
            _mm256_storeu_ps(out + r * ldo + 8, a[r][1]);
        } else {
            _mm256_maskstore_ps(out + r * ldo, m0, a[r][0]);
            _mm256_maskstore_ps(out + r * ldo + 8, m1, a[r][1]);
        }
    }
}

static int gemm_panels(const int bits, const float *x, int64_t M, int64_t K, int64_t ldx,
                       const uint8_t *wc, const uint16_t *wd, const uint16_t *wm, int64_t N,
                       int64_t bpg, float *out, int64_t ldo, int threads) {
    const int64_t tiles = (N + 7) / 8, panels = (tiles + 1) / 2;
    if (threads > panels) threads = (int)panels;
    const size_t pbytes = ((size_t)K * PANEL * sizeof(float) + 63) & ~(size_t)63;
    char *ws = aligned_alloc(64, pbytes * (size_t)threads);
    if (!ws) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t, T;
        team_place(&t, &T);
        float *p = (float *)(ws + pbytes * (size_t)t);
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        /* chunks of rows: a panel is dequantised once per chunk, and the chunk's activations
         * stay in cache while every panel of the thread passes over them */
        for (int64_t c0 = 0; c0 < M; c0 += PANEL_MC) {
            const int64_t c1 = c0 + PANEL_MC < M ? c0 + PANEL_MC : M;
            for (int64_t q = p0; q < p1; ++q) {
                fill_panel(bits, wc, wd, wm, q, tiles, K, bpg, p);
                const int64_t valid = N - q * PANEL;
                /* stretches of k whose panel rows stay in L1 while every row group passes */
                for (int64_t k0 = 0; k0 < K; k0 += PANEL_KC) {
                    const int64_t k1 = k0 + PANEL_KC < K ? k0 + PANEL_KC : K;
                    for (int64_t m0 = c0; m0 < c1; m0 += PANEL_ROWS) {
                        const float *xr = x + m0 * ldx;
                        float *o = out + m0 * ldo + q * PANEL;
                        const int add = k0 > 0;
                        switch (c1 - m0 < PANEL_ROWS ? c1 - m0 : PANEL_ROWS) {
                        case 6: panel_block(6, xr, ldx, p, k0, k1, add, o, ldo, valid); break;
                        case 5: panel_block(5, xr, ldx, p, k0, k1, add, o, ldo, valid); break;
                        case 4: panel_block(4, xr, ldx, p, k0, k1, add, o, ldo, valid); break;
                        case 3: panel_block(3, xr, ldx, p, k0, k1, add, o, ldo, valid); break;
                        case 2: panel_block(2, xr, ldx, p, k0, k1, add, o, ldo, valid); break;
                        default: panel_block(1, xr, ldx, p, k0, k1, add, o, ldo, valid); break;
                        }
                    }
                }
            }
        }
    }
    free(ws);
    return 0;
}

/* ---- AMX-BF16: prompt rows of 4-bit weights in fp32 accumulators on the tile unit ----------
 * The integer tiles above still scale every block's sums in floats (a group of 32 weights has
 * its own d and m). This path folds the scales into the weights instead, as the fp32 panels do
 * (`panel4`: sixteen columns dequantised, w = d q + m), and gives the tile unit the weights and
 * the activations each as two bf16 parts, v = hi + lo (hi: v with its low 16 bits cut, exact;
 * lo: the rest rounded to bf16), so v is held to about 2^-16 of itself. `tdpbf16ps` then sums
 * hi*hi + hi*lo + lo*hi (the lo*lo term is below 2^-16 relative) into one fp32 tile per
 * sixteen rows and columns over the whole K: no per-block float work at all. Its products are
 * exact in fp32 and its sums fp32, so the result sits as close to the fp32 panels' (the
 * unquantised activations times the stored weight) as fp32 sums of another order do. */
#define BF_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
#define BF_GROUP 32                /* rows two C tiles hold */
/* From this many rows: the panels' dequantisation is shared by enough rows (SmolLM2's
 * projections, 2 threads: 0.6-1.0x the integer tiles at 48-64 rows, 1.1-1.4x at 96, 1.27-1.34x
 * from 128) */
#define BF_MIN_ROWS 128
#define BF_STRETCH_BYTES (1 << 20) /* activations (hi + lo) a row stretch keeps in L2 */

static int amx_bf16_on = -1;

static int amx_bf16_supported(void) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return (d >> 22 & 1) && amx_supported(); /* AMX-BF16, and the tile state granted */
}

int kvg_amx_bf16(int on) { return kvg_switch(&amx_bf16_on, amx_bf16_supported, on); }

/* 16 floats split: hi (bits with the low half cut) and lo (the remainder, rounded to nearest
 * even), each as the top 16 bits of its 32-bit lane. */
static inline __attribute__((always_inline)) BF_FN void bf_split(__m512 v, __m512i *hi, __m512i *lo) {
    const __m512i bits = _mm512_castps_si512(v), top = _mm512_set1_epi32((int)0xffff0000u);
    *hi = _mm512_and_si512(bits, top);
    const __m512i r = _mm512_castps_si512(_mm512_sub_ps(v, _mm512_castsi512_ps(*hi)));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(r, 16), _mm512_set1_epi32(1));
    *lo = _mm512_and_si512(_mm512_add_epi32(r, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), top);
}

/* Rows of x (fp32) as bf16 hi and lo parts, row-major [rows][K] each. */
static BF_FN void bf_rows(const float *x, int64_t rows, int64_t K, int64_t ldx, uint16_t *xh,
                          uint16_t *xl) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < K; k += 32) {
            __m512i h0, l0, h1, l1;
            bf_split(_mm512_loadu_ps(x + i * ldx + k), &h0, &l0);
            bf_split(_mm512_loadu_ps(x + i * ldx + k + 16), &h1, &l1);
            /* each lane's top half, packed: 16 bf16 */
            _mm256_storeu_si256((__m256i *)(xh + i * K + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h0, 16)));
            _mm256_storeu_si256((__m256i *)(xh + i * K + k + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h1, 16)));
            _mm256_storeu_si256((__m256i *)(xl + i * K + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(l0, 16)));
            _mm256_storeu_si256((__m256i *)(xl + i * K + k + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(l1, 16)));
        }
}

/* An fp32 panel p[K][16] as the tile unit's B operand, hi and lo: row j of a 32-deep slice holds
 * each column's weights 2j and 2j+1 (a bf16 pair in a 32-bit lane), slices 1 KiB apart. */
static BF_FN void bf_panel(const float *p, int64_t K, uint32_t *bh, uint32_t *bl) {
    for (int64_t k = 0; k < K; k += 2) {
        __m512i h0, l0, h1, l1;
        bf_split(_mm512_load_ps(p + k * PANEL), &h0, &l0);
        bf_split(_mm512_load_ps(p + (k + 1) * PANEL), &h1, &l1);
        _mm512_store_si512(bh + k / 2 * 16, _mm512_or_si512(h1, _mm512_srli_epi32(h0, 16)));
        _mm512_store_si512(bl + k / 2 * 16, _mm512_or_si512(l1, _mm512_srli_epi32(l0, 16)));
    }
}

static BF_FN void bf_begin(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    /* 0, 1: sums of rows 0-15 and 16-31; 2, 3: their activations' hi and lo for rows 0-15,
     * 4, 5 for rows 16-31; 6, 7: the weights' hi and lo */
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

#define BF_TILE(C, AH, AL, row)                                                               \
    _tile_loadd(AH, xh + (row) * K + s * 32, 2 * K);                                          \
    _tile_loadd(AL, xl + (row) * K + s * 32, 2 * K);                                          \
    _tile_dpbf16ps(C, AH, 6);                                                                 \
    _tile_dpbf16ps(C, AH, 7);                                                                 \
    _tile_dpbf16ps(C, AL, 6);

/* out = x W^T for 4-bit codes, from BF_GROUP rows: see above. Returns 0, or -1 when the
 * workspace could not be allocated (nothing written). */
static BF_FN int gemm_amx_bf16(const float *x, int64_t M, int64_t K, int64_t ldx,
                               const uint8_t *wc, const uint16_t *wd, const uint16_t *wm,
                               int64_t N, int64_t bpg, float *out, int64_t ldo, int threads) {
    const int64_t tiles = (N + 7) / 8, panels = (tiles + 1) / 2;
    const int64_t Mpad = (M + BF_GROUP - 1) / BF_GROUP * BF_GROUP;
    int64_t stretch = BF_STRETCH_BYTES / (4 * K) / BF_GROUP * BF_GROUP;
    if (stretch < BF_GROUP) stretch = BF_GROUP;
    if (threads > panels) threads = (int)panels;
    if (threads < 1) threads = 1;
    const size_t xbytes = ((size_t)(Mpad * K) * sizeof(uint16_t) + 63) & ~(size_t)63;
    /* a thread's fp32 panel, its hi and lo tiles, and a 32 x 16 spill for partial tiles */
    const size_t own = (size_t)K * PANEL * sizeof(float) * 2 + 32 * 16 * sizeof(float);
    char *ws = aligned_alloc(64, 2 * xbytes + own * (size_t)threads);
    if (!ws) return -1;
    uint16_t *xh = (uint16_t *)ws, *xl = (uint16_t *)(ws + xbytes);
    memset(xh + M * K, 0, (size_t)((Mpad - M) * K) * sizeof(uint16_t));
    memset(xl + M * K, 0, (size_t)((Mpad - M) * K) * sizeof(uint16_t));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t, T;
        team_place(&t, &T);
        const int64_t r0 = M * t / T, r1 = M * (t + 1) / T;
        bf_rows(x + r0 * ldx, r1 - r0, K, ldx, xh + r0 * K, xl + r0 * K);
#pragma omp barrier
        float *p = (float *)(ws + 2 * xbytes + own * (size_t)t);
        uint32_t *bh = (uint32_t *)(p + K * PANEL), *bl = bh + K / 2 * 16;
        float *spill = (float *)(bl + K / 2 * 16);
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        __asm__ volatile("" ::: "memory");
        bf_begin();
        for (int64_t c0 = 0; c0 < Mpad; c0 += stretch) {
            const int64_t c1 = c0 + stretch < Mpad ? c0 + stretch : Mpad;
            for (int64_t q = p0; q < p1; ++q) {
                fill_panel(4, wc, wd, wm, q, tiles, K, bpg, p);
                bf_panel(p, K, bh, bl);
                __asm__ volatile("" ::: "memory");
                const int64_t valid = N - q * PANEL < PANEL ? N - q * PANEL : PANEL;
                for (int64_t m0 = c0; m0 < c1; m0 += BF_GROUP) {
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int64_t s = 0; s < K / 32; ++s) {
                        _tile_loadd(6, bh + s * 256, 64);
                        _tile_loadd(7, bl + s * 256, 64);
                        BF_TILE(0, 2, 3, m0)
                        BF_TILE(1, 4, 5, m0 + 16)
                    }
                    float *o = out + m0 * ldo + q * PANEL;
                    if (valid == PANEL && m0 + BF_GROUP <= M) {
                        _tile_stored(0, o, 4 * ldo);
                        _tile_stored(1, o + 16 * ldo, 4 * ldo);
                    } else { /* padding rows or columns: through the spill */
                        _tile_stored(0, spill, 64);
                        _tile_stored(1, spill + 256, 64);
                        const __mmask16 mask = (__mmask16)((1u << valid) - 1);
                        for (int64_t r = 0; r < BF_GROUP && m0 + r < M; ++r)
                            _mm512_mask_storeu_ps(o + r * ldo, mask, _mm512_load_ps(spill + 16 * r));
                    }
                }
            }
        }
        _tile_release();
    }
    free(ws);
    return 0;
}
#undef BF_TILE

/* ---- which kernel a row takes -------------------------------------------------------------
 * The kernels differ in their bits: the integer dots (AVX2 or VNNI, and the AMX integer tiles,
 * which give the VNNI dots' bits) quantise the activations, the fp32 panels do not, the bf16
 * tiles round them otherwise again. Each computes a row alone (a row's bits do not depend on
 * which rows share its call: tiles of rows, row groups and the panels' chunks never mix rows),
 * so a row's result is fixed by the kernel it takes. That kernel follows the row's kind:
 *   prompt rows (prefill chunks) take the kernel a GEMM of unbounded rows would: the panels
 *     wherever panels serve at all (the panel threshold below `INT32_MAX`), else the bf16
 *     tiles where they are on (4-bit codes), else the dots. How long the chunk is, whether
 *     part of the prompt came from the prefix cache, or what decodes beside it never changes
 *     them;
 *   short-prompt rows (prefill chunks of a prompt shorter than the runner's threshold,
 *     `cpu_lowbit.bf16_min_prompt()`: the runner decides by the whole prompt, never the chunk)
 *     take the prompt kernel with the bf16 tiles off: a bf16 call dequantises every weight it
 *     reads whatever its row count, which a few rows never earn back;
 *   decode rows (a sequence's last token, and the speculative drafts verified after it) by the
 *     count the caller gives: the step's decoding sequences, so that verify rows take what
 *     plain decode of those sequences takes, and a prompt chunk joining the step changes
 *     nothing for them.
 * A step lays its rows out as decode rows, short-prompt rows, then prompt rows; each run of
 * adjacent kinds that pick the same kernel is one call (one call where no kinds differ, as on
 * CPUs without AMX-BF16, where short and long prompts pick alike). int8 activations (not
 * `fine`) have one kernel, the dots, at any batch. */
enum { KVG_DOTS = 0, KVG_PANELS = 1, KVG_BF16 = 2 };
/* `kvg_pick_kernel`'s kinds of rows */
enum { KVG_DECODE_ROWS = 0, KVG_PROMPT_ROWS = 1, KVG_SHORT_PROMPT_ROWS = 2 };

/* The kernel for rows of one kind (`prompt`: KVG_PROMPT_ROWS, KVG_SHORT_PROMPT_ROWS, or
 * KVG_DECODE_ROWS picking by `count`); `vnni` and `bf16` (AMX-BF16 tiles on) say which paths
 * this process runs (arguments, so that a test can ask for CPUs it does not run on). Returns
 * KVG_DOTS, KVG_PANELS or KVG_BF16. */
int kvg_pick_kernel(int bits, int fine, int64_t count, int prompt, int vnni, int bf16) {
    if (!fine || bits == BITS_8V)
        return KVG_DOTS;
    if (prompt == KVG_SHORT_PROMPT_ROWS) {
        prompt = KVG_PROMPT_ROWS;
        bf16 = 0;
    }
    const int from = vnni && bits == 4 ? kvg_panel_rows_vnni4 : kvg_panel_rows;
    if (from < INT32_MAX && (prompt || count >= from))
        return KVG_PANELS;
    if (bits == 4 && vnni && bf16 && (prompt || count >= BF_MIN_ROWS))
        return KVG_BF16;
    return KVG_DOTS;
}

/* out[M][ldo] (first N columns) = x[M][K] (row stride ldx) times W^T through `kernel` (the
 * bf16 tiles falling back to the dots where their workspace cannot be had); returns 0, -1
 * when the workspace could not be allocated. The codes and the scales hold ceil(N/8)*8
 * columns (padding columns are zero). `fine`: int16 activations. */
static int gemm_with(const int kernel, const int bits, const float *x, int64_t M, int64_t K,
                     int64_t ldx, const uint8_t *wc, const uint16_t *wd, const uint16_t *wm,
                     int64_t N, int64_t bpg, float *out, int64_t ldo, int threads, int fine) {
    const int vnni = kvg_vnni(-1) == 1, amx = vnni && kvg_amx(-1) == 1;
    if (kernel == KVG_PANELS)
        return gemm_panels(bits, x, M, K, ldx, wc, wd, wm, N, bpg, out, ldo, threads);
    if (kernel == KVG_BF16 && gemm_amx_bf16(x, M, K, ldx, wc, wd, wm, N, bpg, out, ldo, threads) == 0)
        return 0;
    const int64_t nb = K / QK, tiles = (N + 7) / 8;
    const int mode = !fine ? Q_INT8 : bits == 4 ? Q_HILO : Q_INT16;
    if (threads > tiles) threads = (int)tiles;
    /* A few rows (decode) are quantised by every thread into its own copy, so the only
     * synchronisation is the region's end: each barrier is a chance to wait a whole
     * scheduler slice when the cores are oversubscribed. Many rows are split, then a barrier. */
    const int own = M <= 4 && threads > 1;
    const size_t qbytes = ((size_t)(M * K) * (mode == Q_INT8 ? 1 : 2) + 63) & ~(size_t)63;
    /* the scales e and es, and for vertical 8-bit codes each block's integer sum */
    const size_t per_block = 2 * sizeof(float) + (bits == BITS_8V ? sizeof(int32_t) : 0);
    const size_t region = qbytes + ((M * nb * per_block + 63) & ~(size_t)63);
    char *ws = aligned_alloc(64, region * (own ? (size_t)threads : 1));
    if (!ws) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t, T;
        team_place(&t, &T);
        char *mine = own ? ws + region * (size_t)t : ws;
        int8_t *lo = (int8_t *)mine + M * K; /* Q_HILO: the low bytes after the high ones */
        float *xe = (float *)(mine + qbytes), *xes = xe + M * nb;
        int32_t *xis = bits == BITS_8V ? (int32_t *)(xes + M * nb) : NULL;
        const int64_t r0 = own ? 0 : M * t / T, r1 = own ? M : M * (t + 1) / T;
        for (int64_t i = r0; i < r1; ++i)
            (vnni ? quantize_row512 : quantize_row)(x + i * ldx, K, mode, (int8_t *)mine + i * K,
                (int16_t *)mine + i * K, lo + i * K, xe + i * nb, xes + i * nb, xis ? xis + i * nb : NULL);
        if (!own) {
#pragma omp barrier
        }
        const int64_t t0 = tiles * t / T, t1 = tiles * (t + 1) / T;
        if (t0 < t1 && amx && bits == 4 && fine && M >= AMX_ROWS)
            columns_amx(M, K, (const int8_t *)mine, lo, xe, xes, wc, wd, wm, N, bpg, t0, t1, out,
                        ldo);
        else if (t0 < t1)
            (vnni ? columns_vnni : columns)(bits, fine, M, K, mine, lo, xe, xes, xis, wc, wd, wm,
                                            N, bpg, t0, t1, out, ldo);
    }
    free(ws);
    return 0;
}

/* out = x W^T for a step's rows: rows [0, decode) are decode rows, picking their kernel by
 * `count`, the next `short_rows` short-prompt rows, the rest prompt rows (`kvg_pick_kernel`);
 * a GEMM that knows nothing of a step passes decode = count = M, short_rows = 0 (every row
 * picks by the call's rows). Adjacent kinds that pick the same kernel share one call.
 * Returns 0, -1 when a workspace could not be allocated, -2 on a shape the layout cannot
 * hold. */
static int gemm(const int bits, const float *x, int64_t M, int64_t K, int64_t ldx,
                const uint8_t *wc, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t bpg,
                float *out, int64_t ldo, int threads, int fine, int64_t decode, int64_t count,
                int64_t short_rows) {
    if (K % (2 * QK) || bpg < 1 || (K / QK) % bpg || (bits == BITS_8V && fine)) return -2;
    if (threads < 1) threads = 1;
    if (decode < 0) decode = 0;
    if (decode > M) decode = M;
    if (short_rows < 0) short_rows = 0;
    if (short_rows > M - decode) short_rows = M - decode;
    const int vnni = kvg_vnni(-1) == 1;
    const int bf16 = fine && bits == 4 && vnni && kvg_amx(-1) == 1 && kvg_amx_bf16(-1) == 1;
    /* the three runs of rows, in the step's order: [end of the previous run, end[i]) */
    const int64_t end[3] = {decode, decode + short_rows, M};
    const int kernel[3] = {
        kvg_pick_kernel(bits, fine, count, KVG_DECODE_ROWS, vnni, bf16),
        kvg_pick_kernel(bits, fine, short_rows, KVG_SHORT_PROMPT_ROWS, vnni, bf16),
        kvg_pick_kernel(bits, fine, M - decode - short_rows, KVG_PROMPT_ROWS, vnni, bf16),
    };
    int64_t r0 = 0; /* the first row not yet computed */
    for (int i = 0; i < 3; ++i) {
        if (end[i] == (i ? end[i - 1] : 0))
            continue; /* no rows of this kind */
        /* one call goes on while the next kind that has rows picks the same kernel */
        int next = i + 1;
        while (next < 3 && end[next] == end[next - 1]) ++next;
        if (next < 3 && kernel[next] == kernel[i])
            continue;
        const int rc = gemm_with(kernel[i], bits, x + r0 * ldx, end[i] - r0, K, ldx, wc, wd, wm,
                                 N, bpg, out + r0 * ldo, ldo, threads, fine);
        if (rc) return rc;
        r0 = end[i];
    }
    return 0;
}

int kvg_w4a8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
             const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
             int64_t ldo, int threads, int fine) {
    return gemm(4, x, M, K, ldx, codes, d, m, N, bpg, out, ldo, threads, fine, M, M, 0);
}

int kvg_w8a8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *codes,
             const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
             int64_t ldo, int threads, int fine) {
    return gemm(8, x, M, K, ldx, (const uint8_t *)codes, d, m, N, bpg, out, ldo, threads, fine,
                M, M, 0);
}

/* `kvg_w4a8` and `kvg_w8a8` over a step's rows: the first `decode` are decode rows, picking
 * their kernel by `count` (the step's decoding sequences), the next `short_rows` short-prompt
 * rows, the rest prompt rows. */
int kvg_w4a8_rows(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                  const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
                  int64_t ldo, int threads, int fine, int64_t decode, int64_t count,
                  int64_t short_rows) {
    return gemm(4, x, M, K, ldx, codes, d, m, N, bpg, out, ldo, threads, fine, decode, count,
                short_rows);
}

int kvg_w8a8_rows(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *codes,
                  const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
                  int64_t ldo, int threads, int fine, int64_t decode, int64_t count,
                  int64_t short_rows) {
    return gemm(8, x, M, K, ldx, (const uint8_t *)codes, d, m, N, bpg, out, ldo, threads, fine,
                decode, count, short_rows);
}

/* 8-bit codes in the vertical layout (`pack8v`), int8 activations: the same bits as
 * `kvg_w8a8` with `fine` 0 on the same weights in its row-major layout. */
int kvg_w8a8v(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
              const uint16_t *d, const uint16_t *m, int64_t N, int64_t bpg, float *out,
              int64_t ldo, int threads, int fine) {
    return gemm(BITS_8V, x, M, K, ldx, codes, d, m, N, bpg, out, ldo, threads, fine, M, M, 0);
}

/* The exact logits of chosen columns of a vertical 8-bit weight (`pack8v`): for each row r
 * and each of its `k` ids c = idx[r][j], logits[r][c] = sum over K of w[c] * h[r] in fp32, w
 * = d (q - 128) + m as the embedding's rows dequantise it (d q is exact in fp32: fp16 times
 * an 8-bit integer; one rounding adds m, as fmaf does). A column's 32 codes of a block are
 * eight words 32 bytes apart: one gather, in order. The refined lm_head's last step, which
 * torch spent 1.3 ms on for 32 rows (a row gather, an fp32 copy, an einsum and a scatter). */
void kvg_refine8v(float *logits, int64_t M, int64_t ldl, const float *h, int64_t K, int64_t ldh,
                  const int64_t *idx, int64_t k, const uint8_t *codes, const uint16_t *d,
                  const uint16_t *m, int64_t bpg, int threads) {
    const int64_t nb = K / QK, groups = nb / bpg;
    const __m256i words = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma omp parallel for num_threads(threads) if (threads > 1 && M > 1) schedule(static)
    for (int64_t r = 0; r < M; ++r) {
        const float *x = h + r * ldh;
        for (int64_t j = 0; j < k; ++j) {
            const int64_t c = idx[r * k + j], t = c / 8, col = c % 8;
            const uint8_t *base = codes + t * nb * 8 * QK + 4 * col;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t b = 0; b < nb; ++b) {
                const int64_t g = t * groups * 8 + (b / bpg) * 8 + col;
                const __m256 dv = _mm256_set1_ps(_cvtsh_ss(d[g]));
                const __m256 mv = _mm256_set1_ps(m ? _cvtsh_ss(m[g]) : 0.0f);
                const __m256i q = _mm256_xor_si256(
                    _mm256_i32gather_epi32((const int *)(base + b * 8 * QK), words, 1), flip);
                const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
                const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int i = 0; i < 4; ++i) {
                    const __m256 w = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])), dv, mv);
                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + b * QK + 8 * i), acc[i]);
                }
            }
            logits[r * ldl + c] =
                hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        }
    }
}

/* Every column of vertical 8-bit codes dotted exactly with each of M fp32 rows: out[r][c] for
 * c < N (N a multiple of the 8-column tile), each column's sum taken in the very order
 * `kvg_refine8v` takes it, so a logit is the same bits from either, whatever M or the thread
 * count (threads split the tiles, never a column). A tile's block is read once, as 256
 * contiguous bytes, and transposed four bytes at a time into its eight columns' 32 codes (where
 * `kvg_refine8v` gathers one column's), and each column is dequantised once for up to eight
 * rows: the whole exact head of the returned log-probabilities. */
#define EXACT_ROWS 8
void kvg_exact8v(float *out, int64_t M, int64_t ldo, const float *h, int64_t K, int64_t ldh,
                 int64_t N, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                 int64_t bpg, int threads) {
    const int64_t nb = K / QK, groups = nb / bpg, tiles = N / 8;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t r0 = 0; r0 < M; r0 += EXACT_ROWS) {
            const int64_t rows = M - r0 < EXACT_ROWS ? M - r0 : EXACT_ROWS;
            __m256 acc[8][EXACT_ROWS][4];
            for (int c = 0; c < 8; ++c)
                for (int64_t r = 0; r < rows; ++r)
                    for (int i = 0; i < 4; ++i)
                        acc[c][r][i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const __m256i *blk = (const __m256i *)(codes + (t * nb + b) * 8 * QK);
                __m256i v[8]; /* v[j] dword c: weights 4j..4j+3 of column c */
                for (int j = 0; j < 8; ++j)
                    v[j] = _mm256_loadu_si256(blk + j);
                /* 8x8 transpose of dwords: v[c] dword j = weights 4j..4j+3 of column c */
                __m256i a0 = _mm256_unpacklo_epi32(v[0], v[1]), a1 = _mm256_unpackhi_epi32(v[0], v[1]);
                __m256i a2 = _mm256_unpacklo_epi32(v[2], v[3]), a3 = _mm256_unpackhi_epi32(v[2], v[3]);
                __m256i a4 = _mm256_unpacklo_epi32(v[4], v[5]), a5 = _mm256_unpackhi_epi32(v[4], v[5]);
                __m256i a6 = _mm256_unpacklo_epi32(v[6], v[7]), a7 = _mm256_unpackhi_epi32(v[6], v[7]);
                __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
                __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
                __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
                __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
                v[0] = _mm256_permute2x128_si256(b0, b4, 0x20);
                v[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
                v[2] = _mm256_permute2x128_si256(b2, b6, 0x20);
                v[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
                v[4] = _mm256_permute2x128_si256(b0, b4, 0x31);
                v[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
                v[6] = _mm256_permute2x128_si256(b2, b6, 0x31);
                v[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
                for (int c = 0; c < 8; ++c) {
                    const int64_t g = t * groups * 8 + (b / bpg) * 8 + c;
                    const __m256 dv = _mm256_set1_ps(_cvtsh_ss(d[g]));
                    const __m256 mv = _mm256_set1_ps(m ? _cvtsh_ss(m[g]) : 0.0f);
                    const __m256i q = _mm256_xor_si256(v[c], flip);
                    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
                    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                    __m256 w[4];
                    for (int i = 0; i < 4; ++i)
                        w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])), dv, mv);
                    for (int64_t r = 0; r < rows; ++r) {
                        const float *x = h + (r0 + r) * ldh + b * QK;
                        for (int i = 0; i < 4; ++i)
                            acc[c][r][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + 8 * i), acc[c][r][i]);
                    }
                }
            }
            for (int64_t r = 0; r < rows; ++r)
                for (int c = 0; c < 8; ++c)
                    out[(r0 + r) * ldo + t * 8 + c] = hsum(_mm256_add_ps(
                        _mm256_add_ps(acc[c][r][0], acc[c][r][1]), _mm256_add_ps(acc[c][r][2], acc[c][r][3])));
        }
    }
}

/* The activation quantisation alone, for tests: codes [M][K] (int8, or int16 in natural order
 * when `fine`: 256 h + l of the 4-bit kernels' bytes), e and es [M][K/32] as the GEMMs use them. */
int kvg_quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int fine, void *q,
                      float *e, float *es) {
    int8_t *hi = malloc((size_t)K), *lo = malloc((size_t)K);
    if (!hi || !lo) {
        free(hi);
        free(lo);
        return -1;
    }
    for (int64_t i = 0; i < M; ++i) {
        (kvg_vnni(-1) == 1 ? quantize_row512 : quantize_row)(x + i * ldx, K, fine ? Q_HILO : Q_INT8,
            hi, NULL, lo, e + i * (K / QK), es + i * (K / QK), NULL);
        for (int64_t k = 0; k < K; ++k) {
            if (fine) ((int16_t *)q)[i * K + k] = (int16_t)(256 * hi[k] + lo[k]);
            else ((int8_t *)q)[i * K + k] = hi[k];
        }
    }
    free(hi);
    free(lo);
    return 0;
}

/* Load-time layout: 4-bit codes q [n][k] (one a byte, 0..15) as the 4-bit kernels read them,
 * out [ceil(n/8)][k/32][128] (`cpu_lowbit.pack4`, the same bytes): for tile t and block b,
 * byte 32j + 4c + i holds weight 32b + 8j + i of column 8t + c in its low nibble and weight
 * 32b + 8j + 4 + i in its high one; the columns past n are zero. A 7B model's projections
 * took about 30 s in tensor reshapes (two cores); this writes each byte once. */
void kvg_pack4(const uint8_t *q, int64_t n, int64_t k, uint8_t *out, int threads) {
    const int64_t tiles = (n + 7) / 8, nb = k / QK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; ++t) {
        uint8_t *o = out + t * nb * (QK * 4);
        for (int c = 0; c < 8; ++c) {
            const int64_t row = t * 8 + c;
            const uint8_t *src = q + (row < n ? row : 0) * k;
            for (int64_t b = 0; b < nb; ++b)
                for (int j = 0; j < 4; ++j)
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t *w = src + b * QK + j * 8 + i;
                        o[b * 128 + j * 32 + c * 4 + i] = row < n ? (uint8_t)(w[0] | (w[4] << 4)) : 0;
                    }
        }
    }
}
