/* Matrix kernels over group-wise integer weights (dsv3/kernels/int_weights.py describes the format), a part of
 * decode_kernels.c (which includes this file: one translation unit, so the linear layers, the experts and the
 * block kernel read integer weights through the same code as fp32, bf16 and FP8 ones).
 *
 * A weight [N, K] is stored as N rows of K/32 groups. Each group has one fp16 scale d and 32 signed
 * integers q; its values are d * q. int8: 32 bytes per group, q[j] in byte j. int4: 16 bytes per group,
 * q[j] + 8 in the low nibble of byte j and q[j + 16] + 8 in its high nibble (j < 16).
 *
 * The GEMM reads the weights in place: each group is widened to fp32 in registers (its integers, exactly) and
 * used for up to INT_TILE rows of activations at once, so a weight byte is read from memory once per tile; a
 * row's 32 products are summed first and the sum times the group's scale is added to the row's total, so each
 * row's total waits on one FMA per group (not on two or four in a chain, which left a single row at a quarter
 * of the FMA units' rate). A row's result does not depend on how many rows share the call.
 * Two paths, chosen at run time: AVX-512 (where the CPU has AVX-512F/BW) and AVX2/FMA/F16C (the baseline);
 * dsv3_int_avx512(0) forces the baseline so both can be tested on one machine. Sums are fp32.
 */
#include <immintrin.h>
#include <stdint.h>

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

/* A group's 32 values as signed bytes, values 0-15 in lo and 16-31 in hi (int4: the low nibbles are the
   first 16 values, the high nibbles the last 16, each stored +8). Both vector paths widen from here. */
static inline __attribute__((always_inline)) void group_bytes(int bits, const uint8_t *q, __m128i *lo,
                                                              __m128i *hi) {
    if (bits == 8) {
        *lo = _mm_loadu_si128((const __m128i *)q);
        *hi = _mm_loadu_si128((const __m128i *)(q + 16));
        return;
    }
    __m128i packed = _mm_loadu_si128((const __m128i *)q), nib = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    *lo = _mm_sub_epi8(_mm_and_si128(packed, nib), eight);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(packed, 4), nib), eight);
}

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

static inline __attribute__((always_inline)) void group8_avx2(int bits, const uint8_t *q, __m256 w[4]) {
    __m128i lo, hi;
    group_bytes(bits, q, &lo, &hi);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

static inline float int_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m * ldo] = sum_k W[n, k] x[m * K + k] for rows m < R (R <= 8) of one weight row n. */
static inline __attribute__((always_inline)) void row_avx2(int bits, int R, const uint8_t *q, const uint16_t *s,
                                                           int64_t K, const float *x, float *out, int64_t ldo) {
    __m256 acc[8];
    float sc[INT_SCALES];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t gbytes = bits == 8 ? INT_GROUP : INT_GROUP / 2, groups = K / INT_GROUP;
    for (int64_t g = 0; g < groups; g++) {
        if (g % INT_SCALES == 0) group_scales(s, g, groups, sc);
        __m256 w[4];
        group8_avx2(bits, q + g * gbytes, w);
        const __m256 d = _mm256_broadcast_ss(sc + g % INT_SCALES);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + g * INT_GROUP;
            __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
            t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), t);
            t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), t);
            t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), t);
            acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = int_hsum8(acc[r]);
}

static void rows_avx2(int bits, int R, const uint8_t *q, const uint16_t *s, int64_t K, const float *x, float *out,
                      int64_t ldo) {
    switch (R) { /* constant row counts keep the accumulators in registers */
    case 1: row_avx2(bits, 1, q, s, K, x, out, ldo); break;
    case 2: row_avx2(bits, 2, q, s, K, x, out, ldo); break;
    case 3: row_avx2(bits, 3, q, s, K, x, out, ldo); break;
    case 4: row_avx2(bits, 4, q, s, K, x, out, ldo); break;
    case 5: row_avx2(bits, 5, q, s, K, x, out, ldo); break;
    case 6: row_avx2(bits, 6, q, s, K, x, out, ldo); break;
    case 7: row_avx2(bits, 7, q, s, K, x, out, ldo); break;
    default: row_avx2(bits, 8, q, s, K, x, out, ldo); break;
    }
}

/* ---- AVX-512 path: a group as two vectors of 16 fp32, up to 16 rows per tile --------------------------- */

#define INT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma,avx2")))

static inline __attribute__((always_inline)) INT_AVX512 void group16_avx512(int bits, const uint8_t *q,
                                                                             __m512 w[2]) {
    __m128i lo, hi;
    group_bytes(bits, q, &lo, &hi);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
}

static inline __attribute__((always_inline)) INT_AVX512 void row_avx512(int bits, int R, const uint8_t *q,
                                                                         const uint16_t *s, int64_t K,
                                                                         const float *x, float *out, int64_t ldo) {
    __m512 acc[16];
    float sc[INT_SCALES];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t gbytes = bits == 8 ? INT_GROUP : INT_GROUP / 2, groups = K / INT_GROUP;
    for (int64_t g = 0; g < groups; g++) {
        if (g % INT_SCALES == 0) group_scales(s, g, groups, sc);
        __m512 w[2];
        group16_avx512(bits, q + g * gbytes, w);
        const __m512 d = _mm512_set1_ps(sc[g % INT_SCALES]);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + g * INT_GROUP;
            const __m512 t = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(xr)));
            acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
}

static INT_AVX512 void rows_avx512(int bits, int R, const uint8_t *q, const uint16_t *s, int64_t K, const float *x,
                                   float *out, int64_t ldo) {
    switch (R) {
    case 1: row_avx512(bits, 1, q, s, K, x, out, ldo); break;
    case 2: row_avx512(bits, 2, q, s, K, x, out, ldo); break;
    case 3: row_avx512(bits, 3, q, s, K, x, out, ldo); break;
    case 4: row_avx512(bits, 4, q, s, K, x, out, ldo); break;
    case 5: row_avx512(bits, 5, q, s, K, x, out, ldo); break;
    case 6: row_avx512(bits, 6, q, s, K, x, out, ldo); break;
    case 7: row_avx512(bits, 7, q, s, K, x, out, ldo); break;
    case 8: row_avx512(bits, 8, q, s, K, x, out, ldo); break;
    case 9: row_avx512(bits, 9, q, s, K, x, out, ldo); break;
    case 10: row_avx512(bits, 10, q, s, K, x, out, ldo); break;
    case 11: row_avx512(bits, 11, q, s, K, x, out, ldo); break;
    case 12: row_avx512(bits, 12, q, s, K, x, out, ldo); break;
    case 13: row_avx512(bits, 13, q, s, K, x, out, ldo); break;
    case 14: row_avx512(bits, 14, q, s, K, x, out, ldo); break;
    case 15: row_avx512(bits, 15, q, s, K, x, out, ldo); break;
    default: row_avx512(bits, 16, q, s, K, x, out, ldo); break;
    }
}

/* ---- the GEMM over a range of weight rows ------------------------------------------------------------------ */

/* y[m * ldy + n] = sum_k W[n, k] x[m * K + k] for m < M and the weight rows n in [n0, n1), with q [N, K] the
 * integer values and s [N, K / 32] the fp16 scales of W; x [M, K] fp32 contiguous. Each row prefetches the
 * bytes PF_BYTES (decode_kernels.c) further on as it starts, going on at ``next`` (where the caller reads next;
 * NULL: nowhere) past row n1, so a run of small matrices (the experts of a step) reads as one stream. */
static void int_rows(int bits, const uint8_t *q, const uint16_t *s, int64_t K, const float *x, int64_t M,
                     float *y, int64_t ldy, int64_t n0, int64_t n1, const char *next) {
    const int wide = dsv3_int_avx512(-1), tile = wide ? 16 : 8;
    const int64_t rb = int_row_bytes(bits, K), groups = K / INT_GROUP;
    const char *end = (const char *)q + n1 * rb;
    for (const char *p = (const char *)q + n0 * rb; p < end && p < (const char *)q + n0 * rb + PF_BYTES; p += 64)
        _mm_prefetch(p, _MM_HINT_T0); /* this call's own first bytes */
    for (int64_t n = n0; n < n1; n++) {
        const char *pf = (const char *)q + n * rb + PF_BYTES;
        if (pf >= end) pf = next ? next + (pf - end) : NULL;
        if (pf)
            for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            const int R = (int)(M - m0 < tile ? M - m0 : tile);
            if (wide)
                rows_avx512(bits, R, q + n * rb, s + n * groups, K, x + m0 * K, y + m0 * ldy + n, ldy);
            else
                rows_avx2(bits, R, q + n * rb, s + n * groups, K, x + m0 * K, y + m0 * ldy + n, ldy);
        }
    }
}
