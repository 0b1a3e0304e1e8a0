/* Matrix kernels over group-wise integer weights (dsv3/kernels/int_weights.py describes the format), a part of
 * decode_kernels.c (which includes this file: one translation unit, so the linear layers, the experts and the
 * block kernel read integer weights through the same code as fp32, bf16 and FP8 ones).
 *
 * A weight [N, K] is stored as N rows of K/32 groups. Each group has one fp16 scale d and 32 signed
 * integers q; its values are d * q. int8: 32 bytes per group, q[j] in byte j. int4: 16 bytes per group,
 * q[j] + 8 in the low nibble of byte j and q[j + 16] + 8 in its high nibble (j < 16).
 *
 * The GEMM reads the weights in place: each group is widened to fp32 in registers (its integers, exactly), a
 * row's 32 products are summed and the sum times the group's scale is added to the row's total, so each total
 * waits on one FMA per group. With few activation rows (decode: 1 to 4 on AVX-512, 1 or 2 on AVX2) 4 (2) weight
 * rows run at once, for independent totals and shared activation loads; with more, one weight row's groups are
 * converted once for a tile of up to 16 (8) activation rows. int4 nibbles are used as stored (q + 8, two
 * operations per vector to widen) and 8 times the activations' group sum is taken off once per group: 1.17x
 * (small's dense MLP) and 1.08x (one routed expert) against sign-extended nibbles at one thread, 1 row
 * (two runs of benchmarks/decode_kernels_speed.py --kinds int4 --footprint-mb 1024). A row's result does not depend on how
 * many rows share the call.
 * Two paths, chosen at run time: AVX-512 (where the CPU has AVX-512F/BW) and AVX2/FMA/F16C (the baseline);
 * dsv3_int_avx512(0) forces the baseline so both can be tested on one machine. Sums are fp32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define INT_GROUP 32
#define INT_SCALES 8 /* group scales widened to fp32 at a time (one F16C conversion) */

static int int_use_avx512 = -1;

/* want 0: the AVX2 path; 1: AVX-512 where the CPU has it; -1: query. Returns whether AVX-512 runs. */
int dsv3_int_avx512(int want) {
    if (int_use_avx512 < 0 || want >= 0)
        int_use_avx512 = want != 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return int_use_avx512;
}

/* Bytes of one row of K integer values (K a multiple of INT_GROUP). */
static inline int64_t int_row_bytes(int bits, int64_t K) { return bits == 8 ? K : K / 2; }

/* The fp32 scales of groups [g, g + INT_SCALES) of a row (fp16 s), into sc. */
static inline __attribute__((always_inline)) void group_scales(const uint16_t *s, int64_t g, int64_t groups,
                                                               float *sc) {
    if (g + INT_SCALES <= groups) {
        _mm256_storeu_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g))));
        return;
    }
    for (int64_t j = g; j < groups; j++) sc[j - g] = _cvtsh_ss(s[j]);
}

/* ---- AVX2 path: a group as four vectors of 8 fp32 ---------------------------------------------------- */

/* A group's values as fp32, w[i] for columns 8i..8i+7 (INT_COLUMN). int4: the nibbles as stored (q + 8, 0 to
 * 15; the caller takes 8 * the activations' group sum off): bytes widened to 32-bit lanes, then the low nibble
 * masked and the high one shifted down, two operations per 8 values where sign-extending bytes takes more. */
static inline __attribute__((always_inline)) void group8_avx2(int bits, const uint8_t *q, __m256 w[4]) {
    if (bits == 4) {
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        const __m256i nib = _mm256_set1_epi32(0x0F);
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, nib)), w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, nib));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        return;
    }
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
}

static inline float int_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m * ldo + i] = sum_k W[n + i, k] x[m * K + k] for the NW weight rows n + i (rows rb bytes apart) and
 * the activation rows m < R, NW * R <= 8 (the accumulators, with a group's 4 * NW weight vectors, fit the 16
 * registers when NW * R <= 4; beyond, they spill a little). */
static inline __attribute__((always_inline)) void row_avx2(int bits, int NW, int R, const uint8_t *q,
                                                           const uint16_t *s, int64_t rb, int64_t K, const float *x,
                                                           const float *xoff, float *out, int64_t ldo) {
    __m256 acc[4][8];
    float sc[4][INT_SCALES];
    const int64_t gbytes = bits == 8 ? INT_GROUP : INT_GROUP / 2, groups = K / INT_GROUP;
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (g % INT_SCALES == 0)
            for (int i = 0; i < NW; i++) group_scales(s + i * groups, g, groups, sc[i]);
        __m256 w[4][4];
        for (int i = 0; i < NW; i++) group8_avx2(bits, q + i * rb + g * gbytes, w[i]);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + g * INT_GROUP;
            const __m256 x0 = _mm256_loadu_ps(xr), x1 = _mm256_loadu_ps(xr + 8), x2 = _mm256_loadu_ps(xr + 16),
                         x3 = _mm256_loadu_ps(xr + 24);
            for (int i = 0; i < NW; i++) {
                /* int4: starts from -8 * the group's activation sum (xoff), the nibbles' offset */
                __m256 t = bits == 4 ? _mm256_fmadd_ps(w[i][0], x0, _mm256_zextps128_ps256(_mm_load_ss(xoff + r * groups + g)))
                                     : _mm256_mul_ps(w[i][0], x0);
                t = _mm256_fmadd_ps(w[i][1], x1, t);
                t = _mm256_fmadd_ps(w[i][2], x2, t);
                t = _mm256_fmadd_ps(w[i][3], x3, t);
                acc[i][r] = _mm256_fmadd_ps(t, _mm256_broadcast_ss(sc[i] + g % INT_SCALES), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = int_hsum8(acc[i][r]);
}

/* row_avx2 with the width, NW and R as constants (accumulators in registers): NW 1 or 2, R 1 to 8 (NW 2:
 * R <= 2). */
static void rows_avx2(int bits, int NW, int R, const uint8_t *q, const uint16_t *s, int64_t rb, int64_t K,
                      const float *x, const float *xoff, float *out, int64_t ldo) {
#define INT_ROW(nw, r)                                                                                              \
    (bits == 8 ? row_avx2(8, nw, r, q, s, rb, K, x, xoff, out, ldo) : row_avx2(4, nw, r, q, s, rb, K, x, xoff, out, ldo))
    if (NW == 2) {
        if (R == 1) INT_ROW(2, 1);
        else INT_ROW(2, 2);
        return;
    }
    switch (R) {
    case 1: INT_ROW(1, 1); break;
    case 2: INT_ROW(1, 2); break;
    case 3: INT_ROW(1, 3); break;
    case 4: INT_ROW(1, 4); break;
    case 5: INT_ROW(1, 5); break;
    case 6: INT_ROW(1, 6); break;
    case 7: INT_ROW(1, 7); break;
    default: INT_ROW(1, 8); break;
    }
#undef INT_ROW
}

/* ---- AVX-512 path: a group as two vectors of 16 fp32, up to 16 rows per tile --------------------------- */

#define INT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma,avx2")))

/* group8_avx2's vectors, two of 16: columns 0-15 and 16-31. */
static inline __attribute__((always_inline)) INT_AVX512 void group16_avx512(int bits, const uint8_t *q,
                                                                             __m512 w[2]) {
    if (bits == 4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
        w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        return;
    }
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}

/* row_avx2's computation on 16-wide vectors: NW weight rows by R activation rows, NW * R <= 16. */
static inline __attribute__((always_inline)) INT_AVX512 void row_avx512(int bits, int NW, int R, const uint8_t *q,
                                                                         const uint16_t *s, int64_t rb, int64_t K,
                                                                         const float *x, const float *xoff, float *out,
                                                                         int64_t ldo) {
    __m512 acc[4][16];
    float sc[4][INT_SCALES];
    const int64_t gbytes = bits == 8 ? INT_GROUP : INT_GROUP / 2, groups = K / INT_GROUP;
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (g % INT_SCALES == 0)
            for (int i = 0; i < NW; i++) group_scales(s + i * groups, g, groups, sc[i]);
        __m512 w[4][2];
        for (int i = 0; i < NW; i++) group16_avx512(bits, q + i * rb + g * gbytes, w[i]);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + g * INT_GROUP;
            const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
            for (int i = 0; i < NW; i++) {
                const __m512 t0 = bits == 4 ? _mm512_fmadd_ps(w[i][0], x0,
                                                              _mm512_zextps128_ps512(_mm_load_ss(xoff + r * groups + g)))
                                            : _mm512_mul_ps(w[i][0], x0);
                const __m512 t = _mm512_fmadd_ps(w[i][1], x1, t0);
                acc[i][r] = _mm512_fmadd_ps(t, _mm512_set1_ps(sc[i][g % INT_SCALES]), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = _mm512_reduce_add_ps(acc[i][r]);
}

/* row_avx512 with NW and R as constants: NW 1 to 4 with R 1 to 4, or NW 1 with R up to 16. */
static INT_AVX512 void rows_avx512(int bits, int NW, int R, const uint8_t *q, const uint16_t *s, int64_t rb,
                                   int64_t K, const float *x, const float *xoff, float *out, int64_t ldo) {
#define INT_ROW(nw, r)                                                                                              \
    (bits == 8 ? row_avx512(8, nw, r, q, s, rb, K, x, xoff, out, ldo)                                              \
               : row_avx512(4, nw, r, q, s, rb, K, x, xoff, out, ldo))
#define INT_ROWS(nw)                                                                                              \
    switch (R) {                                                                                                  \
    case 1: INT_ROW(nw, 1); break;                                                                                \
    case 2: INT_ROW(nw, 2); break;                                                                                \
    case 3: INT_ROW(nw, 3); break;                                                                                \
    default: INT_ROW(nw, 4); break;                                                                               \
    }
    if (NW == 4) { INT_ROWS(4) }
    else if (NW == 3) { INT_ROWS(3) }
    else if (NW == 2) { INT_ROWS(2) }
    else switch (R) {
    case 1: INT_ROW(1, 1); break;
    case 2: INT_ROW(1, 2); break;
    case 3: INT_ROW(1, 3); break;
    case 4: INT_ROW(1, 4); break;
    case 5: INT_ROW(1, 5); break;
    case 6: INT_ROW(1, 6); break;
    case 7: INT_ROW(1, 7); break;
    case 8: INT_ROW(1, 8); break;
    case 9: INT_ROW(1, 9); break;
    case 10: INT_ROW(1, 10); break;
    case 11: INT_ROW(1, 11); break;
    case 12: INT_ROW(1, 12); break;
    case 13: INT_ROW(1, 13); break;
    case 14: INT_ROW(1, 14); break;
    case 15: INT_ROW(1, 15); break;
    default: INT_ROW(1, 16); break;
    }
#undef INT_ROWS
#undef INT_ROW
}

/* ---- the GEMM over a range of weight rows ------------------------------------------------------------------ */

/* y[m * ldy + n] = sum_k W[n, k] x[m * K + k] for m < M and the weight rows n in [n0, n1), with q [N, K] the
 * integer values and s [N, K / 32] the fp16 scales of W; x [M, K] fp32 contiguous. Each row prefetches the
 * bytes PF_BYTES (decode_kernels.c) further on as it starts, going on at ``next`` (where the caller reads next;
 * NULL: nowhere) past row n1, so a run of small matrices (the experts of a step) reads as one stream. */
static void int_rows(int bits, const uint8_t *q, const uint16_t *s, int64_t K, const float *x, int64_t M,
                     float *y, int64_t ldy, int64_t n0, int64_t n1, const char *next) {
    const int wide = dsv3_int_avx512(-1);
    /* few activation rows: NW weight rows at once, for independent sums and shared activation loads; many:
     * one weight row, its groups converted once for a tile of up to 16 (8) rows */
    const int few = M <= (wide ? 4 : 2), tile = few ? (int)M : wide ? 16 : 8, nw = few ? (wide ? 4 : 2) : 1;
    const int64_t rb = int_row_bytes(bits, K), groups = K / INT_GROUP;
    const char *end = (const char *)q + n1 * rb;
    /* int4: -8 * each group's activation sum, the offset of the nibbles as stored (q + 8) */
    float *xoff = bits == 4 ? (float *)malloc((size_t)(M * groups + 1) * sizeof(float)) : NULL;
    for (int64_t i = 0; xoff && i < M * groups; i++) {
        float sum = 0.0f;
        for (int j = 0; j < INT_GROUP; j++) sum += x[i * INT_GROUP + j];
        xoff[i] = -8.0f * sum;
    }
    for (const char *p = (const char *)q + n0 * rb; p < end && p < (const char *)q + n0 * rb + PF_BYTES; p += 64)
        _mm_prefetch(p, _MM_HINT_T0); /* this call's own first bytes */
    for (int64_t n = n0; n < n1; n += nw) {
        const int NW = (int)(n1 - n < nw ? n1 - n : nw);
        const char *pf = (const char *)q + n * rb + PF_BYTES;
        if (pf >= end) pf = next ? next + (pf - end) : NULL;
        if (pf)
            for (int64_t b = 0; b < NW * rb; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            const int R = (int)(M - m0 < tile ? M - m0 : tile);
            const float *xo = xoff ? xoff + m0 * groups : NULL;
            if (wide)
                rows_avx512(bits, NW, R, q + n * rb, s + n * groups, rb, K, x + m0 * K, xo, y + m0 * ldy + n, ldy);
            else
                rows_avx2(bits, NW, R, q + n * rb, s + n * groups, rb, K, x + m0 * K, xo, y + m0 * ldy + n, ldy);
        }
    }
    free(xoff);
}
