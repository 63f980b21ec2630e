/* kvguard CPU low-bit GEMMs: the integer-dot kernels (int8 activations at any batch, int16
 * below the panel threshold: decode, and every batch of 4-bit weights on VNNI), as lowbit.c
 * includes them twice: once for AVX2 (`vpmaddubsw`, `vpmaddwd`), once with DOTS_VNNI
 * for CPUs with AVX-512 VNNI (`vpdpbusd`, `vpdpwssd`: one instruction where AVX2 needs two or
 * three, and 32 vector registers; 4-bit weights also two tiles at once in 512-bit registers,
 * `tile16_vnni`), each function renamed by DOTS(name)
 * and, in the VNNI copy, compiled for that target alone, so the rest of the library keeps its
 * AVX2 code (compiled whole with AVX-512 enabled, the fp32 panels ran 16-24% slower on an
 * AVX-512 Zen core). Both copies compute the same integers, hence the same bits: the VNNI
 * instructions sum the very products the AVX2 ones do, in int32, and none of the AVX2 int16
 * sums saturates (see block4 and block8). */
#define DOTS_L2_BYTES (192 * 1024) /* activations a row stretch may hold (a core's L2: 0.5-2 MiB) */
#define MRV 6 /* rows a VNNI tile of sixteen columns takes at once (MR elsewhere): see tile16_vnni */
#ifdef DOTS_VNNI
#define DOTS_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define DOTS_FN
#endif

#if defined(DOTS_VNNI) && !defined(KVG_DOT_BCAST)
#define KVG_DOT_BCAST
/* acc + the dots of u's unsigned bytes with the signed activation word at p, broadcast to every
 * lane by the dot itself (`vpdpbusd` with an {1toN} memory operand). GCC (12) keeps a separate
 * `vpbroadcastd` before each dot written as intrinsics; reading the word in the dot measured
 * 6-11% more GMAC/s on SmolLM2's 4-bit projections (Zen 4, 2 threads, 32 and 256 rows, same
 * bits) and, with the low bytes signed too (lowbit.c), 12-14% with int16 activations. The
 * word is read as a may_alias int32 (the activations are stored as bytes). */
typedef int32_t __attribute__((may_alias)) kvg_word;

static inline __attribute__((always_inline)) DOTS_FN __m512i dot_bcast16(__m512i acc, __m512i u,
                                                                         const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const kvg_word *)p));
    return acc;
}

static inline __attribute__((always_inline)) DOTS_FN __m256i dot_bcast8(__m256i acc, __m256i u,
                                                                        const void *p) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const kvg_word *)p));
    return acc;
}
#endif

/* A block's column sums s (as floats) into a row's accumulators: s d e, and m es for the
 * mins, kept apart until the end (both copies, every tile: the same bits). */
static inline __attribute__((always_inline)) DOTS_FN void DOTS(scale8)(__m256 s, __m256 dv,
    __m256 mv, int has_m, const float *e, const float *es, __m256 *acc, __m256 *corr) {
    *acc = _mm256_fmadd_ps(s, _mm256_mul_ps(dv, _mm256_broadcast_ss(e)), *acc);
    if (has_m) *corr = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(es), *corr);
}

/* 8-bit: one weight block (eight columns' codes w, |w| in aw) against `rows` activation rows:
 * eight integer dots per row, reduced to one vector of eight column sums, scaled. (The VNNI
 * copy takes int8 activations in `tile8_vnni` instead: only its `fine` rows come here.) */
static inline __attribute__((always_inline)) DOTS_FN void DOTS(block8)(
    const int fine, const int rows, const __m256i *w, const __m256i *aw, const void *xq,
    const float *xe, const float *xes, int64_t K, int64_t nb, int64_t b, __m256 dv, __m256 mv,
    int has_m, __m256 *acc, __m256 *corr) {
    const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    __m256i wa[8], wb[8];
    if (fine) /* codes widened to int16 once for all rows, in the activations' order */
        for (int c = 0; c < 8; ++c) {
            const __m256i ext = _mm256_cmpgt_epi8(zero, w[c]);
            wa[c] = _mm256_unpacklo_epi8(w[c], ext);
            wb[c] = _mm256_unpackhi_epi8(w[c], ext);
        }
    for (int r = 0; r < rows; ++r) {
        __m256i d[8];
        if (fine) {
            const int16_t *x16 = (const int16_t *)xq + r * K + b * QK;
            const __m256i xa = _mm256_loadu_si256((const __m256i *)x16);
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(x16 + 16));
            for (int c = 0; c < 8; ++c)
#ifdef DOTS_VNNI
                d[c] = _mm256_dpwssd_epi32(_mm256_madd_epi16(wa[c], xa), wb[c], xb);
#else
                d[c] = _mm256_add_epi32(_mm256_madd_epi16(wa[c], xa), _mm256_madd_epi16(wb[c], xb));
#endif
        } else {
            const __m256i x = _mm256_loadu_si256((const __m256i *)((const int8_t *)xq + r * K + b * QK));
            /* |w| (0..128) times x with w's sign (|x| <= 127): a pair sums to 32512 at most, so
             * `vpmaddubsw` never saturates */
            for (int c = 0; c < 8; ++c)
                d[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(x, w[c])), ones);
        }
        const __m256 s = _mm256_cvtepi32_ps(reduce8(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]));
        DOTS(scale8)(s, dv, mv, has_m, xe + r * nb + b, xes + r * nb + b, acc + r, corr + r);
    }
}

/* 4-bit: one vertical weight block (w[g]: eight columns' weights 4g..4g+3 of the block, codes
 * 0..15) against `rows` activation rows; each lane of the integer sum is one column's dot.
 * (The VNNI copy takes 4-bit weights in `tile16_vnni` instead.) */
static inline __attribute__((always_inline)) DOTS_FN void DOTS(block4)(
    const int fine, const int rows, const __m256i *w, const int8_t *xh, const int8_t *xl,
    const float *xe, const float *xes, int64_t K, int64_t nb, int64_t b, __m256 dv, __m256 mv,
    int has_m, __m256 *acc, __m256 *corr) {
    const __m256i ones = _mm256_set1_epi16(1), s256 = _mm256_set1_epi16(256);
    for (int r = 0; r < rows; ++r) {
        const int8_t *h = xh + r * K + b * QK;
        /* int16 sums of eight products of 15 x 128 at most: no saturation */
        __m256i ph = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load32(h)));
        for (int g = 1; g < 8; ++g)
            ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(load32(h + 4 * g))));
        __m256i s;
        if (fine) { /* the low bytes are signed bytes too: the same bound */
            const int8_t *l = xl + r * K + b * QK;
            __m256i pl = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load32(l)));
            for (int g = 1; g < 8; ++g)
                pl = _mm256_add_epi16(pl, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(load32(l + 4 * g))));
            s = _mm256_add_epi32(_mm256_madd_epi16(ph, s256), _mm256_madd_epi16(pl, ones));
        } else {
            s = _mm256_madd_epi16(ph, ones);
        }
        DOTS(scale8)(_mm256_cvtepi32_ps(s), dv, mv, has_m, xe + r * nb + b, xes + r * nb + b, acc + r, corr + r);
    }
}

/* 8-bit vertical: one weight block (eight columns' codes of weights 4j..4j+3 in w[j]) against
 * `rows` int8 activation rows; each lane of the integer sum is one column's dot, as in
 * `block4`. AVX2: w[j] holds the signed codes w, aw[j] |w| (0..128), and |w| times x with w's
 * sign sums a pair to 32512 at most, so `vpmaddubsw` never saturates. VNNI: w[j] holds the
 * unsigned codes w + 128 and each row's sum starts from minus 128 times the block's activation
 * sum (`xis`), as in `tile16v_vnni`: the same integers either way. */
static inline __attribute__((always_inline)) DOTS_FN void DOTS(block8v)(
    const int rows, const __m256i *w, const __m256i *aw, const int8_t *xq, const float *xe,
    const float *xes, const int32_t *xis, int64_t K, int64_t nb, int64_t b, __m256 dv,
    __m256 mv, int has_m, __m256 *acc, __m256 *corr) {
    for (int r = 0; r < rows; ++r) {
        const int8_t *h = xq + r * K + b * QK;
#ifdef DOTS_VNNI
        (void)aw;
        __m256i s0 = _mm256_set1_epi32(-128 * xis[r * nb + b]), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            s0 = dot_bcast8(s0, w[j], h + 4 * j);
            s1 = dot_bcast8(s1, w[j + 1], h + 4 * j + 4);
        }
#else
        (void)xis;
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            const __m256i x0 = _mm256_set1_epi32(load32(h + 4 * j));
            const __m256i x1 = _mm256_set1_epi32(load32(h + 4 * j + 4));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(x0, w[j])), ones));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j + 1], _mm256_sign_epi8(x1, w[j + 1])), ones));
        }
#endif
        const __m256i s = _mm256_add_epi32(s0, s1);
        DOTS(scale8)(_mm256_cvtepi32_ps(s), dv, mv, has_m, xe + r * nb + b, xes + r * nb + b, acc + r, corr + r);
    }
}

/* Eight output columns (one tile; 8-bit codes of column c at wc + c*K, 4-bit or vertical
 * 8-bit codes of the tile at wc) for `rows` (1..MR, a constant after inlining) activation rows: `xq` is the int8
 * or int16 (8-bit weights) or the high bytes (4-bit, `fine`; the low bytes at `xl`). */
static inline __attribute__((always_inline)) DOTS_FN void DOTS(tile)(
    const int bits, const int fine, const int rows, const void *xq, const int8_t *xl,
    const float *xe, const float *xes, const int32_t *xis, int64_t K, const uint8_t *wc, const uint16_t *wd,
    const uint16_t *wm, int64_t bpg, float *out, int64_t ldo, int64_t valid, int64_t ahead) {
    const int64_t nb = K / QK;
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const int has_m = wm != NULL;
    __m256 acc[MR], corr[MR];
    for (int r = 0; r < rows; ++r) acc[r] = corr[r] = _mm256_setzero_ps();
    __m256 dv = _mm256_setzero_ps(), mv = _mm256_setzero_ps();
    int64_t g = 0, k = 0; /* group of block b, and b's place in it */
    for (int64_t b = 0; b < nb; ++b) {
        if (k == 0) {
            dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g * 8)));
            if (has_m) mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g * 8)));
        }
        if (bits == 4) {
            const uint8_t *p = wc + b * (8 * QK / 2);
            _mm_prefetch((const char *)(p + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(p + ahead + 64), _MM_HINT_T1);
            __m256i w[8];
            for (int j = 0; j < 4; ++j) { /* one load, three ops: 64 weights */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
                w[2 * j] = _mm256_and_si256(v, lo4);
                w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            }
            DOTS(block4)(fine, rows, w, (const int8_t *)xq, xl, xe, xes, K, nb, b, dv, mv, has_m, acc, corr);
        } else if (bits == BITS_8V) {
            const uint8_t *p = wc + b * (8 * QK);
            for (int j = 0; j < 4; ++j) _mm_prefetch((const char *)(p + AHEAD8V + 64 * j), _MM_HINT_T0);
            __m256i w[8], aw[8];
            for (int j = 0; j < 8; ++j) {
                w[j] = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
#ifndef DOTS_VNNI
                w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8((char)0x80)); /* w + 128 -> w */
                aw[j] = _mm256_sign_epi8(w[j], w[j]);
#endif
            }
            DOTS(block8v)(rows, w, aw, (const int8_t *)xq, xe, xes, xis, K, nb, b, dv, mv, has_m, acc, corr);
        } else {
            __m256i w[8], aw[8];
            for (int c = 0; c < 8; ++c) {
                _mm_prefetch((const char *)(wc + (8 + c) * K + b * QK), _MM_HINT_T0); /* next tile */
                w[c] = _mm256_loadu_si256((const __m256i *)(wc + c * K + b * QK));
                aw[c] = _mm256_sign_epi8(w[c], w[c]);
            }
            DOTS(block8)(fine, rows, w, aw, xq, xe, xes, K, nb, b, dv, mv, has_m, acc, corr);
        }
        if (++k == bpg) {
            k = 0;
            ++g;
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), lane);
    for (int r = 0; r < rows; ++r) {
        const __m256 v = _mm256_add_ps(acc[r], corr[r]);
        if (valid >= 8) _mm256_storeu_ps(out + r * ldo, v);
        else _mm256_maskstore_ps(out + r * ldo, mask, v);
    }
}

#ifdef DOTS_VNNI
/* Two tiles side by side in one 512-bit register: eight columns' fp16 group values from each
 * (as floats), or 32 bytes of codes from each. */
static inline __attribute__((always_inline)) DOTS_FN __m512 cols16(const uint16_t *a, const uint16_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)), _mm_loadu_si128((const __m128i *)b), 1));
}

static inline __attribute__((always_inline)) DOTS_FN __m512i codes16(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* A block's 4-bit codes of two tiles (at p and p1) as eight registers of sixteen columns:
 * w[2j] the low nibbles of quarter j (weights 8j..8j+3), w[2j+1] the high ones (8j+4..8j+7). */
static inline __attribute__((always_inline)) DOTS_FN void unpack16(const uint8_t *p, const uint8_t *p1,
                                                                   __m512i *w) {
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
        const __m512i v = codes16(p + 32 * j, p1 + 32 * j);
        w[2 * j] = _mm512_and_si512(v, lo4);
        w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    }
}

/* A block's integer column sums s into a row's accumulators: s d e, and m es for the mins
 * (kept apart until the end, as the AVX2 copy keeps them). */
static inline __attribute__((always_inline)) DOTS_FN void scale16(__m512i s, __m512 dv, __m512 mv,
    int has_m, float e, float es, __m512 *acc, __m512 *corr) {
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(e)), *acc);
    if (has_m) *corr = _mm512_fmadd_ps(mv, _mm512_set1_ps(es), *corr);
}

/* The rows' sixteen (`valid` of them) outputs: acc + corr. */
static inline __attribute__((always_inline)) DOTS_FN void store16(const int rows, const __m512 *acc,
    const __m512 *corr, float *out, int64_t ldo, int64_t valid) {
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, _mm512_add_ps(acc[r], corr[r]));
}

/* A block's eight dots (codes w[0..7] against the eight activation words at p) added to acc,
 * in two chains joined at the end: a row or two alone would otherwise wait on one chain of
 * eight latencies. */
static inline __attribute__((always_inline)) DOTS_FN __m512i dots_block(__m512i acc,
                                                                        const __m512i *w,
                                                                        const int8_t *p) {
    __m512i odd = _mm512_setzero_si512();
    for (int q = 0; q < 8; q += 2) {
        acc = dot_bcast16(acc, w[q], p + 4 * q);
        odd = dot_bcast16(odd, w[q + 1], p + 4 * q + 4);
    }
    return _mm512_add_epi32(acc, odd);
}

/* The same for `rows` rows at once (row r's words at p + r K) into hs[r], one chain a row,
 * the rows' dots interleaved: a code register feeds every row in turn. */
static inline __attribute__((always_inline)) DOTS_FN void dots_block_rows(__m512i *hs,
    const int rows, const __m512i *w, const int8_t *p, int64_t K) {
    for (int q = 0; q < 8; ++q)
        for (int r = 0; r < rows; ++r)
            hs[r] = dot_bcast16(hs[r], w[q], p + r * K + 4 * q);
}

/* 4-bit, the VNNI copy's tile: two neighbouring tiles (sixteen columns; tile t's codes at wc,
 * t+1's at wc + tile_bytes, their scales at wd/wm and wd1/wm1) in 512-bit registers, or one
 * tile twice (tile_bytes 0, the same scales, `valid` <= 8) where a thread's last tile has no
 * neighbour. A broadcast activation word feeds sixteen columns, and the per-block float work
 * (conversion, scaling) serves sixteen columns an instruction: measured on SmolLM2's
 * projections (Zen 4, 2 threads, 256-bit tiles of eight columns before), 144-162 against
 * 114-121 GMAC/s from 32 rows; a 512-bit `vpdpbusd` sums a third more products a cycle than
 * two 256-bit ones there. Each `vpdpbusd` sums four u8 x s8 products into a lane. From three
 * rows on, the rows' chains run interleaved, one accumulator a row: a weight register feeds
 * every row in turn, so three to six chains are in flight, where the compiler's row-after-row
 * order (two chains a row, joined by an add) left that to the out-of-order window (5-7% more
 * GMAC/s on SmolLM2's projections at 32 and 256 rows with int16 activations, 3% with int8,
 * in alternating A/B runs). The low bytes'
 * dots continue each row's chain from 256 times the high bytes' sum (no second accumulator,
 * no add), which leaves the registers for six rows a tile (MRV) instead of four: the codes
 * unpacked once serve half as many rows again (a median 2-4% more over eleven A/B runs at 16
 * to 256 rows, two of them lost in the noise). Rows one and two
 * keep two chains a row. Every lane does
 * what `tile` does for its column on AVX2, in the same order, so the bits are the same. */
static inline __attribute__((always_inline)) DOTS_FN void tile16_vnni(
    const int fine, const int rows, const int8_t *xh, const int8_t *xl, const float *xe,
    const float *xes, int64_t K, const uint8_t *wc, int64_t tile_bytes, const uint16_t *wd,
    const uint16_t *wm, const uint16_t *wd1, const uint16_t *wm1, int64_t bpg, float *out,
    int64_t ldo, int64_t valid, int64_t ahead) {
    const int64_t nb = K / QK;
    const int has_m = wm != NULL;
    __m512 acc[MRV], corr[MRV];
    for (int r = 0; r < rows; ++r) acc[r] = corr[r] = _mm512_setzero_ps();
    __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    int64_t g = 0, k = 0; /* group of block b, and b's place in it */
    for (int64_t b = 0; b < nb; ++b) {
        if (k == 0) {
            dv = cols16(wd + g * 8, wd1 + g * 8);
            if (has_m) mv = cols16(wm + g * 8, wm1 + g * 8);
        }
        const uint8_t *p = wc + b * (8 * QK / 2), *p1 = p + tile_bytes;
        _mm_prefetch((const char *)(p + ahead), _MM_HINT_T1);
        _mm_prefetch((const char *)(p + ahead + 64), _MM_HINT_T1);
        _mm_prefetch((const char *)(p1 + ahead), _MM_HINT_T1);
        _mm_prefetch((const char *)(p1 + ahead + 64), _MM_HINT_T1);
        __m512i w[8];
        unpack16(p, p1, w);
        if (rows >= 3) {
            __m512i hs[MRV];
            for (int r = 0; r < rows; ++r) hs[r] = _mm512_setzero_si512();
            dots_block_rows(hs, rows, w, xh + b * QK, K);
            if (fine) {
                for (int r = 0; r < rows; ++r) hs[r] = _mm512_slli_epi32(hs[r], 8);
                dots_block_rows(hs, rows, w, xl + b * QK, K);
            }
            for (int r = 0; r < rows; ++r)
                scale16(hs[r], dv, mv, has_m, xe[r * nb + b], xes[r * nb + b], acc + r, corr + r);
        } else for (int r = 0; r < rows; ++r) {
            const __m512i zero = _mm512_setzero_si512();
            __m512i s = dots_block(zero, w, xh + r * K + b * QK);
            if (fine)
                s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), dots_block(zero, w, xl + r * K + b * QK));
            scale16(s, dv, mv, has_m, xe[r * nb + b], xes[r * nb + b], acc + r, corr + r);
        }
        if (++k == bpg) {
            k = 0;
            ++g;
        }
    }
    store16(rows, acc, corr, out, ldo, valid);
}

/* 8-bit codes, int8 activations (the refined lm_head), the VNNI copy's tile: eight columns,
 * two blocks at once in 512-bit registers (a column's codes of blocks b and b + 1 are 64
 * bytes side by side, as are a row's activations). Each `vpdpbusd` takes w + 128 (unsigned)
 * against x and starts from minus 128 times the lane's four x: the lane's exact sum of w x,
 * what the AVX2 copy's |w| times x with w's sign gives. The eight columns' lanes are then
 * summed by unpacks and adds (no horizontal adds), block b's column sums in lanes 0-7 and
 * b + 1's in lanes 8-15, and scaled into the eight-column accumulators block by block, in
 * the AVX2 copy's order: the same bits. K % 64 == 0 (the GEMMs require it). */
static inline __attribute__((always_inline)) DOTS_FN void tile8_vnni(
    const int rows, const int8_t *xq, const float *xe, const float *xes, int64_t K,
    const uint8_t *wc, const uint16_t *wd, const uint16_t *wm, int64_t bpg, float *out,
    int64_t ldo, int64_t valid) {
    const int64_t nb = K / QK;
    const int has_m = wm != NULL;
    const __m512i bias = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    /* for the last step: lanes 0-3 of 128-bit lanes 0 and 2 of a and b, then 1 and 3 */
    const __m512i pick_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i pick_hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    __m256 acc[MR], corr[MR];
    for (int r = 0; r < rows; ++r) acc[r] = corr[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int64_t g0 = b / bpg, g1 = (b + 1) / bpg;
        const __m256 dv0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g0 * 8)));
        const __m256 dv1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g1 * 8)));
        __m256 mv0 = _mm256_setzero_ps(), mv1 = _mm256_setzero_ps();
        if (has_m) {
            mv0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g0 * 8)));
            mv1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g1 * 8)));
        }
        __m512i wu[8];
        for (int c = 0; c < 8; ++c) {
            _mm_prefetch((const char *)(wc + (8 + c) * K + b * QK), _MM_HINT_T0); /* next tile */
            wu[c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wc + c * K + b * QK)), bias);
        }
        for (int r = 0; r < rows; ++r) {
            const __m512i x = _mm512_loadu_si512((const void *)(xq + r * K + b * QK));
            const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, x));
            __m512i p[4];
            for (int c = 0; c < 8; c += 2) { /* pairs of columns: two of each 128-bit lane */
                const __m512i d0 = _mm512_dpbusd_epi32(start, wu[c], x);
                const __m512i d1 = _mm512_dpbusd_epi32(start, wu[c + 1], x);
                p[c / 2] = _mm512_add_epi32(_mm512_unpacklo_epi32(d0, d1), _mm512_unpackhi_epi32(d0, d1));
            }
            /* a 128-bit lane of q: that lane's sums of columns 0-3 (4-7 in q1) */
            const __m512i q0 = _mm512_add_epi32(_mm512_unpacklo_epi64(p[0], p[1]), _mm512_unpackhi_epi64(p[0], p[1]));
            const __m512i q1 = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2], p[3]), _mm512_unpackhi_epi64(p[2], p[3]));
            /* 128-bit lanes 0 + 1 are block b, 2 + 3 block b + 1 */
            const __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(q0, pick_lo, q1),
                                                 _mm512_permutex2var_epi32(q0, pick_hi, q1));
            const __m256 s0 = _mm256_cvtepi32_ps(_mm512_castsi512_si256(sum));
            const __m256 s1 = _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(sum, 1));
            DOTS(scale8)(s0, dv0, mv0, has_m, xe + r * nb + b, xes + r * nb + b, acc + r, corr + r);
            DOTS(scale8)(s1, dv1, mv1, has_m, xe + r * nb + b + 1, xes + r * nb + b + 1, acc + r, corr + r);
        }
    }
    const __mmask8 mask = valid >= 8 ? (__mmask8)0xff : (__mmask8)((1u << valid) - 1);
    for (int r = 0; r < rows; ++r)
        _mm256_mask_storeu_ps(out + r * ldo, mask, _mm256_add_ps(acc[r], corr[r]));
}

/* 8-bit vertical codes, int8 activations (the refined lm_head), the VNNI copy's tile: two
 * neighbouring tiles (sixteen columns) in 512-bit registers as `tile16_vnni` takes 4-bit
 * ones, or one tile twice (tile_bytes 0). The codes w + 128 are the unsigned operand against
 * a broadcast activation word, each row's chain started from minus 128 times its block's
 * activation sum (`xis`): the exact sum of w x in each column's lane, what `block8v` gives,
 * with no horizontal sums; scaled as there, so the same bits. */
static inline __attribute__((always_inline)) DOTS_FN void tile16v_vnni(
    const int rows, const int8_t *xq, const float *xe, const float *xes, const int32_t *xis,
    int64_t K, const uint8_t *wc, int64_t tile_bytes, const uint16_t *wd, const uint16_t *wm,
    const uint16_t *wd1, const uint16_t *wm1, int64_t bpg, float *out, int64_t ldo,
    int64_t valid) {
    const int64_t nb = K / QK;
    const int has_m = wm != NULL;
    __m512 acc[MRV], corr[MRV];
    for (int r = 0; r < rows; ++r) acc[r] = corr[r] = _mm512_setzero_ps();
    __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    int64_t g = 0, k = 0; /* group of block b, and b's place in it */
    for (int64_t b = 0; b < nb; ++b) {
        if (k == 0) {
            dv = cols16(wd + g * 8, wd1 + g * 8);
            if (has_m) mv = cols16(wm + g * 8, wm1 + g * 8);
        }
        const uint8_t *p = wc + b * (8 * QK), *p1 = p + tile_bytes;
        for (int j = 0; j < 4; ++j) {
            _mm_prefetch((const char *)(p + AHEAD8V + 64 * j), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + AHEAD8V + 64 * j), _MM_HINT_T0);
        }
        __m512i w[8];
        for (int j = 0; j < 8; ++j)
            w[j] = codes16(p + 32 * j, p1 + 32 * j);
        if (rows >= 3) { /* rows interleaved, as in tile16_vnni (head, 8-32 rows: 2%, then 1-11% from six-row tiles) */
            __m512i hs[MRV];
            for (int r = 0; r < rows; ++r) hs[r] = _mm512_set1_epi32(-128 * xis[r * nb + b]);
            dots_block_rows(hs, rows, w, xq + b * QK, K);
            for (int r = 0; r < rows; ++r)
                scale16(hs[r], dv, mv, has_m, xe[r * nb + b], xes[r * nb + b], acc + r, corr + r);
        } else for (int r = 0; r < rows; ++r) {
            const __m512i s = dots_block(_mm512_set1_epi32(-128 * xis[r * nb + b]), w, xq + r * K + b * QK);
            scale16(s, dv, mv, has_m, xe[r * nb + b], xes[r * nb + b], acc + r, corr + r);
        }
        if (++k == bpg) {
            k = 0;
            ++g;
        }
    }
    store16(rows, acc, corr, out, ldo, valid);
}

#define TILE16V_ROWS(TB, VALID)                                                              \
    switch (rows) {                                                                          \
    case 6: tile16v_vnni(6, (const int8_t *)xr, er, esr, isr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID); break; \
    case 5: tile16v_vnni(5, (const int8_t *)xr, er, esr, isr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID); break; \
    case 4: tile16v_vnni(4, (const int8_t *)xr, er, esr, isr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID); break; \
    case 3: tile16v_vnni(3, (const int8_t *)xr, er, esr, isr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID); break; \
    case 2: tile16v_vnni(2, (const int8_t *)xr, er, esr, isr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID); break; \
    default: tile16v_vnni(1, (const int8_t *)xr, er, esr, isr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID); break; \
    }

#define TILE8_ROWS                                                                           \
    switch (rows) {                                                                          \
    case 4: tile8_vnni(4, (const int8_t *)xr, er, esr, K, c, d, m, bpg, o, ldo, valid); break; \
    case 3: tile8_vnni(3, (const int8_t *)xr, er, esr, K, c, d, m, bpg, o, ldo, valid); break; \
    case 2: tile8_vnni(2, (const int8_t *)xr, er, esr, K, c, d, m, bpg, o, ldo, valid); break; \
    default: tile8_vnni(1, (const int8_t *)xr, er, esr, K, c, d, m, bpg, o, ldo, valid); break; \
    }

#define TILE16_ROWS(FINE, TB, VALID)                                                         \
    switch (rows) {                                                                          \
    case 6: tile16_vnni(FINE, 6, xr, lr, er, esr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID, ahead); break; \
    case 5: tile16_vnni(FINE, 5, xr, lr, er, esr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID, ahead); break; \
    case 4: tile16_vnni(FINE, 4, xr, lr, er, esr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID, ahead); break; \
    case 3: tile16_vnni(FINE, 3, xr, lr, er, esr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID, ahead); break; \
    case 2: tile16_vnni(FINE, 2, xr, lr, er, esr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID, ahead); break; \
    default: tile16_vnni(FINE, 1, xr, lr, er, esr, K, c, TB, d, m, d1, m1, bpg, o, ldo, VALID, ahead); break; \
    }
#endif

#define TILE_ROWS(BITS, FINE)                                                                \
    switch (rows) {                                                                          \
    case 4: DOTS(tile)(BITS, FINE, 4, xr, lr, er, esr, isr, K, c, d, m, bpg, o, ldo, valid, ahead); break;     \
    case 3: DOTS(tile)(BITS, FINE, 3, xr, lr, er, esr, isr, K, c, d, m, bpg, o, ldo, valid, ahead); break;     \
    case 2: DOTS(tile)(BITS, FINE, 2, xr, lr, er, esr, isr, K, c, d, m, bpg, o, ldo, valid, ahead); break;     \
    default: DOTS(tile)(BITS, FINE, 1, xr, lr, er, esr, isr, K, c, d, m, bpg, o, ldo, valid, ahead); break;    \
    }

static DOTS_FN void DOTS(columns)(const int bits, const int fine, int64_t M, int64_t K, const void *xq,
                    const int8_t *xl, const float *xe, const float *xes, const int32_t *xis,
                    const uint8_t *wc, const uint16_t *wd, const uint16_t *wm, int64_t N,
                    int64_t bpg, int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const int64_t nb = K / QK, groups = nb / bpg;
    const int64_t tile_bytes = 8 * (bits == 4 ? K / 2 : K);
    const int64_t x_bytes = bits == 8 && fine ? 2 : 1;
    int64_t chunk = (24 * 1024) / tile_bytes; /* column tiles whose codes stay in L1 */
    if (chunk < 1) chunk = 1;
#ifdef DOTS_VNNI
    const int vertical = bits == 4 || bits == BITS_8V; /* pairs of tiles: tile16, tile16v */
    if (vertical && chunk > 1) chunk &= ~(int64_t)1;
#endif
    /* rows in stretches whose activations stay in L2 while every column chunk passes over
     * them (all rows at once streamed them from L3 once a prompt chunk passed ~100 rows) */
    const int64_t row_bytes = K * (fine ? 2 : 1);
#ifdef DOTS_VNNI
    const int64_t mr = vertical ? MRV : MR;
#else
    const int64_t mr = MR;
#endif
    int64_t stretch = (DOTS_L2_BYTES / row_bytes) / mr * mr;
    if (stretch < mr) stretch = mr;
    const int64_t ahead = M <= mr ? AHEAD4_FEW : AHEAD4; /* 4-bit codes' prefetch distance */
    for (int64_t r0 = 0; r0 < M; r0 += stretch) {
        const int64_t r1 = r0 + stretch < M ? r0 + stretch : M;
        for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
            const int64_t c1 = c0 + chunk < t1 ? c0 + chunk : t1;
            for (int64_t m0 = r0; m0 < r1; m0 += mr) {
                const int64_t rows = r1 - m0 < mr ? r1 - m0 : mr;
                const void *xr = (const char *)xq + m0 * K * x_bytes;
                const int8_t *lr = xl + m0 * K;
                const float *er = xe + m0 * nb, *esr = xes + m0 * nb;
                const int32_t *isr = xis ? xis + m0 * nb : NULL;
                for (int64_t t = c0; t < c1; ++t) {
                    const uint8_t *c = wc + t * tile_bytes;
                    const uint16_t *d = wd + t * groups * 8, *m = wm ? wm + t * groups * 8 : NULL;
                    float *o = out + m0 * ldo + t * 8;
                    const int64_t valid = N - t * 8;
#ifdef DOTS_VNNI
                    if (bits == BITS_8V && M == 1) { /* one row: eight columns a tile (see AHEAD8V) */
                        TILE_ROWS(BITS_8V, 0)
                        continue;
                    }
                    if (vertical) { /* two tiles at once, or a lone last one twice */
                        const int pair = t + 1 < c1;
                        const int64_t tb = pair ? tile_bytes : 0, next = pair ? groups * 8 : 0;
                        const uint16_t *d1 = d + next, *m1 = m ? m + next : NULL;
                        const int64_t valid16 = pair || valid < 8 ? valid : 8;
                        if (bits == BITS_8V) TILE16V_ROWS(tb, valid16)
                        else if (fine) TILE16_ROWS(1, tb, valid16)
                        else TILE16_ROWS(0, tb, valid16)
                        t += pair;
                        continue;
                    }
                    if (fine) TILE_ROWS(8, 1)
                    else TILE8_ROWS /* 8-bit codes, int8 activations: two blocks at once */
#else
                    if (bits == 4 && fine) TILE_ROWS(4, 1)
                    else if (bits == 4) TILE_ROWS(4, 0)
                    else if (bits == BITS_8V) TILE_ROWS(BITS_8V, 0)
                    else if (fine) TILE_ROWS(8, 1)
                    else TILE_ROWS(8, 0)
#endif
                }
            }
        }
    }
}

#undef TILE_ROWS
#ifdef DOTS_VNNI
#undef TILE16_ROWS
#undef TILE16V_ROWS
#undef TILE8_ROWS
#endif
#undef DOTS_FN
