/* Decode kernels over group-wise integer weights (dsv3/kernels/int_weights.py describes the format).
 *
 * A weight [N, K] is stored as N rows of K/32 groups. Each group has one fp16 scale d and 32 signed
 * integers q; its values are d * q. int8: 32 bytes per group, q[j] in byte j. int4: 16 bytes per group,
 * q[j] + 8 in the low nibble of byte j and q[j + 16] + 8 in its high nibble (j < 16).
 *
 * The GEMM reads the weights in place: each group is widened to fp32 in registers, multiplied by its scale,
 * and used for up to TILE rows of activations at once, so a weight byte is read from memory once per tile.
 * Two paths, chosen at run time: AVX-512 (where the CPU has AVX-512F) and AVX2/FMA/F16C (the baseline);
 * dsv3_int_avx512(0) forces the baseline so both can be tested on one machine. Sums are fp32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DSV3_INT_ABI 1
#define GROUP 32

int64_t dsv3_int_abi(void) { return DSV3_INT_ABI; }

static int use_avx512 = -1;

/* want 0: the AVX2 path; 1: AVX-512 where the CPU has it; -1: query. Returns whether AVX-512 runs. */
int dsv3_int_avx512(int want) {
    if (use_avx512 < 0 || want >= 0)
        use_avx512 = want != 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return use_avx512;
}

static inline int64_t row_bytes(int bits, int64_t K) { return bits == 8 ? K : K / 2; }

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

/* ---- AVX2 path: a group as four vectors of 8 fp32 ---------------------------------------------------- */

static inline __attribute__((always_inline)) void group8_avx2(int bits, const uint8_t *q, float d, __m256 w[4]) {
    __m128i lo, hi;
    group_bytes(bits, q, &lo, &hi);
    __m256 scale = _mm256_set1_ps(d);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), scale);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), scale);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), scale);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), scale);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m * ldo + n] = sum_k W[n, k] x[m * K + k] for rows m < R (R <= 8) of one weight row n. */
static inline __attribute__((always_inline)) void row_avx2(int bits, int R, const uint8_t *q, const uint16_t *s,
                                                           int64_t K, const float *x, float *out, int64_t ldo) {
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t gbytes = bits == 8 ? GROUP : GROUP / 2;
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 w[4];
        group8_avx2(bits, q + g * gbytes, _cvtsh_ss(s[g]), w);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + g * GROUP;
            acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum8(acc[r]);
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

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma,avx2")))

static inline __attribute__((always_inline)) AVX512 void group16_avx512(int bits, const uint8_t *q, float d,
                                                                         __m512 w[2]) {
    __m128i lo, hi;
    group_bytes(bits, q, &lo, &hi);
    __m512 scale = _mm512_set1_ps(d);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), scale);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), scale);
}

static inline __attribute__((always_inline)) AVX512 void row_avx512(int bits, int R, const uint8_t *q,
                                                                     const uint16_t *s, int64_t K, const float *x,
                                                                     float *out, int64_t ldo) {
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t gbytes = bits == 8 ? GROUP : GROUP / 2;
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m512 w[2];
        group16_avx512(bits, q + g * gbytes, _cvtsh_ss(s[g]), w);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * K + g * GROUP;
            acc[r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
}

static AVX512 void rows_avx512(int bits, int R, const uint8_t *q, const uint16_t *s, int64_t K, const float *x,
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

/* ---- the GEMM: out [M, N] (row stride ldo) = x [M, K] W^T, fp32 ------------------------------------------ */

static void gemm(int bits, const uint8_t *q, const uint16_t *s, int64_t N, int64_t K, const float *x, int64_t M,
                 float *out, int64_t ldo, int nt) {
    const int wide = dsv3_int_avx512(-1), tile = wide ? 16 : 8;
    const int64_t rb = row_bytes(bits, K), groups = K / GROUP;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            int R = (int)(M - m0 < tile ? M - m0 : tile);
            if (wide)
                rows_avx512(bits, R, q + n * rb, s + n * groups, K, x + m0 * K, out + m0 * ldo + n, ldo);
            else
                rows_avx2(bits, R, q + n * rb, s + n * groups, K, x + m0 * K, out + m0 * ldo + n, ldo);
        }
    }
}

/* x [M, K] fp32 times the integer weight [N, K] transposed -> out [M, N] fp32. Returns 0, or 1 when K is not
 * a whole number of groups. */
int dsv3_int_linear(int bits, const void *q, const uint16_t *s, int64_t N, int64_t K, const float *x, int64_t M,
                    float *out, int nt) {
    if (K % GROUP) return 1;
    gemm(bits, (const uint8_t *)q, s, N, K, x, M, out, N, nt);
    return 0;
}

/* out [M, D] fp32 += sum_j gates[m, j] * SwiGLU_{idx[m, j]}(x[m]) over stacked integer experts gate, up
 * [E, I, D] and down [E, D, I]. Each expert runs once over all the rows routed to it (gathered), so its
 * weights are read once per step. Returns 0, 1 for a shape that is not whole groups, 2 for an expert index
 * outside [0, E), 3 when out of memory. */
int dsv3_int_swiglu_experts(int bits, const void *gate_q, const uint16_t *gate_s, const void *up_q,
                            const uint16_t *up_s, const void *down_q, const uint16_t *down_s, int64_t E, int64_t I,
                            int64_t D, const float *x, int64_t M, const int64_t *idx, const float *gates, int64_t K,
                            float *out, int nt) {
    if (I % GROUP || D % GROUP) return 1;
    for (int64_t p = 0; p < M * K; p++)
        if (idx[p] < 0 || idx[p] >= E) return 2;
    int64_t *pairs = malloc(sizeof(int64_t) * (M * K + 1));
    float *xs = malloc(sizeof(float) * (M * K * D + 1)), *g = malloc(sizeof(float) * (M * K * I + 1));
    float *u = malloc(sizeof(float) * (M * K * I + 1)), *y = malloc(sizeof(float) * (M * K * D + 1));
    int rc = 0;
    if (!pairs || !xs || !g || !u || !y) {
        rc = 3;
        goto done;
    }
    const int64_t up_bytes = I * row_bytes(bits, D), down_bytes = D * row_bytes(bits, I);
    for (int64_t e = 0; e < E; e++) {
        int64_t c = 0;
        for (int64_t p = 0; p < M * K; p++)
            if (idx[p] == e) {
                pairs[c] = p;
                memcpy(xs + c * D, x + (p / K) * D, sizeof(float) * D);
                c++;
            }
        if (!c) continue;
        gemm(bits, (const uint8_t *)gate_q + e * up_bytes, gate_s + e * I * (D / GROUP), I, D, xs, c, g, I, nt);
        gemm(bits, (const uint8_t *)up_q + e * up_bytes, up_s + e * I * (D / GROUP), I, D, xs, c, u, I, nt);
        for (int64_t i = 0; i < c * I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        gemm(bits, (const uint8_t *)down_q + e * down_bytes, down_s + e * D * (I / GROUP), D, I, g, c, y, D, nt);
        for (int64_t r = 0; r < c; r++) {
            float w = gates[pairs[r]], *o = out + (pairs[r] / K) * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * y[r * D + d];
        }
    }
done:
    free(pairs), free(xs), free(g), free(u), free(y);
    return rc;
}
