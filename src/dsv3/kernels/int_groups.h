/* Matrix kernels over group-wise integer weights (dsv3/kernels/int_weights.py describes the format), a part of
 * decode_kernels.c (which includes this file: one translation unit, so the linear layers, the experts and the
 * block kernel read integer weights through the same code as fp32, bf16 and FP8 ones).
 *
 * A weight [N, K] is stored as N rows of K/32 groups. Each group has one fp16 scale d and 32 signed
 * integers q; its values are d * q. int8: 32 bytes per group, q[j] in byte j. int4: 16 bytes per group,
 * q[j] + 8 in the low nibble of byte j and q[j + 16] + 8 in its high nibble (j < 16).
 *
 * The GEMM reads the weights in place, a group at a time, and adds each group's dot product times its
 * scale(s) to the row's fp32 total, so each total waits on one FMA per group. A row's result does not depend
 * on how many rows share the call. Two paths, chosen at run time (dsv3_int_avx512(0) forces the second, so
 * both can be tested on one machine):
 * - AVX-512 (where the CPU has AVX-512F/BW): each group widened to fp32 in registers (its integers exactly)
 *   and multiplied with the activations as they are. int4 nibbles are used as stored (q + 8) and 8 times the
 *   activations' group sum is taken off once per group.
 * - AVX2/FMA/F16C (the baseline): the activations rounded to int16 per group of 32 (a step of 2^-15 of the
 *   group's largest magnitude, so at most 2^-16 of it off), and each group's dot product taken in exact
 *   int32 sums by _mm256_madd_epi16. Widening to fp32 costs three or four operations per 8 values there,
 *   among them lane-crossing ones, of which the CPU runs fewer per cycle; in integers a group is about half
 *   the operations (the int4 path widens with one lane-crossing operation per group, not two).
 *   On a 2-core AMD EPYC (Zen 3), against the fp32 widening (benchmarks/decode_kernels_speed.py
 *   --kinds int8,int4 --baseline-rev, record 5 of decode_kernels_speed.json): 1.14-1.57x for the head, the
 *   attention output, the dense MLP and one routed expert at one row (int4), 1.01-1.21x (int8).
 * With few activation rows (decode: 1 to 4 on AVX-512, 1 or 2 on AVX2) several weight rows run at once, for
 * independent totals and shared activation loads (4 on AVX-512; on AVX2 4 for one row of int4, else 2);
 * with more, one weight row's groups are widened once for a tile of up to 16 (8) activation rows.
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

/* ---- AVX2 path: integer dot products over activations rounded to int16 ---------------------------------- */

/* AVX2 has no fast way to widen a group to fp32 (three or four operations per 8 values before the FMA), so
 * this path keeps the weights integers: each activation group of 32 is rounded to int16 with an fp32 scale
 * (its largest magnitude / 32767; the rounding is at most half a step, 2^-16 of that magnitude), and a group's
 * dot product is two _mm256_madd_epi16 of 16 pairs each into 8 exact int32 sums; one conversion and one FMA
 * by (weight scale x activation scale) add it to the row's fp32 total. About half the operations per group of
 * the fp32 widening, and the products exact. A row's activations are rounded on their own, so a row's
 * result still does not depend on the rows beside it or on the threads. */

/* The activations x [M, K] as int16 groups: xq [M, K], xs [M, K / 32] their scales (NaN for a group holding
 * an inf or NaN, so that the result is NaN as in fp32), and for int4 xoff [M, K / 32] = -8 * sum(xq) of each
 * group, the nibbles' offset (stored as q + 8) taken off in the integer sum. */
static void int16_groups(const float *x, int64_t M, int64_t K, int16_t *xq, float *xs, int32_t *xoff) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M * (K / INT_GROUP); i++) {
        const float *xg = x + i * INT_GROUP;
        __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xg + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[j], v[j]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        }
        float m[8];
        _mm256_storeu_ps(m, amax);
        float top = m[0];
        for (int j = 1; j < 8; j++) top = m[j] > top ? m[j] : top;
        const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
        xs[i] = _mm256_movemask_ps(bad) ? __builtin_nanf("") : top / 32767.0f;
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j += 2) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], _mm256_set1_ps(inv)));
            /* packs works within 128-bit lanes: put the 16 values back in column order */
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + i * INT_GROUP + 8 * j), packed);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(packed, _mm256_set1_epi16(1)));
        }
        if (xoff) {
            int32_t s[8];
            _mm256_storeu_si256((__m256i *)s, sum);
            xoff[i] = -8 * (s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7]);
        }
    }
}

/* A group's weights as int16, w[0] columns 0-15 and w[1] columns 16-31. int4: the nibbles as stored (q + 8, 0
 * to 15; xoff takes 8 * the group's activation sum off). */
static inline __attribute__((always_inline)) void group16_int16(int bits, const uint8_t *q, __m256i w[2]) {
    if (bits == 4) { /* each byte widened once; its low nibble masked, its high one shifted down */
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
        w[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
        w[1] = _mm256_srli_epi16(v, 4);
        return;
    }
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
}

static inline float int_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Group g of the NW weight rows (rows rb bytes apart) times the R activation rows into acc: the int32 dot
 * product times sc[i][r][j], that group's weight scale x activation scale (j = g % INT_SCALES). */
static inline __attribute__((always_inline)) void group_avx2(int bits, int NW, int R, const uint8_t *q, int64_t rb,
                                                             int64_t K, int64_t groups, const int16_t *xq,
                                                             const int32_t *xoff, float sc[4][8][INT_SCALES],
                                                             int64_t g, int j, __m256 acc[4][8]) {
    const int64_t gbytes = bits == 8 ? INT_GROUP : INT_GROUP / 2;
    __m256i w[4][2];
    for (int i = 0; i < NW; i++) group16_int16(bits, q + i * rb + g * gbytes, w[i]);
    for (int r = 0; r < R; r++) {
        const int16_t *xr = xq + r * K + g * INT_GROUP;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xr), x1 = _mm256_loadu_si256((const __m256i *)(xr + 16));
        for (int i = 0; i < NW; i++) {
            __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w[i][0], x0), _mm256_madd_epi16(w[i][1], x1));
            if (bits == 4) d = _mm256_add_epi32(d, _mm256_zextsi128_si256(_mm_cvtsi32_si128(xoff[r * groups + g])));
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(&sc[i][r][j]), acc[i][r]);
        }
    }
}

/* out[m * ldo + i] = sum_k W[n + i, k] x[m, k] for the NW weight rows n + i (rows rb bytes apart) and the
 * activation rows m < R, x as int16_groups made it (xq, xs, xoff: row m at m * K, m * groups); NW * R <= 8.
 * Groups go in runs of INT_SCALES: the run's scale products first, then its groups. */
static inline __attribute__((always_inline)) void row_avx2(int bits, int NW, int R, const uint8_t *q,
                                                           const uint16_t *s, int64_t rb, int64_t K,
                                                           const int16_t *xq, const float *xs,
                                                           const int32_t *xoff, float *out, int64_t ldo) {
    __m256 acc[4][8];
    float sw[4][INT_SCALES], sc[4][8][INT_SCALES];
    const int64_t groups = K / INT_GROUP;
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += INT_SCALES) {
        const int n = g0 + INT_SCALES <= groups ? INT_SCALES : (int)(groups - g0);
        for (int i = 0; i < NW; i++) { /* the products of the weight and activation scales of these groups */
            group_scales(s + i * groups, g0, groups, sw[i]);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < n; j++) sc[i][r][j] = sw[i][j] * xs[r * groups + g0 + j];
        }
        if (n == INT_SCALES) {
#pragma GCC unroll 8
            for (int j = 0; j < INT_SCALES; j++)
                group_avx2(bits, NW, R, q, rb, K, groups, xq, xoff, sc, g0 + j, j, acc);
        } else {
            for (int j = 0; j < n; j++) group_avx2(bits, NW, R, q, rb, K, groups, xq, xoff, sc, g0 + j, j, acc);
        }
    }
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = int_hsum8(acc[i][r]);
}

/* row_avx2 with the width, NW and R as constants (accumulators in registers): NW 1 to 4 with R 1, NW 1 or 2
 * with R 2, NW 1 with R up to 8. */
static void rows_avx2(int bits, int NW, int R, const uint8_t *q, const uint16_t *s, int64_t rb, int64_t K,
                      const int16_t *xq, const float *xs, const int32_t *xoff, float *out, int64_t ldo) {
#define INT_ROW(nw, r)                                                                                              \
    (bits == 8 ? row_avx2(8, nw, r, q, s, rb, K, xq, xs, xoff, out, ldo)                                           \
               : row_avx2(4, nw, r, q, s, rb, K, xq, xs, xoff, out, ldo))
    if (NW == 4) {
        INT_ROW(4, 1);
        return;
    }
    if (NW == 3) {
        INT_ROW(3, 1);
        return;
    }
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

/* A group's values as fp32, columns 0-15 and 16-31 (the integers exactly). int4: the nibbles as stored (q + 8, 0
 * to 15; the caller starts each group's sum from -8 * the activations' group sum, xoff). */
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

/* out[m * ldo + i] = sum_k W[n + i, k] x[m * K + k] for the NW weight rows n + i (rows rb bytes apart) and the
 * activation rows m < R, NW * R <= 16: each group widened to fp32 and multiplied with the activations as they
 * are (AVX-512 converts 16 values in two operations, so the fp32 products cost little here). */
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

/* No memory for int_rows' scratch: its outputs are NaN, which no caller mistakes for a result. */
static void int_rows_failed(int64_t M, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) y[m * ldy + n] = __builtin_nanf("");
}

/* y[m * ldy + n] = sum_k W[n, k] x[m * K + k] for m < M and the weight rows n in [n0, n1), with q [N, K] the
 * integer values and s [N, K / 32] the fp16 scales of W; x [M, K] fp32 contiguous. Each row prefetches the
 * bytes PF_BYTES (decode_kernels.c) further on as it starts, going on at ``next`` (where the caller reads next;
 * NULL: nowhere) past row n1, so a run of small matrices (the experts of a step) reads as one stream. */
static void int_rows(int bits, const uint8_t *q, const uint16_t *s, int64_t K, const float *x, int64_t M,
                     float *y, int64_t ldy, int64_t n0, int64_t n1, const char *next) {
    const int wide = dsv3_int_avx512(-1);
    /* few activation rows: NW weight rows at once, for independent sums and shared activation loads (AVX2: 4
     * for one row of int4, else 2: int8 measured no faster with 4 in a whole step); many: one weight row, its
     * groups widened once for a tile of up to 16 (8) rows */
    const int few = M <= (wide ? 4 : 2), tile = few ? (int)M : wide ? 16 : 8;
    const int nw = few ? (wide || (M == 1 && bits == 4) ? 4 : 2) : 1;
    const int64_t rb = int_row_bytes(bits, K), groups = K / INT_GROUP;
    const char *end = (const char *)q + n1 * rb;
    /* AVX-512: int4 needs -8 * each group's activation sum (xoff), the offset of the nibbles as stored (q + 8);
     * AVX2: the activations as int16 groups (xq, xs, and xoff in integers for int4) */
    float *xoff = NULL, *xs = NULL;
    int16_t *xq = NULL;
    int32_t *xoff_i = NULL;
    if (wide && bits == 4) {
        xoff = (float *)malloc((size_t)(M * groups + 1) * sizeof(float));
        if (!xoff) {
            int_rows_failed(M, y, ldy, n0, n1);
            return;
        }
        for (int64_t i = 0; i < M * groups; i++) {
            float sum = 0.0f;
            for (int j = 0; j < INT_GROUP; j++) sum += x[i * INT_GROUP + j];
            xoff[i] = -8.0f * sum;
        }
    } else if (!wide) {
        char *buf = (char *)malloc((size_t)(M * K) * sizeof(int16_t) + (size_t)(2 * M * groups + 1) * sizeof(float));
        if (!buf) {
            int_rows_failed(M, y, ldy, n0, n1);
            return;
        }
        xs = (float *)buf, xoff_i = (int32_t *)(xs + M * groups), xq = (int16_t *)(xoff_i + M * groups + 1);
        int16_groups(x, M, K, xq, xs, bits == 4 ? xoff_i : NULL);
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
                rows_avx2(bits, NW, R, q + n * rb, s + n * groups, rb, K, xq + m0 * K, xs + m0 * groups,
                          xoff_i + m0 * groups, y + m0 * ldy + n, ldy);
        }
    }
    free(xoff);
    free(xs);
}
