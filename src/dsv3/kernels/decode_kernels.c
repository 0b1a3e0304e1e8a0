/* Decode-step kernels for x86 CPUs with AVX2, FMA and F16C: matrix-vector products (a handful of rows of
 * activations against one weight matrix) that read fp32, bf16, FP8 e4m3 (128x128 block scales) or integer
 * group (int8, int4: int_groups.h) weights straight from where they live, converting each weight in
 * registers. No dequantized copy of a matrix is ever made, and a decode step's whole routed MoE is one call;
 * so is a whole block (dsv3_decode_block).
 * On CPUs that also have AVX512-BF16, bf16 weights times bf16 activations (except on Intel's, see gemv_dots) and
 * a bf16 model's attention over a bf16 cache use its bf16 dot products; on CPUs with AMX-BF16 both take AMX
 * tiles instead (amx_gemv_rows, amx_attention); with AVX-512F, integer groups, FP8
 * weights (from one activation row) and the GEMVs of several activation rows have AVX-512 paths (chosen at run
 * time; the rest of the file is AVX2 only).
 *
 * Built and loaded at first use by decode_kernels.py (cc -O3 -mavx2 -mfma -mf16c -fopenmp); every function
 * has a plain PyTorch reference there, and the tests compare the two.
 *
 * Weights are [N, K] row-major. FP8 scales are [ceil(N/128), ceil(K/128)] fp32, already multiplied by
 * 256; integer groups' scales [N, K/32] fp16. The one matrix kernel (gemv_tiles, under dsv3_linear,
 * dsv3_swiglu_experts and dsv3_route) turns an e4m3 byte into fp32 with integer shifts (see "The GEMV core"
 * below) and hands integer groups to int_rows. Activations are fp32 or bf16, accumulated in fp32.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The version of this file's calling interface (its exported functions' arguments and structures), which
 * decode_kernels.py checks at load (dsv3_abi): raise it with any change of a signature. */
#ifndef DSV3_KERNELS_ABI
#define DSV3_KERNELS_ABI 7
#endif
int64_t dsv3_abi(void) { return DSV3_KERNELS_ABI; }

enum { W_F32 = 0, W_BF16 = 1, W_FP8 = 2, W_INT8 = 3, W_INT4 = 4 }; /* INT: groups of 32, int_groups.h */
enum { A_F32 = 0, A_BF16 = 1 };
#define FP8_BLOCK 128

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static size_t elem_size(int kind) { return kind == W_F32 ? 4 : kind == W_BF16 ? 2 : 1; }
static int is_int(int kind) { return kind == W_INT8 || kind == W_INT4; }

/* Bytes of n weights of ``kind`` stored contiguously (int4: two per byte; their fp16 group scales apart). */
static size_t weight_bytes(int kind, int64_t n) { return kind == W_INT4 ? (size_t)n / 2 : (size_t)n * elem_size(kind); }

static float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static float *to_f32(const void *a, int akind, int64_t n) {
    float *out = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) out[i] = akind == A_F32 ? ((const float *)a)[i] : bf16_to_f32(((const uint16_t *)a)[i]);
    return out;
}

/* out[i] (+)= y[i] in the activation dtype. */
static void store(void *out, int okind, const float *y, int64_t n, int accumulate) {
    for (int64_t i = 0; i < n; i++) {
        if (okind == A_F32) {
            float *o = (float *)out + i;
            *o = accumulate ? *o + y[i] : y[i];
        } else {
            uint16_t *o = (uint16_t *)out + i;
            *o = f32_to_bf16(accumulate ? bf16_to_f32(*o) + y[i] : y[i]);
        }
    }
}

/* ---- The GEMV core: NR weight rows per tile ----
 * A decode GEMV is a race to read the weights. One weight row at a time leaves the FMA units waiting on
 * a two-deep dependency chain and pays a horizontal sum per row; NR rows at once share every activation
 * load, keep 8 independent accumulators in flight and reduce NR rows with one transposing hadd. A tile's
 * NR rows are one contiguous block read as NR short streams, which the hardware prefetcher follows badly
 * when rows are short: each tile prefetches the block PF_BYTES ahead in address order as it goes.
 * FP8 block scales are folded into a copy of the activations (one multiply per activation per 128 weight
 * rows), so the inner loop is the same for every weight kind: load, convert, FMA.
 *
 * Several activation rows (batched decode, MTP verification, short prefills) must read each weight once and
 * use it for every row from registers: with AVX2's 2 FMAs per cycle, 16 rows need 16 FMAs per weight, so from
 * about 3 rows (fp32) or 5 (bf16) on the FMA units, not memory, set the pace. The micro-tile (tilec) is the
 * tile's 4 weight rows by 3 activation rows: 12 accumulators, 3 activation vectors and one converted weight
 * in the 16 registers, 7 loads per 12 FMAs.
 *
 * FP8 conversion without F16C (whose vcvtph2ps is one per two cycles on AMD Zen 3: 4 weights per cycle at
 * best): an e4m3 byte at the top of a 32-bit lane (zeros below), shifted right arithmetically by 4 and masked
 * to sign, 4 exponent and 3 mantissa bits, is the fp32 number e4m3 value * 2^-120 exactly (e4m3 subnormals
 * become fp32 subnormals, so the kernel clears DAZ while it runs). Whole 64-column groups shift two bytes per
 * 16-bit word at once (fp8_group_block); a last 16-column block gets its bytes there by one byte shuffle per 8
 * (fp8_to_top); a last group of 8 columns by sign extension and a left shift
 * by 20, which gives the same numbers at one more operation per 8 on the shift unit, the bottleneck of this
 * conversion on 128-bit-wide AMD Zen 1 (1.03-1.10x on one row, benchmarks/decode_kernels_speed.py). The activations carry the compensating 2^64 (with the block scale)
 * and the sums the remaining 2^56: powers of two, so no rounding beyond the scale multiply; a product only
 * loses precision below 2^-70 of the true value's scale, far below fp32's resolution of the sum. */
#define NR 4
/* From this many activation rows on, a tile's bf16 or FP8 weights are converted once into an fp32 panel:
 * FP8's conversion costs three operations per 8 weights against bf16's one, so it pays from fewer rows
 * (measured on AMD Zen 1 with decode_kernels_speed.py: FP8 1.1x at 8 rows, 1.25-1.33x at 16; bf16 1.0x at
 * 16, slower at 8). */
#define PANEL_MIN_ROWS_BF16 24
#define PANEL_MIN_ROWS_FP8 8
static int converts_to_panel(int kind, int64_t M) {
    return kind == W_BF16 ? M >= PANEL_MIN_ROWS_BF16 : kind == W_FP8 && M >= PANEL_MIN_ROWS_FP8;
}
/* How far ahead of the tile being read the prefetches run: enough bytes in flight to cover the memory's latency
 * at full bandwidth (~30 GB/s x ~150 ns is 4.5 KB on the test host), with room. 4 KB, one bf16 tile of a
 * 512-column matrix, left the bf16 GEMVs 0.77-0.91x as fast as at 8 KB (decode_kernels_speed.py, 1 thread);
 * fp32 tiles of 512 columns were already 8 KB ahead (a whole tile), and 32 KB was slower again. */
#define PF_BYTES 8192
#define FP8_X_SHIFT 0x1p56f   /* on the activations, with the scale (which the caller multiplied by 256) */
#define FP8_Y_SHIFT 0x1p56f   /* on the sums: 2^-120 * 2^8 * 2^56 * 2^56 = 1 */

#include "int_groups.h" /* int_rows: the GEMV over integer groups (W_INT8, W_INT4) */

/* 8 weights of a row from column k, as fp32 (FP8: value * 2^-120). */
static inline __attribute__((always_inline)) __m256 wload8(int kind, const void *row, int64_t k) {
    if (kind == W_F32) return _mm256_loadu_ps((const float *)row + k);
    if (kind == W_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)row + k)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32((int)0x87F00000)));
}

/* One weight as wload8 converts it. */
static inline float wload1(int kind, const void *row, int64_t k) {
    if (kind == W_F32) return ((const float *)row)[k];
    if (kind == W_BF16) return bf16_to_f32(((const uint16_t *)row)[k]);
    const uint32_t bits = ((uint32_t)(int32_t)((const int8_t *)row)[k] << 20) & 0x87F00000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 16 bf16 values at p as fp32: their even-indexed ones (each 32-bit pair shifted left by 16) and their odd ones
 * (the pair with its low half masked off): two operations for 16 values where widening takes four. */
static inline __attribute__((always_inline)) __m256 bf16_even8(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16));
}
static inline __attribute__((always_inline)) __m256 bf16_odd8(const void *p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p),
                                                 _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* FP8 bytes at the top of 32-bit lanes (zeros below) as fp32 e4m3 value * 2^-120: sign kept, exponent and
 * mantissa shifted down four bits (an arithmetic shift, then the sign's copies masked off). */
static inline __attribute__((always_inline)) __m256 fp8_top_to_f32(__m256i top) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(top, 4), _mm256_set1_epi32((int)0x87F00000)));
}

/* The byte shuffle that puts bytes first..first+7 of a 16-byte block (in both 128-bit lanes) at the top of
 * the eight 32-bit lanes: first..first+3 in the low lane, first+4..first+7 in the high one. */
static inline __attribute__((always_inline)) __m256i fp8_to_top(int first) {
    const char z = (char)0x80, a = (char)first, b = (char)(first + 4);
    return _mm256_setr_epi8(z, z, z, a, z, z, z, (char)(a + 1), z, z, z, (char)(a + 2), z, z, z, (char)(a + 3),
                            z, z, z, b, z, z, z, (char)(b + 1), z, z, z, (char)(b + 2), z, z, z, (char)(b + 3));
}

/* Whole 64-column groups of FP8 weights convert two bytes per 16-bit word. A 32-byte half of a group holds 8
 * dwords of 4 bytes (b3 at the top); an arithmetic shift of each 16-bit word by 4 puts b3 (high word) and b1
 * (low word) where fp8_top_to_f32 puts one byte, the mask keeps b3 as fp32, and the same masked after a 32-bit
 * shift by 16 gives b1; shifting each word left by 8 first does the same for b2 and b0: 9 operations per 32
 * weights where the byte shuffle takes 12 (and two broadcasts). A group's four 16-column blocks (the kernel's
 * column order, fp8_group_column) are its bytes 3, 1, 2 and 0 of every dword: block q is [vector q of the
 * first half | vector q of the second], so the tile's chain a (the first 8 columns of each block) reads the
 * first half only and chain b the second, and the AVX-512 tiles convert both halves in one 64-byte register
 * with the same 9 operations (fp8_group_z): 64 weights per 9 where AVX2 converts 32. The activations come in
 * that order (fp8_group_order). */
#define FP8_GROUP 64
static inline __attribute__((always_inline)) void fp8_group_block(const uint8_t *half, int second, __m256 *w0,
                                                                  __m256 *w1) {
    __m256i v = _mm256_loadu_si256((const __m256i *)half);
    if (second) v = _mm256_slli_epi16(v, 8);
    const __m256i w = _mm256_srai_epi16(v, 4), mask = _mm256_set1_epi32((int)0x87F00000);
    *w0 = _mm256_castsi256_ps(_mm256_and_si256(w, mask));
    *w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(w, 16), mask));
}

/* Vector q (0 to 3: bytes 3, 1, 2, 0 of its dwords) of a group's 32-byte half. */
static inline __attribute__((always_inline)) __m256 fp8_group_vector(const uint8_t *half, int q) {
    __m256 w0, w1;
    fp8_group_block(half, q >= 2, &w0, &w1);
    return q & 1 ? w1 : w0;
}

/* The natural column of position i (< 64) of a whole FP8 group in the kernel's order: block i / 16 takes byte
 * 3, 1, 2 or 0 of dword i % 16. */
static inline int fp8_group_column(int i) {
    static const int byte_of_block[4] = {3, 1, 2, 0};
    return 4 * (i % 16) + byte_of_block[i / 16];
}

/* The 16 columns k..k+15 as two vectors of 8 in the GEMV's column order (see interleave): bf16 as its even
 * columns (each 32-bit pair shifted left by 16) and its odd ones (the pair with its low half masked off), two
 * operations for 16 weights where widening takes four; fp32 and FP8 as columns k..k+7 and k+8..k+15. */
static inline __attribute__((always_inline)) void wload16(int kind, const void *row, int64_t k, __m256 *w0,
                                                          __m256 *w1) {
    if (kind == W_BF16) {
        *w0 = bf16_even8((const uint16_t *)row + k), *w1 = bf16_odd8((const uint16_t *)row + k);
        return;
    }
    if (kind == W_FP8) {
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint8_t *)row + k)));
        *w0 = fp8_top_to_f32(_mm256_shuffle_epi8(v, fp8_to_top(0)));
        *w1 = fp8_top_to_f32(_mm256_shuffle_epi8(v, fp8_to_top(8)));
        return;
    }
    *w0 = wload8(kind, row, k);
    *w1 = wload8(kind, row, k + 8);
}

/* One of wload16's two vectors: half 0 (w0) or 1 (w1). */
static inline __attribute__((always_inline)) __m256 wload16_half(int kind, const void *row, int64_t k, int half) {
    __m256 w0, w1;
    if (kind == W_BF16) return half ? bf16_odd8((const uint16_t *)row + k) : bf16_even8((const uint16_t *)row + k);
    if (kind == W_F32) return _mm256_loadu_ps((const float *)row + k + 8 * half);
    wload16(kind, row, k, &w0, &w1);
    return half ? w1 : w0;
}

/* Prefetch the cache lines of [p, p + bytes), p at a line's start (under 64 bytes: one line). */
static inline __attribute__((always_inline)) void prefetch(const char *p, int bytes) {
    for (int b = 0; b < (bytes > 64 ? bytes : 64); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* The n lines from p on, n a constant: a step's prefetch in the tiles' inner loops, where a loop over a byte
 * count known only at run time cost 0.8x of the GB/s at two activation rows (decode_kernels_speed.py). Into
 * L2 only: a tile of several activation rows re-reads them from L1 for every tile, and the next tile's lines
 * brought into L1 evicted them (fp32, 3 to 16 rows: 1.2-1.8x the GB/s with the lines kept in L2). */
static inline __attribute__((always_inline)) void prefetch_lines(const char *p, int n) {
#pragma GCC unroll 4
    for (int b = 0; b < n; b++) _mm_prefetch(p + 64 * b, _MM_HINT_T1);
}

/* The same into L1: where a tile and its rows of x leave room (one row, the dot products of few rows). */
static inline __attribute__((always_inline)) void prefetch_lines_l1(const char *p, int n) {
#pragma GCC unroll 4
    for (int b = 0; b < n; b++) _mm_prefetch(p + 64 * b, _MM_HINT_T0);
}

/* A GEMV call's rows are [first, end): it fetches its own first bytes (up to ``ahead``) on entry, since a run of
 * small matrices read in turn would otherwise start each one cold, */
static inline void prefetch_entry(const char *first, const char *end, size_t ahead) {
    const size_t span = (size_t)(end - first);
    prefetch(first, (int)(span < ahead ? span : ahead));
}

/* and a prefetch aimed at pf past end goes on at ``next``, where this thread reads after the call (NULL:
 * nowhere useful, so pf as it is). */
static inline const char *prefetch_past(const char *pf, const char *end, const char *next) {
    return next && pf >= end ? next + (pf - end) : pf;
}

/* The four horizontal sums of a, b, c, d as one vector (hadd transposition). */
static inline __attribute__((always_inline)) __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* res[r] += sum over the columns [k, K) left after the vector loop, one at a time (K not a multiple of 8). */
static inline __attribute__((always_inline)) void tail(int kind, const void *const *rows, int64_t k, int64_t K,
                                                       const float *x, float *res) {
    for (; k < K; k++)
        for (int r = 0; r < NR; r++) res[r] += wload1(kind, rows[r], k) * x[k];
}

/* The summation order, the same in every tile shape so that a row's result does not depend on how many
 * activation rows share the call (batched decode and MTP verification give the single-row numbers): per
 * (weight row, activation row), accumulator a takes the first vector of each 16-column block (wload16) and b
 * the second (a also a last group of 8 columns), then a + b is reduced by hsum4, then the columns past the
 * last multiple of 8 are added one by one (tail). For bf16 weights the two vectors are the block's even and
 * odd columns, so the activations come interleaved to match (interleave); for FP8 weights each whole 64-column
 * group is four blocks of strided columns, and fp8_group_order orders the activations to match. */

/* xi = x [M, K] with each whole 16-column block reordered as its 8 even columns then its 8 odd ones (the
 * order wload16 gives bf16 weights in); the columns past the last whole block as they are. */
static void interleave(const float *x, int64_t M, int64_t K, float *xi) {
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * K;
        float *dst = xi + m * K;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            for (int i = 0; i < 8; i++) dst[k + i] = src[k + 2 * i], dst[k + 8 + i] = src[k + 2 * i + 1];
        for (; k < K; k++) dst[k] = src[k];
    }
}

/* The inverse of interleave for one row of K values. */
static void deinterleave(const float *xi, int64_t K, float *x) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 8; i++) x[k + 2 * i] = xi[k + i], x[k + 2 * i + 1] = xi[k + 8 + i];
    for (; k < K; k++) x[k] = xi[k];
}

/* res[r] = sum_k rows[r][k] * x[k], r < NR: 16 columns per step, 8 accumulator chains.
 * pf: where to prefetch the bytes this step consumes, PF_BYTES further on (NULL: nowhere). */
static inline __attribute__((always_inline)) void tile1(int kind, const void *const *rows, int64_t K,
                                                        const float *x, float *res, const char *pf) {
    const void *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
    const int es = kind == W_F32 ? 4 : kind == W_BF16 ? 2 : 1;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, w0, w1;
    int64_t k = 0;
    if (kind == W_FP8) /* whole groups: blocks 0 and 1, then 2 and 3 (chain a the first half, b the second) */
        for (; k + FP8_GROUP <= K; k += FP8_GROUP) {
            if (pf) prefetch(pf + k * NR, FP8_GROUP * NR);
            for (int second = 0; second < 2; second++) {
                const float *xk = x + k + 32 * second;
                __m256 h0, h1;
#define FP8_ROW(r, a, b)                                                                                      \
    fp8_group_block((const uint8_t *)r + k, second, &w0, &w1), fp8_group_block((const uint8_t *)r + k + 32, second, \
                                                                               &h0, &h1),                          \
        a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk), a), b = _mm256_fmadd_ps(h0, _mm256_loadu_ps(xk + 8), b),      \
        a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + 16), a), b = _mm256_fmadd_ps(h1, _mm256_loadu_ps(xk + 24), b)
                FP8_ROW(r0, a0, b0), FP8_ROW(r1, a1, b1), FP8_ROW(r2, a2, b2), FP8_ROW(r3, a3, b3);
#undef FP8_ROW
            }
        }
    for (; k + 16 <= K; k += 16) {
        if (pf) prefetch(pf + k * NR * es, 16 * NR * es);
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        wload16(kind, r0, k, &w0, &w1), a0 = _mm256_fmadd_ps(w0, x0, a0), b0 = _mm256_fmadd_ps(w1, x1, b0);
        wload16(kind, r1, k, &w0, &w1), a1 = _mm256_fmadd_ps(w0, x0, a1), b1 = _mm256_fmadd_ps(w1, x1, b1);
        wload16(kind, r2, k, &w0, &w1), a2 = _mm256_fmadd_ps(w0, x0, a2), b2 = _mm256_fmadd_ps(w1, x1, b2);
        wload16(kind, r3, k, &w0, &w1), a3 = _mm256_fmadd_ps(w0, x0, a3), b3 = _mm256_fmadd_ps(w1, x1, b3);
    }
    if (k + 8 <= K) {
        const __m256 x0 = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(wload8(kind, r0, k), x0, a0), a1 = _mm256_fmadd_ps(wload8(kind, r1, k), x0, a1);
        a2 = _mm256_fmadd_ps(wload8(kind, r2, k), x0, a2), a3 = _mm256_fmadd_ps(wload8(kind, r3, k), x0, a3);
        k += 8;
    }
    _mm_storeu_ps(res, hsum4(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2),
                             _mm256_add_ps(a3, b3)));
    tail(kind, rows, k, K, x, res);
}

/* One half of tilec: for j = 0, 1, ..., the 8 columns at off + 16j of the NR rows against C (2 or 3) activation
 * rows, each converted weight used C times and each activation vector NR times, into acc[r + NR * i] (weight
 * row r, activation row i); with last, also the 8 columns at off + 16j past the last whole 16-step. */
static inline __attribute__((always_inline)) void halfc(int kind, int C, const void *const *rows, int64_t K,
                                                        int64_t off, int last, const float *x, int64_t ldx,
                                                        const char *pf, int pfs, __m256 *acc) {
    const void *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
    const float *y = x + ldx, *z = x + 2 * ldx; /* z: read only when C == 3 */
    /* named accumulators, not an array: GCC keeps arrays indexed in loops on the stack */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0, w;
    const int64_t whole = K / 16 * 16, half = off / 8;
#define HALFC_COLUMNS(LOAD)                                                                                    \
    do {                                                                                                       \
        const __m256 xv = _mm256_loadu_ps(x + k), yv = _mm256_loadu_ps(y + k);                                 \
        const __m256 zv = C == 3 ? _mm256_loadu_ps(z + k) : xv;                                                \
        w = LOAD(r0), a0 = _mm256_fmadd_ps(w, xv, a0), b0 = _mm256_fmadd_ps(w, yv, b0);                        \
        if (C == 3) c0 = _mm256_fmadd_ps(w, zv, c0);                                                           \
        w = LOAD(r1), a1 = _mm256_fmadd_ps(w, xv, a1), b1 = _mm256_fmadd_ps(w, yv, b1);                        \
        if (C == 3) c1 = _mm256_fmadd_ps(w, zv, c1);                                                           \
        w = LOAD(r2), a2 = _mm256_fmadd_ps(w, xv, a2), b2 = _mm256_fmadd_ps(w, yv, b2);                        \
        if (C == 3) c2 = _mm256_fmadd_ps(w, zv, c2);                                                           \
        w = LOAD(r3), a3 = _mm256_fmadd_ps(w, xv, a3), b3 = _mm256_fmadd_ps(w, yv, b3);                        \
        if (C == 3) c3 = _mm256_fmadd_ps(w, zv, c3);                                                           \
    } while (0)
#define BLOCK_HALF(r) wload16_half(kind, r, k - off, (int)half)
#define LAST_EIGHT(r) wload8(kind, r, k)
/* block q of the group at k - off - 16 q: vector q of its half (the first for chain a, the second for b) */
#define GROUP_BLOCK(r, q) fp8_group_vector((const uint8_t *)(r) + k - off - 16 * (q) + 32 * half, q)
#define GROUP_0(r) GROUP_BLOCK(r, 0)
#define GROUP_1(r) GROUP_BLOCK(r, 1)
#define GROUP_2(r) GROUP_BLOCK(r, 2)
#define GROUP_3(r) GROUP_BLOCK(r, 3)
    int64_t k = off;
    if (kind == W_FP8) /* whole groups: their four blocks in turn */
        for (const int64_t groups = K / FP8_GROUP * FP8_GROUP; k - off < groups; k += 16) {
            if (pf) prefetch_lines(pf + (k >> 4) * pfs, 1);
            HALFC_COLUMNS(GROUP_0);
            k += 16;
            if (pf) prefetch_lines(pf + (k >> 4) * pfs, 1);
            HALFC_COLUMNS(GROUP_1);
            k += 16;
            if (pf) prefetch_lines(pf + (k >> 4) * pfs, 1);
            HALFC_COLUMNS(GROUP_2);
            k += 16;
            if (pf) prefetch_lines(pf + (k >> 4) * pfs, 1);
            HALFC_COLUMNS(GROUP_3);
        }
    for (; k < whole; k += 16) {
        if (pf) prefetch_lines(pf + (k >> 4) * pfs, kind == W_F32 ? 2 : 1);
        HALFC_COLUMNS(BLOCK_HALF);
    }
    if (last && K % 16 >= 8) {
        if (pf) prefetch_lines(pf + (k >> 4) * pfs, kind == W_F32 ? 2 : 1);
        HALFC_COLUMNS(LAST_EIGHT);
    }
#undef HALFC_COLUMNS
#undef BLOCK_HALF
#undef LAST_EIGHT
#undef GROUP_BLOCK
#undef GROUP_0
#undef GROUP_1
#undef GROUP_2
#undef GROUP_3
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = b0, acc[5] = b1, acc[6] = b2, acc[7] = b3;
    acc[8] = c0, acc[9] = c1, acc[10] = c2, acc[11] = c3;
}

/* res[i * NR + r] = sum_k rows[r][k] * x[i * ldx + k], i < C (2 or 3), r < NR, in the 1-row order: the chains a
 * (columns 16j..16j+7 and a last group of 8) and b (16j+8..16j+15) of every (weight row, activation row) are
 * independent, so they run as two passes over the tile (the second from L1), each holding 4C accumulators,
 * the C activation vectors and one converted weight vector in AVX2's 16 registers: 4 + C loads per 4C FMAs.
 * Each pass prefetches pfs bytes per 16 columns: the first from pf, the second from pf + slice (see gemv_tiles). */
static inline __attribute__((always_inline)) void tilec(int kind, int C, const void *const *rows, int64_t K,
                                                        const float *x, int64_t ldx, float *res, const char *pf,
                                                        int64_t slice, int pfs) {
    __m256 a[12], b[12];
    halfc(kind, C, rows, K, 0, 1, x, ldx, pf, pfs, a);
    halfc(kind, C, rows, K, 8, 0, x, ldx, pf ? pf + slice : NULL, pfs, b);
    const int64_t k = K / 8 * 8;
    for (int i = 0; i < C; i++) {
        __m256 *ai = a + NR * i, *bi = b + NR * i;
        _mm_storeu_ps(res + i * NR, hsum4(_mm256_add_ps(ai[0], bi[0]), _mm256_add_ps(ai[1], bi[1]),
                                          _mm256_add_ps(ai[2], bi[2]), _mm256_add_ps(ai[3], bi[3])));
        tail(kind, rows, k, K, x + i * ldx, res + i * NR);
    }
}

/* tile1 or tilec with the weight kind and activation row count (1 to 3) as constants. */
static void run_tile(int kind, int mb, const void *const *rows, int64_t K, const float *x, int64_t ldx, float *res,
                     const char *pf, int64_t slice, int pfs) {
#define TILE_CASES(KIND)                                                                                  \
    switch (mb) {                                                                                        \
        case 1: tile1(KIND, rows, K, x, res, pf); break;                                                \
        case 2: tilec(KIND, 2, rows, K, x, ldx, res, pf, slice, pfs); break;                            \
        default: tilec(KIND, 3, rows, K, x, ldx, res, pf, slice, pfs); break;                           \
    }
    if (kind == W_F32) { TILE_CASES(W_F32) }
    else if (kind == W_BF16) { TILE_CASES(W_BF16) }
    else { TILE_CASES(W_FP8) }
#undef TILE_CASES
}

/* ---- The same micro-tile in AVX-512 FMAs, where the CPU has AVX-512F (chosen at run time) ----
 * With many activation rows the GEMV is FMA-bound (above), and AVX-512 doubles the FMA's width. One 512-bit
 * accumulator holds both of tilec's chains of a (weight row, activation row) pair: its low 8 lanes are chain a
 * (columns 16j..16j+7, and a last group of 8, by a masked FMA), its high 8 chain b (16j+8..16j+15), so one
 * FMA does the work of tilec's two passes and the lanes see the same products in the same order: fp32 and bf16
 * weights give the AVX2 path's sums to the bit (a row's result still does not depend on the path, the rows
 * beside it or the CPU). 32 registers hold NR x ZR accumulators, NR weight vectors and one activation vector.
 * dsv3_int_avx512 (int_groups.h) switches AVX-512 off for this path too. */
#define ZR 6
/* bf16 weights take the AVX-512 tiles from this many rows: their conversion to [even | odd] is a shuffle more
 * than AVX2's per 16 weights, on the port the 512-bit FMAs share, and at 2 or 3 rows (a routed expert's share
 * of a 16-row batch) the AVX2 tiles were faster (16 rows over 32 experts, top-4, 2 threads: 1.54 against
 * 1.74 ms a layer); fp32 weights and converted panels from 2 rows (2.27 against 2.54 ms). */
#define ZMM_MIN_ROWS_BF16 4
#define ZMM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* The 16 sums of each of a, b, c, d as one vector of 4 (a 512-bit half added onto the other, then hsum4). */
static inline __attribute__((always_inline)) ZMM_TARGET __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
#define FOLD512(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
    return hsum4(FOLD512(a), FOLD512(b), FOLD512(c), FOLD512(d));
#undef FOLD512
}

/* wload16's 16 columns from k as one vector: [w0 | w1] (bf16: even columns, then odd ones). */
static inline __attribute__((always_inline)) ZMM_TARGET __m512 zload16(int kind, const void *row, int64_t k) {
    if (kind == W_F32) return _mm512_loadu_ps((const float *)row + k);
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
    return _mm512_castsi512_ps(
        _mm512_mask_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32((int)0xFFFF0000u)), 0x00FF, t, 16));
}

/* res[i * NR + r] as tilec computes it, for C (1 to ZR) activation rows; prefetching pfs bytes from pf on per
 * 16 columns (pf NULL: none). kind: W_F32 (weights or a panel) or W_BF16. */
static inline __attribute__((always_inline)) ZMM_TARGET void tilez(int kind, int C, const void *const *rows, int64_t K,
                                                                   const float *x, int64_t ldx, float *res,
                                                                   const char *pf, int pfs) {
    __m512 acc[NR][ZR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t whole = K / 16 * 16;
    int64_t k = 0;
    for (; k < whole; k += 16) {
        if (pf) /* the lines a step reads, from pfs a step on (several passes a tile: some ahead of the slice) */
            prefetch_lines(pf + (k >> 4) * pfs, kind == W_F32 ? 4 : 2);
        __m512 w[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) w[r] = zload16(kind, rows[r], k);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m512 xv = _mm512_loadu_ps(x + c * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(w[r], xv, acc[r][c]);
        }
    }
    if (K % 16 >= 8) { /* a last group of 8 columns: chain a only */
        if (pf) prefetch(pf + (k >> 4) * pfs, pfs);
        __m512 w[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) w[r] = _mm512_castps256_ps512(wload8(kind, rows[r], k));
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m512 xv = _mm512_castps256_ps512(_mm256_loadu_ps(x + c * ldx + k));
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_mask3_fmadd_ps(w[r], xv, acc[r][c], 0x00FF);
        }
        k += 8;
    }
#define ZFOLD(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        _mm_storeu_ps(res + c * NR, hsum4(ZFOLD(acc[0][c]), ZFOLD(acc[1][c]), ZFOLD(acc[2][c]), ZFOLD(acc[3][c])));
        tail(kind, rows, k, K, x + c * ldx, res + c * NR);
    }
#undef ZFOLD
}

/* FP8 weights in the AVX-512 micro-tile, read in place from ZMM_MIN_ROWS_FP8 rows on (no panel below
 * PANEL_MIN_ROWS_FP8 rows): a whole 64-column group's 64 bytes are its two 32-byte halves side by side, so
 * fp8_group_block's operations on the 512-bit register give its blocks [first half's vector q | second half's]
 * directly, 64 weights per 9 operations (AVX2: 32 per 9). ZR_FP8 activation rows at most: NR x 2 converted
 * blocks and NR x ZR_FP8 accumulators fill the 32 registers. On the Intel Xeon host against the AVX2 tiles of
 * 32-column groups (decode_kernels_speed.py --baseline-rev 594cce4 --kinds fp8 --rows 1,2,3 --threads 1, each
 * small matrix called alone): 1.24-1.57x at 3 rows, 0.95-1.09x at 2, 0.93-0.95x at one row. */
#define ZR_FP8 3
#ifndef ZMM_MIN_ROWS_FP8
#define ZMM_MIN_ROWS_FP8 1
#endif
static inline __attribute__((always_inline)) ZMM_TARGET void fp8_group_z(const uint8_t *group, int second, __m512 *w0,
                                                                        __m512 *w1) {
    __m512i v = _mm512_loadu_si512((const void *)group);
    if (second) v = _mm512_slli_epi16(v, 8);
    const __m512i w = _mm512_srai_epi16(v, 4), mask = _mm512_set1_epi32((int)0x87F00000);
    *w0 = _mm512_castsi512_ps(_mm512_and_si512(w, mask));
    *w1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, 16), mask));
}

/* res[i * NR + r] as tilec computes it for FP8 weights (value * 2^-120) and C (1 to ZR_FP8) activation rows in
 * fp8_group_order: whole groups (fp8_group_z), then 16-column blocks (sign extension and a shift by 20, as
 * wload8), a last 8 columns in the low lanes; prefetching pfs bytes from pf on per 16 columns (pf NULL: none). */
static inline __attribute__((always_inline)) ZMM_TARGET void tilez_fp8(int C, const void *const *rows, int64_t K,
                                                                       const float *x, int64_t ldx, float *res,
                                                                       const char *pf, int pfs) {
    __m512 acc[NR][ZR_FP8];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + FP8_GROUP <= K; k += FP8_GROUP) {
        if (pf) prefetch(pf + (k >> 4) * pfs, 4 * pfs);
#pragma GCC unroll 2
        for (int second = 0; second < 2; second++) {
            __m512 w[NR][2];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) fp8_group_z((const uint8_t *)rows[r] + k, second, &w[r][0], &w[r][1]);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) {
                const float *xk = x + c * ldx + k + 32 * second;
                const __m512 x0 = _mm512_loadu_ps(xk), x1 = _mm512_loadu_ps(xk + 16);
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++)
                    acc[r][c] = _mm512_fmadd_ps(w[r][1], x1, _mm512_fmadd_ps(w[r][0], x0, acc[r][c]));
            }
        }
    }
    const __m512i mask = _mm512_set1_epi32((int)0x87F00000);
#define ZFP8_LOAD(row) _mm512_castsi512_ps(_mm512_and_si512(                                              \
    _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)(row) + k))), 20), mask))
    for (; k + 16 <= K; k += 16) {
        if (pf) prefetch(pf + (k >> 4) * pfs, pfs);
        __m512 w[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) w[r] = ZFP8_LOAD(rows[r]);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m512 xv = _mm512_loadu_ps(x + c * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(w[r], xv, acc[r][c]);
        }
    }
#undef ZFP8_LOAD
    if (K % 16 >= 8) { /* a last group of 8 columns: chain a only */
        if (pf) prefetch(pf + (k >> 4) * pfs, pfs);
        __m512 w[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) w[r] = _mm512_castps256_ps512(wload8(W_FP8, rows[r], k));
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m512 xv = _mm512_castps256_ps512(_mm256_loadu_ps(x + c * ldx + k));
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_mask3_fmadd_ps(w[r], xv, acc[r][c], 0x00FF);
        }
        k += 8;
    }
#define ZFOLD(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        _mm_storeu_ps(res + c * NR, hsum4(ZFOLD(acc[0][c]), ZFOLD(acc[1][c]), ZFOLD(acc[2][c]), ZFOLD(acc[3][c])));
        tail(W_FP8, rows, k, K, x + c * ldx, res + c * NR);
    }
#undef ZFOLD
}

/* tilez with the weight kind (W_F32, W_BF16 or W_FP8) and the activation rows (1 to ZR; FP8: ZR_FP8) as constants. */
static ZMM_TARGET void run_tilez(int kind, int mb, const void *const *rows, int64_t K, const float *x, int64_t ldx,
                                 float *res, const char *pf, int pfs) {
#define ZTILE_CASES(KIND)                                                                                  \
    switch (mb) {                                                                                         \
        case 1: tilez(KIND, 1, rows, K, x, ldx, res, pf, pfs); break;                                      \
        case 2: tilez(KIND, 2, rows, K, x, ldx, res, pf, pfs); break;                                      \
        case 3: tilez(KIND, 3, rows, K, x, ldx, res, pf, pfs); break;                                      \
        case 4: tilez(KIND, 4, rows, K, x, ldx, res, pf, pfs); break;                                      \
        case 5: tilez(KIND, 5, rows, K, x, ldx, res, pf, pfs); break;                                      \
        default: tilez(KIND, 6, rows, K, x, ldx, res, pf, pfs); break;                                     \
    }
    if (kind == W_F32) { ZTILE_CASES(W_F32) }
    else if (kind == W_BF16) { ZTILE_CASES(W_BF16) }
    else if (mb == 1) tilez_fp8(1, rows, K, x, ldx, res, pf, pfs);
    else if (mb == 2) tilez_fp8(2, rows, K, x, ldx, res, pf, pfs);
    else tilez_fp8(3, rows, K, x, ldx, res, pf, pfs);
#undef ZTILE_CASES
}

/* The NR rows of a tile as fp32 in panel [NR, K] (FP8: value * 2^-120), for many activation rows to share;
 * prefetching pf on as the rows are read (the tile's bytes, PF_BYTES or a tile further on). */
static void to_panel(int kind, const void *const *rows, int64_t K, float *panel, const char *pf) {
    const int64_t es = (int64_t)elem_size(kind);
    for (int r = 0; r < NR; r++) {
        int64_t k = 0;
        if (kind == W_BF16) {
            for (; k + 16 <= K; k += 16) {
                if (pf) prefetch(pf + (r * K + k) * es, 16 * 2);
                __m256 w0, w1;
                wload16(W_BF16, rows[r], k, &w0, &w1);
                _mm256_storeu_ps(panel + r * K + k, w0);
                _mm256_storeu_ps(panel + r * K + k + 8, w1);
            }
            for (; k + 8 <= K; k += 8) _mm256_storeu_ps(panel + r * K + k, wload8(W_BF16, rows[r], k));
        } else {
            for (; k + FP8_GROUP <= K; k += FP8_GROUP) {
                if (pf) prefetch(pf + (r * K + k) * es, FP8_GROUP);
                for (int q = 0; q < 4; q++) { /* block q: [first half's vector q | second half's] */
                    _mm256_storeu_ps(panel + r * K + k + 16 * q, fp8_group_vector((const uint8_t *)rows[r] + k, q));
                    _mm256_storeu_ps(panel + r * K + k + 16 * q + 8, fp8_group_vector((const uint8_t *)rows[r] + k + 32, q));
                }
            }
            for (; k + 8 <= K; k += 8) {
                if (pf) prefetch(pf + (r * K + k) * es, 8);
                _mm256_storeu_ps(panel + r * K + k, wload8(W_FP8, rows[r], k));
            }
        }
        for (; k < K; k++) panel[r * K + k] = wload1(kind, rows[r], k);
    }
}

/* xo = x [M, K] with each whole 64-column group in the order its FP8 weights convert in (fp8_group_column);
 * the columns past the last whole group as they are. Once per call: the row blocks' scales then multiply
 * contiguous runs (prescale). */
static void fp8_group_order(const float *x, int64_t M, int64_t K, float *xo) {
    const int64_t groups = K / FP8_GROUP * FP8_GROUP;
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * K;
        float *dst = xo + m * K;
        int64_t k = 0;
        for (; k < groups; k += FP8_GROUP)
            for (int i = 0; i < FP8_GROUP; i++) dst[k + i] = src[k + fp8_group_column(i)];
        for (; k < K; k++) dst[k] = src[k];
    }
}

/* xs[m, k] = x[m, k] * scale_row[k / 128] * FP8_X_SHIFT: a 128-row block's FP8 scales (times 256) on the
 * activations (in fp8_group_order: a group lies in one 128-column block). */
static void prescale(const float *x, const float *scale_row, int64_t M, int64_t K, float *xs) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k0 = 0; k0 < K; k0 += FP8_BLOCK) {
            const float s = scale_row[k0 / FP8_BLOCK] * FP8_X_SHIFT;
            const int64_t k1 = k0 + FP8_BLOCK < K ? k0 + FP8_BLOCK : K;
            for (int64_t k = k0; k < k1; k++) xs[m * K + k] = x[m * K + k] * s;
        }
}

/* Floats of per-thread scratch gemv_tiles needs: the interleaved (bf16) or group-ordered and prescaled (FP8)
 * activations and a tile's panel. */
static size_t scratch_floats(int kind, int64_t M, int64_t K) {
    if (is_int(kind)) return 1; /* int_rows reads x as it is */
    return (size_t)((kind != W_F32 ? M * K : 0) + (kind == W_FP8 ? M * K : 0) + (converts_to_panel(kind, M) ? NR * K : 0) + 1);
}

/* How many of the rem activation rows left the next micro-tile takes: 3, or the 1 or 2 left at the end (tile1,
 * the 1-row kernel, keeps 8 chains in flight and reads the tile once: as fast as a 2 + 2 split). */
static int group_rows(int64_t rem) { return rem < 3 ? (int)rem : 3; }

/* y[m, n] = sum_k W[n, k] x[m, k] for all m < M and the rows n of tiles [t0, t1) (tile t: rows t * NR to
 * t * NR + NR - 1, cut at N); x [M, K] contiguous, y row stride ldy. Reads each weight from memory once.
 * Integer weights (W_INT8, W_INT4; ``scales`` their fp16 group scales) go to int_rows, the same rows.
 * A partial last tile repeats its last row (computed, not stored), so every tile runs the same code.
 * Activation rows go through the tile in micro-tiles of 2 or 3 (tilec; one row: tile1). From PANEL_MIN_ROWS_* rows
 * on, bf16/FP8 weights are converted once per tile into an fp32 panel (exact); below that, converting in
 * registers once per micro-tile measured as fast as storing and reloading a panel. With many
 * rows a tile is compute work long after its bytes arrived, so the prefetch of the next tile is spread over
 * all its passes (not issued in one burst, which leaves memory idle for the rest of the tile).
 * A run of small matrices (the experts of a step, in turn) reads each one's start cold unless the run is one
 * stream: the call fetches its own first bytes on entry, and prefetches that would pass the end of its rows go
 * on at ``next`` (where this thread reads after the call), or nowhere useful past the end when it is NULL. */
static void gemv_tiles(int kind, const void *w, const void *scales, int64_t N, int64_t K, const float *x, int64_t M,
                       float *y, int64_t ldy, int64_t t0, int64_t t1, float *scratch, const char *next) {
    if (M <= 0 || t1 <= t0) return;
    if (is_int(kind)) { /* scales: fp16 [N, K / 32] */
        int_rows(kind == W_INT8 ? 8 : 4, (const uint8_t *)w, (const uint16_t *)scales, K, x, M, y, ldy, t0 * NR,
                 t1 * NR < N ? t1 * NR : N, next);
        return;
    }
    const float *scale = (const float *)scales; /* FP8: [ceil(N/128), ceil(K/128)] x 256 */
    const size_t row_bytes = (size_t)K * elem_size(kind);
    const int64_t kblocks = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const int panel = converts_to_panel(kind, M);
    const size_t tile_bytes = NR * row_bytes, ahead = tile_bytes > PF_BYTES ? tile_bytes : PF_BYTES;
    /* several rows of fp32 weights or a panel, or enough rows of bf16 ones: the AVX-512 micro-tile, where it runs */
    const int tiled = panel ? W_F32 : kind;
    const int wide = dsv3_int_avx512(-1) && (tiled == W_F32    ? M >= 2
                                             : tiled == W_BF16 ? M >= ZMM_MIN_ROWS_BF16
                                                               : M >= ZMM_MIN_ROWS_FP8);
    const int zr = tiled == W_FP8 ? ZR_FP8 : ZR; /* activation rows per AVX-512 micro-tile */
    /* passes over a tile: tilec's two per micro-tile, tilez's one; each prefetches a slice of the next tile */
    int64_t passes = 0;
    for (int64_t m0 = 0; m0 < M; m0 += wide ? zr : group_rows(M - m0)) passes += wide ? 1 : 2;
    const int64_t slice = (int64_t)(tile_bytes + passes - 1) / passes, steps = K / 16 > 0 ? K / 16 : 1;
    const int pfs = (int)((slice + steps - 1) / steps);
    const float y_shift = kind == W_FP8 ? FP8_Y_SHIFT : 1.0f;
    const unsigned int csr = _mm_getcsr();
    if (kind == W_FP8) _mm_setcsr(csr & ~0x0040u); /* DAZ off: subnormal e4m3 weights are fp32 subnormals */
    const char *end = (const char *)w + (size_t)(t1 * NR < N ? t1 * NR : N) * row_bytes; /* of this call's rows */
    prefetch_entry((const char *)w + (size_t)(t0 * NR) * row_bytes, end, ahead);
    float *xs = scratch, *pan = scratch + (kind != W_F32 ? M * K : 0) + (kind == W_FP8 ? M * K : 0);
    int64_t scaled_block = -1;
    if (kind == W_BF16) interleave(x, M, K, xs), x = xs;
    if (kind == W_FP8) fp8_group_order(x, M, K, xs + M * K), x = xs + M * K;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = t * NR;
        const int nr = N - n < NR ? (int)(N - n) : NR;
        const char *pf = prefetch_past((const char *)w + n * row_bytes + ahead, end, next);
        const void *rows[NR];
        for (int r = 0; r < NR; r++) rows[r] = (const char *)w + (size_t)(n + (r < nr ? r : nr - 1)) * row_bytes;
        const float *xa = x;
        if (kind == W_FP8) { /* NR divides 128: a tile lies in one row block */
            if (n / FP8_BLOCK != scaled_block) {
                scaled_block = n / FP8_BLOCK;
                prescale(x, scale + scaled_block * kblocks, M, K, xs);
            }
            xa = xs;
        }
        if (panel) {
            to_panel(kind, rows, K, pan, NULL);
            for (int r = 0; r < NR; r++) rows[r] = pan + r * K;
        }
        for (int64_t m0 = 0, g = 0; m0 < M; g++) {
            const int mb = wide ? (M - m0 < zr ? (int)(M - m0) : zr) : group_rows(M - m0);
            float res[ZR * NR];
            if (wide)
                run_tilez(tiled, mb, rows, K, xa + m0 * K, K, res, pf + g * slice, pfs);
            else
                run_tile(panel ? W_F32 : kind, mb, rows, K, xa + m0 * K, K, res, pf + 2 * g * slice, slice, pfs);
            for (int i = 0; i < mb; i++)
                for (int r = 0; r < nr; r++) y[(m0 + i) * ldy + n + r] = res[i * NR + r] * y_shift;
            m0 += mb;
        }
    }
    _mm_setcsr(csr);
}

/* This thread's share [*t0, *t1) of ntiles tiles, inside a parallel region. */
/* The first of thread t's tiles when T threads split ntiles. */
static int64_t first_tile(int64_t ntiles, int64_t t, int64_t T) { return ntiles * t / T; }

static void my_tiles(int64_t ntiles, int64_t *t0, int64_t *t1) {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    *t0 = first_tile(ntiles, t, T);
    *t1 = first_tile(ntiles, t + 1, T);
}

static int64_t tiles_of(int64_t n) { return (n + NR - 1) / NR; }

/* ---- bf16 times bf16 in AVX512-BF16 dot products, chosen at run time ---------------------------------
 * VDPBF16PS (AMD Zen 4 on, Intel Cooper Lake and Sapphire Rapids on) adds 32 bf16 products into 16 fp32 sums
 * in one instruction, four times the products of an AVX2 FMA, with no conversion of the operands. Where
 * both operands are bf16 values (a bf16 model's projections of its bf16 activations; its attention over a
 * bf16 cache, below) every product is exact and every sum fp32, as in the FMA path, in another order.
 * dsv3_bf16_dots turns them off (the AVX2 FMAs then run) and says whether they are on. */

#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define DP_COMPILER 1 /* a compiler that knows the avx512bf16 target */
#else
#define DP_COMPILER 0
#endif
#if DP_COMPILER
#define DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define DP_INLINE static inline __attribute__((always_inline)) DP_TARGET
#define DP_WIDTH 32 /* bf16 values per 512-bit vector */
#define DP_ROWS 6   /* activation rows per micro-tile: NR x 6 accumulators, NR weight vectors and one of x */

static int bf16_dots = -1; /* -1: not decided yet */

/* Whether bf16 x bf16 products run in VDPBF16PS: want 0 turns them off, 1 on where the CPU has AVX512-BF16,
 * -1 asks. Returns the state. */
int dsv3_bf16_dots(int want) {
    if (want >= 0 || bf16_dots < 0) {
        __builtin_cpu_init();
        bf16_dots = want != 0 && __builtin_cpu_supports("avx512bf16");
    }
    return bf16_dots;
}

static int64_t dp_padded(int64_t n) { return (n + DP_WIDTH - 1) / DP_WIDTH * DP_WIDTH; }

/* The first n (of 32) lanes. */
DP_INLINE __mmask32 dp_mask(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1u); }

/* res[c * NR + r] = sum_k rows[r][k] x[c * ldx + k] for C (1 to DP_ROWS) activation rows: 16 columns per step
 * in 256-bit VDPBF16PS (one 8-lane chain per (weight row, activation row), then hsum4); each weight vector
 * serves the C rows, each x vector the NR rows. A pair's arithmetic is the same for every C, so a row's
 * result does not depend on how many rows share the call. 512-bit steps measured slower than the AVX2 FMAs
 * at one row, where the GEMV waits on memory; 256-bit ones faster. Step j prefetches the two lines from
 * pf + j * pfs on (pfs <= 128, the bytes a step reads; less when several passes share the prefetch, some lines
 * then asked for twice): see dp_gemv_tiles. */
DP_INLINE void dp_tile(int C, const uint16_t *const *rows, int64_t K, const uint16_t *x, int64_t ldx, float *res,
                       const char *pf, int64_t pfs, int l2) {
    __m256 acc[NR][DP_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = (__mmask16)dp_mask(K - k > 16 ? 16 : K - k);
        const char *q = pf + (k >> 4) * pfs;
        if (l2) /* the tile, the next one and 5 rows of x or more outgrow L1: the next one into L2 only */
            prefetch_lines(q, 2);
        else /* into L1: at 1-4 rows 0.81-0.93x the GB/s into L2 only */
            prefetch_lines_l1(q, 2);
        __m256i w[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) w[r] = _mm256_maskz_loadu_epi16(m, rows[r] + k);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m256i xv = _mm256_maskz_loadu_epi16(m, x + c * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) acc[r][c] = _mm256_dpbf16_ps(acc[r][c], (__m256bh)w[r], (__m256bh)xv);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) _mm_storeu_ps(res + c * NR, hsum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
}

/* dp_tile with the activation rows (1 to DP_ROWS) as constants, prefetching PFS bytes a step (into L2: L2). */
#define DP_TILE_CASES(PFS, L2)                                                                                  \
    switch (mb) {                                                                                               \
        case 1: dp_tile(1, rows, K, xa, K, res, p, PFS, L2); break;                                            \
        case 2: dp_tile(2, rows, K, xa, K, res, p, PFS, L2); break;                                            \
        case 3: dp_tile(3, rows, K, xa, K, res, p, PFS, L2); break;                                            \
        case 4: dp_tile(4, rows, K, xa, K, res, p, PFS, L2); break;                                            \
        case 5: dp_tile(5, rows, K, xa, K, res, p, PFS, L2); break;                                            \
        default: dp_tile(6, rows, K, xa, K, res, p, PFS, L2); break;                                           \
    }

/* gemv_tiles for bf16 weights w [N, K] and bf16 activations x [M, K]: y[m, n] for the rows n of tiles
 * [t0, t1) (a partial last tile repeats its last row, computed, not stored), DP_ROWS activation rows at a
 * time: a pass over the tile each. The weights PF_BYTES (or a tile) ahead are prefetched in slices, one per
 * pass, spread over its steps: when only the first pass prefetched, memory stood idle while the others
 * computed, and a seventh row (a second pass) halved the GB/s of six (decode_kernels_speed.py --rows 6,7). */
static DP_TARGET void dp_gemv_tiles(const uint16_t *w, int64_t N, int64_t K, const uint16_t *x, int64_t M, float *y,
                                    int64_t ldy, int64_t t0, int64_t t1) {
    const size_t row_bytes = (size_t)K * 2, tile_bytes = NR * row_bytes;
    const size_t ahead = tile_bytes > PF_BYTES ? tile_bytes : PF_BYTES;
    /* pass g of a tile prefetches slice g of the next, spread over its steps (one pass: a step's own bytes) */
    const int64_t passes = (M + DP_ROWS - 1) / DP_ROWS, steps = (K + 15) / 16;
    const int64_t slice = ((int64_t)tile_bytes + passes - 1) / passes, pfs = (slice + steps - 1) / steps;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = t * NR;
        const int nr = N - n < NR ? (int)(N - n) : NR;
        const uint16_t *rows[NR];
        for (int r = 0; r < NR; r++) rows[r] = w + (size_t)(n + (r < nr ? r : nr - 1)) * K;
        const char *pf = (const char *)w + n * row_bytes + ahead;
        for (int64_t m0 = 0, g = 0; m0 < M; g++) {
            const int mb = M - m0 < DP_ROWS ? (int)(M - m0) : DP_ROWS;
            float res[DP_ROWS * NR];
            const uint16_t *xa = x + m0 * K;
            const char *p = pf + g * slice;
            if (M < 5) /* one pass, a step's own bytes: the constant lets the compiler shift, not multiply */
                DP_TILE_CASES(NR * 32, 0)
            else if (passes == 1)
                DP_TILE_CASES(NR * 32, 1)
            else
                DP_TILE_CASES(pfs, 1)
            for (int i = 0; i < mb; i++)
                for (int r = 0; r < nr; r++) y[(m0 + i) * ldy + n + r] = res[i * NR + r];
            m0 += mb;
        }
    }
}
/* Whether bf16 x bf16 GEMVs take the dot products (the attention decides for itself, USE_BF16_DOTS): where they
 * are on, unless the AVX-512 micro-tiles run on an Intel CPU. There VDPBF16PS issues at a quarter of the
 * AVX-512 FMA's multiply-add rate (the Intel Xeon measured, with AMX, one core: 30.6 GMAC/s in 256-bit dot
 * products, 57 in 512-bit ones, 116 in 512-bit FMAs), so from a few rows on the FMAs on fp32 activations are
 * 1.3-2x faster (16 rows, 2 threads: head 1.96x, MLP 1.55x, an expert 1.27x), and at one row, where memory
 * sets the pace, within 3% of the dots. Either way one path serves every row count, so a row's result does not
 * depend on the rows beside it. Other CPUs keep the dot products: the AMD EPYC these kernels were written on
 * has not been measured this way. Where the Intel CPU has AMX-BF16, AMX tiles take such GEMVs whatever the
 * row count (use_amx_gemv). */
static int gemv_dots(void) {
    static int intel = -1;
    if (intel < 0) {
        __builtin_cpu_init();
        intel = __builtin_cpu_is("intel");
    }
    return dsv3_bf16_dots(-1) && !(intel && dsv3_int_avx512(-1));
}
#define USE_DOT_GEMV(kind, xkind) ((kind) == W_BF16 && (xkind) == A_BF16 && gemv_dots())

/* ---- FP8 weights in the same dot products ---------------------------------------------------------------
 * Every e4m3 value is a bf16 value (its 3 mantissa bits fit in bf16's 7, its exponents, subnormals included, in
 * bf16's range), so FP8 weights times bf16 activations take VDPBF16PS as bf16 weights do: every product exact,
 * every sum fp32. A 64-byte load of weights becomes two vectors of 32 bf16 values by two byte lookups
 * (VPERMI2B, AVX512-VBMI: the bf16 value's low and high byte over the byte's low 7 bits; the sign OR-ed back
 * into the high byte) and two byte unpacks: 6 operations per 64 weights, which then take 2 dot products per
 * activation row, where the fp32 path (tilez_fp8) spends about 10 to convert them and 4 FMAs per row. On the
 * AMD EPYC (Zen 4) these were written on the fp32 path read FP8 experts at two thirds of the bf16 GEMV's
 * bytes per second (benchmarks/decode_kernels_speed.py): the conversion, not memory, set its pace.
 * The unpacks interleave within 128-bit lanes, so vector 0 of a 64-column group holds columns 16L..16L+7 of
 * each lane L and vector 1 columns 16L+8..16L+15; the activations come in that order (fp8_dot_order), each
 * row zero-padded to whole groups. A 128-column block's products are summed apart, then times its scale (fp32):
 * the block scales, unlike bf16 weights, vary along a row. */
#define DP8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")))
#define DP8_INLINE static inline __attribute__((always_inline)) DP8_TARGET
#define DP8_ROWS 2 /* activation rows per micro-tile: NR x 2 block sums and NR x 2 totals, with the lookup tables */

static int64_t fp8_dot_padded(int64_t K) { return (K + FP8_GROUP - 1) / FP8_GROUP * FP8_GROUP; }

/* Where column k of a row goes in fp8_dot_order. */
static int64_t fp8_dot_column(int64_t k) {
    const int64_t g = k / FP8_GROUP * FP8_GROUP, i = k % FP8_GROUP, lane = i / 16, j = i % 16;
    return g + (j < 8 ? 0 : 32) + 8 * lane + j % 8;
}

/* xo [M, fp8_dot_padded(K)] = x [M, K] (bf16) in the order the converted weights take (zeros past K). */
static void fp8_dot_order(const uint16_t *x, int64_t M, int64_t K, uint16_t *xo) {
    const int64_t K64 = fp8_dot_padded(K);
    for (int64_t m = 0; m < M; m++) {
        memset(xo + m * K64, 0, (size_t)K64 * sizeof(uint16_t));
        for (int64_t k = 0; k < K; k++) xo[m * K64 + fp8_dot_column(k)] = x[m * K + k];
    }
}

/* The bf16 value of each e4m3 code 0..127 (sign bit clear), as its low bytes (lo) and high bytes (hi). */
static uint8_t fp8_bf16_lo[128], fp8_bf16_hi[128];
static void fp8_bf16_tables(void) {
    for (int v = 0; v < 128; v++) {
        const int e = v >> 3, m = v & 7;
        const float f = v == 0x7F ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        const uint16_t b = f32_to_bf16(f);
        fp8_bf16_lo[v] = (uint8_t)(b & 0xFF), fp8_bf16_hi[v] = (uint8_t)(b >> 8);
    }
}

/* Whether FP8 x bf16 GEMVs take the dot products: where the bf16 ones do and the CPU has AVX512-VBMI. */
static int fp8_dots(void) {
    static int vbmi = -1;
    if (vbmi < 0) {
        __builtin_cpu_init();
        const int has = __builtin_cpu_supports("avx512vbmi") != 0;
        if (has) fp8_bf16_tables(); /* before vbmi says yes: the tables are read from then on */
        vbmi = has;
    }
    return vbmi && gemv_dots();
}
#define USE_DOT_FP8(kind, xkind) ((kind) == W_FP8 && (xkind) == A_BF16 && fp8_dots())

/* res[c * NR + r] = sum_k rows[r][k] x[c * ldx + k] for C (1 or 2) activation rows of FP8 weights (K columns)
 * and bf16 activations in fp8_dot_order; scale[b]: the tile's scale of 128-column block b. Group j (64 columns)
 * prefetches the four lines from pf + j * pfs on (pfs: the bytes a group reads, less when several passes share
 * the prefetch of the next tile, some lines then ahead of the pass's slice; see dp8_gemv_tiles). */
DP8_INLINE void dp8_tile(int C, const uint8_t *const *rows, int64_t K, const float *scale, const uint16_t *x,
                         int64_t ldx, float *res, const char *pf, int64_t pfs) {
    const __m512i lo_a = _mm512_loadu_si512((const void *)fp8_bf16_lo), lo_b = _mm512_loadu_si512((const void *)(fp8_bf16_lo + 64));
    const __m512i hi_a = _mm512_loadu_si512((const void *)fp8_bf16_hi), hi_b = _mm512_loadu_si512((const void *)(fp8_bf16_hi + 64));
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    __m512 acc[NR][DP8_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += FP8_BLOCK) {
        const int64_t k1 = k0 + FP8_BLOCK < K ? k0 + FP8_BLOCK : K;
        __m512 blk[NR][DP8_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) blk[r][c] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += FP8_GROUP) {
            const __mmask64 m = k1 - k >= FP8_GROUP ? ~(__mmask64)0 : (((__mmask64)1 << (k1 - k)) - 1);
            prefetch_lines_l1(pf + (k >> 6) * pfs, 4); /* a group's four lines, from pfs a group on */
            __m512i xv[DP8_ROWS][2];
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
                xv[c][0] = _mm512_loadu_si512((const void *)(x + c * ldx + k)),
                xv[c][1] = _mm512_loadu_si512((const void *)(x + c * ldx + k + 32));
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) {
                const __m512i v = _mm512_maskz_loadu_epi8(m, rows[r] + k);
                const __m512i lo = _mm512_permutex2var_epi8(lo_a, v, lo_b);
                const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi_a, v, hi_b), v, sign, 0xF8);
                const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 8
                for (int c = 0; c < C; c++)
                    blk[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(blk[r][c], (__m512bh)w0, (__m512bh)xv[c][0]),
                                                 (__m512bh)w1, (__m512bh)xv[c][1]);
            }
        }
        const __m512 s = _mm512_set1_ps(scale[k0 / FP8_BLOCK]);
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(blk[r][c], s, acc[r][c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) _mm_storeu_ps(res + c * NR, hsum4_512(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
}

/* gemv_tiles for FP8 weights w [N, K] (scales: their block scales x 256) and bf16 activations x [M, K] in
 * fp8_dot_order (row stride fp8_dot_padded(K)): y[m, n] for the rows n of tiles [t0, t1), DP8_ROWS activation
 * rows at a time, each row's arithmetic the same however many share the call. Prefetching as gemv_tiles does:
 * the call's first bytes on entry, and on at ``next`` past the end of its rows (NULL: nowhere). */
static DP8_TARGET void dp8_gemv_tiles(const uint8_t *w, const float *scales, int64_t N, int64_t K, const uint16_t *x,
                                      int64_t M, float *y, int64_t ldy, int64_t t0, int64_t t1, const char *next) {
    if (M <= 0 || t1 <= t0) return;
    const int64_t kblocks = (K + FP8_BLOCK - 1) / FP8_BLOCK, K64 = fp8_dot_padded(K);
    const size_t tile_bytes = NR * (size_t)K, ahead = tile_bytes > PF_BYTES ? tile_bytes : PF_BYTES;
    const char *end = (const char *)w + (t1 * NR < N ? t1 * NR : N) * K;
    prefetch_entry((const char *)w + t0 * tile_bytes, end, ahead);
    /* pass g of a tile (DP8_ROWS activation rows) prefetches slice g of the next one, spread over its groups:
     * when only the first pass prefetched, memory stood idle while the others computed (as in dp_gemv_tiles) */
    const int64_t passes = (M + DP8_ROWS - 1) / DP8_ROWS, groups = (K + FP8_GROUP - 1) / FP8_GROUP;
    const int64_t slice = ((int64_t)tile_bytes + passes - 1) / passes, pfs = (slice + groups - 1) / groups;
    float scale[kblocks]; /* the tile's row block's scales, over 256 */
    int64_t scaled_block = -1;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = t * NR;
        const int nr = N - n < NR ? (int)(N - n) : NR;
        if (n / FP8_BLOCK != scaled_block) { /* NR divides 128: a tile lies in one row block */
            scaled_block = n / FP8_BLOCK;
            for (int64_t b = 0; b < kblocks; b++) scale[b] = scales[scaled_block * kblocks + b] * 0x1p-8f;
        }
        const uint8_t *rows[NR];
        for (int r = 0; r < NR; r++) rows[r] = w + (size_t)(n + (r < nr ? r : nr - 1)) * K;
        const char *pf = prefetch_past((const char *)w + n * K + ahead, end, next);
        for (int64_t m0 = 0, g = 0; m0 < M; g++) {
            const int mb = M - m0 < DP8_ROWS ? (int)(M - m0) : DP8_ROWS;
            float res[DP8_ROWS * NR];
            const char *p = pf + g * slice;
            if (mb == 1)
                dp8_tile(1, rows, K, scale, x + m0 * K64, K64, res, p, pfs);
            else
                dp8_tile(2, rows, K, scale, x + m0 * K64, K64, res, p, pfs);
            for (int i = 0; i < mb; i++)
                for (int r = 0; r < nr; r++) y[(m0 + i) * ldy + n + r] = res[i * NR + r];
            m0 += mb;
        }
    }
}
#else
int dsv3_bf16_dots(int want) { (void)want; return 0; }
#define USE_DOT_GEMV(kind, xkind) 0
#define USE_DOT_FP8(kind, xkind) 0
#define dp_gemv_tiles(w, N, K, x, M, y, ldy, t0, t1) ((void)0)
#define dp8_gemv_tiles(w, s, N, K, x, M, y, ldy, t0, t1, next) ((void)0)
#define fp8_dot_padded(K) (K)
#define fp8_dot_order(x, M, K, xo) ((void)0)
#define fp8_dot_column(k) (k)
#endif

typedef struct { /* a bias-free linear layer, [n, k] */
    const void *w;
    const void *scale; /* FP8 block scales x 256, integer groups' fp16 scales, or NULL */
    int64_t kind, n, k;
} BlkLinear;

/* bf16 weights times bf16 activations in AMX tiles (defined with the attention's tiles, below): whether a
 * [N, K] matrix takes them, x's rows laid out for them, and the tiles' GEMV. */
static int use_amx_gemv(int kind, int xkind, int64_t N, int64_t K);
/* Where value k of activation row m sits among the B tiles of rows [M, K] (uint16 units): tiles
 * [ceil(M/16)][K/32] of [16 channel pairs][16 rows] pairs, the pair's even channel first. */
static inline int64_t amx_rows_at(int64_t m, int64_t k, int64_t K) {
    return (((m / 16) * (K / 32) + k / 32) * 256 + (k % 32) / 2 * 16 + m % 16) * 2 + k % 2;
}
static uint32_t *amx_rows_vnni(const uint16_t *x, int64_t M, int64_t K);
static void amx_gemv_rows(const uint16_t *w, int64_t N, int64_t K, const uint32_t *xt, int64_t M, float *y,
                          int64_t ldy, int64_t n0, int64_t n1, const char *next);

/* Whether a linear of N x K runs in parallel: below this the threads' start-up costs more than they save. */
static int linear_threads(int64_t N, int64_t K, int nthreads) { return N * K > 32768 ? nthreads : 1; }

/* Where thread t's rows of l start when l runs next (NULL: l is NULL, or t has no rows there). */
static const char *share_of(const BlkLinear *l, int t, int nthreads) {
    const int T = l ? linear_threads(l->n, l->k, nthreads) : 0;
    if (t >= T) return NULL;
    return (const char *)l->w + weight_bytes((int)l->kind, first_tile(tiles_of(l->n), t, T) * NR * l->k);
}

/* out [M, N] = x [M, K] @ W^T, prefetching on into ``then`` (the linear read next) as the rows run out. */
static void linear(const void *w, const void *scale, int kind, int64_t N, int64_t K, const void *x, int xkind,
                   int64_t M, void *out, int okind, int nthreads, const BlkLinear *then) {
    const int tiles = use_amx_gemv(kind, xkind, N, K);
    const int dots = !tiles && USE_DOT_GEMV(kind, xkind), dots8 = USE_DOT_FP8(kind, xkind);
    float *xf = xkind == A_F32 || tiles || dots || dots8 ? (float *)x : to_f32(x, xkind, M * K);
    uint32_t *xt = tiles ? amx_rows_vnni((const uint16_t *)x, M, K) : NULL;
    float *y = okind == A_F32 ? (float *)out : (float *)malloc((size_t)(M * N > 0 ? M * N : 1) * sizeof(float));
    uint16_t *x8 = dots8 ? (uint16_t *)malloc((size_t)(M * fp8_dot_padded(K) + 1) * sizeof(uint16_t)) : NULL;
    if (dots8) fp8_dot_order((const uint16_t *)x, M, K, x8);
#pragma omp parallel num_threads(linear_threads(N, K, nthreads))
    {
        int64_t t0, t1;
        my_tiles(tiles_of(N), &t0, &t1);
        if (tiles) {
            amx_gemv_rows((const uint16_t *)w, N, K, xt, M, y, N, t0 * NR, t1 * NR < N ? t1 * NR : N,
                          share_of(then, omp_get_thread_num(), nthreads));
        } else if (dots) {
            dp_gemv_tiles((const uint16_t *)w, N, K, (const uint16_t *)x, M, y, N, t0, t1);
        } else if (dots8) {
            dp8_gemv_tiles((const uint8_t *)w, (const float *)scale, N, K, x8, M, y, N, t0, t1,
                           share_of(then, omp_get_thread_num(), nthreads));
        } else {
            float *scratch = (float *)malloc(scratch_floats(kind, M, K) * sizeof(float));
            gemv_tiles(kind, w, scale, N, K, xf, M, y, N, t0, t1, scratch, share_of(then, omp_get_thread_num(), nthreads));
            free(scratch);
        }
    }
    if (y != out) store(out, okind, y, M * N, 0), free(y);
    if (xf != x) free(xf);
    free(x8), free(xt);
}

/* out [M, N] = x [M, K] @ W^T. Returns 0. */
int dsv3_linear(const void *w, const void *scale, int kind, int64_t N, int64_t K, const void *x, int xkind,
                int64_t M, void *out, int okind, int nthreads) {
    linear(w, scale, kind, N, K, x, xkind, M, out, okind, nthreads, NULL);
    return 0;
}

static float silu(float v) { return v / (1.0f + expf(-v)); }

/* The (row, slot) pairs of idx [P] grouped by expert, in expert then pair order: pairs of expert e at
 * pair[start[e] .. start[e + 1]); an index outside [0, E) selects no expert. */
static void group_by_expert(const int64_t *idx, int64_t P, int64_t E, int64_t *start, int64_t *pair) {
    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (idx[p] >= 0 && idx[p] < E) start[idx[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t *fill = (int64_t *)malloc((size_t)(E + 1) * sizeof(int64_t));
    memcpy(fill, start, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (idx[p] >= 0 && idx[p] < E) pair[fill[idx[p]]++] = p;
    free(fill);
}

/* Expert e's scales in a stack of E [N, K] matrices' scales s (NULL: none): FP8 blocks [ceil(N/128),
 * ceil(K/128)] fp32, or integer groups' [N, K/32] fp16. */
static const void *expert_scales(int kind, const void *s, int64_t e, int64_t N, int64_t K) {
    if (!s) return NULL;
    if (is_int(kind)) return (const uint16_t *)s + e * N * (K / INT_GROUP);
    return (const float *)s + e * ((N + FP8_BLOCK - 1) / FP8_BLOCK) * ((K + FP8_BLOCK - 1) / FP8_BLOCK);
}

/* Routed SwiGLU experts of one decode step: out[m] (+)= sum_j gates[m, j] * SwiGLU_e(x[m]) with
 * e = idx[m, j]. Each routed-to expert's three matrices are read once for all the rows routed to it, in
 * one parallel region: every thread computes its share of every expert's gate and up rows, then (after
 * one barrier) its share of every expert's down rows, summed per output row in expert order.
 * wg, wu [E, I, D]; wd [E, D, I]; sg, su [E, ceil(I/128), ceil(D/128)], sd [E, ceil(D/128), ceil(I/128)]
 * (FP8), or the fp16 group scales sg, su [E, I, D/32], sd [E, D, I/32] (integer groups). Returns 0. */
int dsv3_swiglu_experts(const void *wg, const void *wu, const void *wd, const void *sg, const void *su,
                        const void *sd, int kind, int64_t E, int64_t I, int64_t D, const void *x, int xkind,
                        int64_t M, const int64_t *idx, const float *gates, int64_t topk, void *out, int okind,
                        int accumulate, int nthreads) {
    const int64_t P = M * topk;
    /* with the dot products, gate and up take x in bf16, and down the SwiGLU output rounded to bf16 (where the
     * module path rounds it too: a bf16 model's activations are bf16 tensors); else all in fp32 FMAs */
    /* AMX tiles for one expert (a dense MLP, the shared experts) where both the gate/up and the down matrices
     * take them: x and the SwiGLU output in bf16 as for the dot products, the rows laid out as B tiles (xt, and
     * gt filled by the gate/up pass). A stack of routed experts keeps its path: a decode step gives each of
     * them a row or two (batch 16, top-4 of 64), which the FMAs read at the memory's pace, and in a trial build
     * the tiles took that phase 1.03-1.2x the time (decode_step_ab.py --phases, large, bf16). The
     * choice depends on the experts, never on the rows, so a row's bits do not depend on the rows beside it. */
    const int tiles = E == 1 && use_amx_gemv(kind, xkind, I, D) && use_amx_gemv(kind, A_BF16, D, I);
    const int dots8 = USE_DOT_FP8(kind, xkind), dots = tiles || USE_DOT_GEMV(kind, xkind) || dots8;
    float *xf = xkind == A_F32 || dots ? (float *)x : to_f32(x, xkind, M * D);
    /* the dot products' rows of x and of the SwiGLU output: FP8's in fp8_dot_order, zero-padded */
    const int64_t DX = dots8 ? fp8_dot_padded(D) : D, IX = dots8 ? fp8_dot_padded(I) : I;
    float *acc = (float *)calloc((size_t)(M * D > 0 ? M * D : 1), sizeof(float));
    float *g = (float *)malloc((size_t)(P * I + 1) * sizeof(float));
    float *u = (float *)malloc((size_t)(P * I + 1) * sizeof(float));
    float *ye = (float *)malloc((size_t)(P * D + 1) * sizeof(float));
    uint16_t *gb = dots && !tiles ? (uint16_t *)calloc((size_t)(P * IX + 1), sizeof(uint16_t)) : NULL; /* g in bf16 */
    int64_t *start = (int64_t *)malloc((size_t)(E + 1) * sizeof(int64_t));
    int64_t *pair = (int64_t *)malloc((size_t)(P + 1) * sizeof(int64_t));
    group_by_expert(idx, P, E, start, pair);
    int64_t most = 0; /* the most pairs routed to one expert */
    for (int64_t e = 0; e < E; e++) most = start[e + 1] - start[e] > most ? start[e + 1] - start[e] : most;
    /* each pair's row of x, in x's bf16 for the dot products, else in fp32 */
    const size_t xes = dots ? sizeof(uint16_t) : sizeof(float);
    char *xe = (char *)malloc((size_t)(P * DX + 1) * xes);
    for (int64_t j = 0; j < start[E]; j++) {
        const char *row = (const char *)xf + (size_t)((pair[j] / topk) * D) * xes;
        if (dots8)
            fp8_dot_order((const uint16_t *)row, 1, D, (uint16_t *)xe + j * DX);
        else
            memcpy(xe + (size_t)(j * D) * xes, row, (size_t)D * xes);
    }
    int64_t *order = (int64_t *)malloc((size_t)(E + 1) * sizeof(int64_t)), R = 0; /* the experts routed to */
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) order[R++] = e;
    /* with tiles (one expert): its rows of x as B tiles, and of the SwiGLU output (filled by the gate/up pass) */
    uint32_t *xt = tiles ? amx_rows_vnni((const uint16_t *)xe, start[E], D) : NULL;
    uint16_t *gt = tiles ? (uint16_t *)calloc((size_t)((start[E] + 15) / 16 * (I / 32) * 512 + 1), sizeof(uint16_t)) : NULL;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = (float *)malloc(scratch_floats(kind, most, I > D ? I : D) * sizeof(float));
        int64_t t0, t1, d_t0, d_t1;
        my_tiles(tiles_of(I), &t0, &t1);
        my_tiles(tiles_of(D), &d_t0, &d_t1);
        const int64_t i0 = t0 * NR, i1 = t1 * NR < I ? t1 * NR : I;
        /* where this thread's share of expert e's gate (or up) and down matrices start: the stream goes
         * gate, up, next expert's gate, ..., then every down in turn */
        const size_t gate_share = weight_bytes(kind, t0 * NR * D), down_share = weight_bytes(kind, d_t0 * NR * I);
#define GATE_AT(e) ((const char *)wg + weight_bytes(kind, (e) * I * D) + gate_share)
#define UP_AT(e) ((const char *)wu + weight_bytes(kind, (e) * I * D) + gate_share)
#define DOWN_AT(e) ((const char *)wd + weight_bytes(kind, (e) * D * I) + down_share)
        for (int64_t r = 0; r < R; r++) {
            const int64_t e = order[r], j0 = start[e], me = start[e + 1] - j0;
            const size_t off = weight_bytes(kind, e * I * D);
            const char *after_up = r + 1 < R ? GATE_AT(order[r + 1]) : DOWN_AT(order[0]);
            if (tiles) {
                amx_gemv_rows((const uint16_t *)((const char *)wg + off), I, D, xt, me, g, I, i0, i1, UP_AT(e));
                amx_gemv_rows((const uint16_t *)((const char *)wu + off), I, D, xt, me, u, I, i0, i1, after_up);
            } else if (dots8) {
                const uint16_t *xj = (const uint16_t *)xe + j0 * DX;
                dp8_gemv_tiles((const uint8_t *)wg + off, (const float *)expert_scales(kind, sg, e, I, D), I, D, xj, me,
                               g + j0 * I, I, t0, t1, UP_AT(e));
                dp8_gemv_tiles((const uint8_t *)wu + off, (const float *)expert_scales(kind, su, e, I, D), I, D, xj, me,
                               u + j0 * I, I, t0, t1, after_up);
            } else if (dots) {
                const uint16_t *xj = (const uint16_t *)xe + j0 * D;
                dp_gemv_tiles((const uint16_t *)((const char *)wg + off), I, D, xj, me, g + j0 * I, I, t0, t1);
                dp_gemv_tiles((const uint16_t *)((const char *)wu + off), I, D, xj, me, u + j0 * I, I, t0, t1);
            } else {
                const float *xj = (const float *)xe + j0 * D;
                gemv_tiles(kind, (const char *)wg + off, expert_scales(kind, sg, e, I, D), I, D, xj, me, g + j0 * I,
                           I, t0, t1, scratch, UP_AT(e));
                gemv_tiles(kind, (const char *)wu + off, expert_scales(kind, su, e, I, D), I, D, xj, me, u + j0 * I,
                           I, t0, t1, scratch, after_up);
            }
            for (int64_t j = j0; j < j0 + me; j++)
                for (int64_t n = i0; n < i1; n++) g[j * I + n] = silu(g[j * I + n]) * u[j * I + n] * gates[pair[j]];
            if (tiles) /* the SwiGLU output in bf16 as the down matrix's B tiles: this thread's channels */
                for (int64_t j = j0; j < j0 + me; j++)
                    for (int64_t n = i0; n < i1; n++) gt[amx_rows_at(j, n, I)] = f32_to_bf16(g[j * I + n]);
            else if (dots)
                for (int64_t j = j0; j < j0 + me; j++)
                    for (int64_t n = i0; n < i1; n++) gb[j * IX + (dots8 ? fp8_dot_column(n) : n)] = f32_to_bf16(g[j * I + n]);
        }
#pragma omp barrier
        const int64_t d0 = d_t0 * NR, d1 = d_t1 * NR < D ? d_t1 * NR : D;
        for (int64_t r = 0; r < R; r++) {
            const int64_t e = order[r], j0 = start[e], me = start[e + 1] - j0;
            if (tiles)
                amx_gemv_rows((const uint16_t *)((const char *)wd + weight_bytes(kind, e * D * I)), D, I, (uint32_t *)gt,
                              me, ye, D, d0, d1, NULL);
            else if (dots8)
                dp8_gemv_tiles((const uint8_t *)wd + e * D * I, (const float *)expert_scales(kind, sd, e, D, I), D, I,
                               gb + j0 * IX, me, ye + j0 * D, D, d_t0, d_t1, r + 1 < R ? DOWN_AT(order[r + 1]) : NULL);
            else if (dots)
                dp_gemv_tiles((const uint16_t *)((const char *)wd + weight_bytes(kind, e * D * I)), D, I, gb + j0 * I,
                              me, ye + j0 * D, D, d_t0, d_t1);
            else
                gemv_tiles(kind, (const char *)wd + weight_bytes(kind, e * D * I), expert_scales(kind, sd, e, D, I), D,
                           I, g + j0 * I, me, ye + j0 * D, D, d_t0, d_t1, scratch,
                           r + 1 < R ? DOWN_AT(order[r + 1]) : NULL);
            for (int64_t j = j0; j < j0 + me; j++)
                for (int64_t n = d0; n < d1; n++) acc[(pair[j] / topk) * D + n] += ye[j * D + n];
        }
#undef GATE_AT
#undef UP_AT
#undef DOWN_AT
        free(scratch);
    }
    free(order);
    store(out, okind, acc, M * D, accumulate);
    if (xf != x) free(xf);
    free(acc), free(xe), free(g), free(u), free(ye), free(gb), free(start), free(pair);
    free(xt), free(gt);
    return 0;
}

/* exp(x) for 8 floats (Cephes' polynomial, as in avx_mathfun): relative error about 1e-7; exactly 0 for
 * x = -inf (masked scores). */
static inline __m256 exp8(__m256 x) {
    const __m256 is_neg_inf = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(is_neg_inf, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* Index of the largest of v[0..n) not yet taken (ties: the lowest index). */
static int64_t argmax_free(const float *v, const unsigned char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* The router of a decode step (Router.forward, for inference): for each of M rows of x [M, D] (fp32 or
 * bf16, read as fp32), scores = sigmoid or softmax of gate [E, D] (fp32) . x; the choice scores (plus
 * ``bias`` when not NULL) pick, within the ``topk_group`` best of ``n_group`` groups (a group's score: the
 * sum of its two best (group_sum = 1) or its best), the ``topk`` best experts; their unbiased scores,
 * normalised to sum 1 when ``normalize``, times ``route_scale``, are the gates. idx [M, topk] int64 and
 * gates [M, topk] fp32, experts in descending choice order. Returns 0. */
int dsv3_route(const float *gate, const float *bias, int64_t E, int64_t D, const void *x, int xkind, int64_t M,
               int softmax, int64_t n_group, int64_t topk_group, int group_sum, int64_t topk, int normalize,
               float route_scale, int64_t *idx, float *gates, int nthreads) {
    float *xf = to_f32(x, xkind, M * D);
    float *scores = (float *)malloc((size_t)(M * E) * sizeof(float));
    float *scratch = (float *)malloc(scratch_floats(W_F32, M, D) * sizeof(float));
    (void)nthreads; /* E x D is small: one thread */
    gemv_tiles(W_F32, gate, NULL, E, D, xf, M, scores, E, 0, tiles_of(E), scratch, NULL);
    free(scratch);
    float *choice = (float *)malloc((size_t)E * sizeof(float));
    float *group = (float *)malloc((size_t)(n_group > 0 ? n_group : 1) * sizeof(float));
    unsigned char *taken = (unsigned char *)malloc((size_t)(E + n_group + 1));
    const int64_t per = E / n_group;
    for (int64_t m = 0; m < M; m++) {
        float *s = scores + m * E;
        if (softmax) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t e = 0; e < E; e++) mx = s[e] > mx ? s[e] : mx;
            for (int64_t e = 0; e < E; e++) sum += (s[e] = expf(s[e] - mx));
            for (int64_t e = 0; e < E; e++) s[e] /= sum;
        } else {
            for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-s[e]));
        }
        for (int64_t e = 0; e < E; e++) choice[e] = s[e] + (bias ? bias[e] : 0.0f);
        if (n_group > 1) {
            for (int64_t g = 0; g < n_group; g++) {
                const float *c = choice + g * per;
                float a = -INFINITY, b = -INFINITY;  /* the two best of the group */
                for (int64_t j = 0; j < per; j++) {
                    if (c[j] > a) b = a, a = c[j];
                    else if (c[j] > b) b = c[j];
                }
                group[g] = group_sum ? a + b : a;
            }
            memset(taken, 0, (size_t)n_group);
            for (int64_t k = 0; k < topk_group; k++) taken[argmax_free(group, taken, n_group)] = 1;
            for (int64_t g = 0; g < n_group; g++)
                if (!taken[g])
                    for (int64_t j = 0; j < per; j++) choice[g * per + j] = -INFINITY;
        }
        memset(taken, 0, (size_t)E);
        float total = 0.0f;
        for (int64_t k = 0; k < topk; k++) {
            const int64_t e = argmax_free(choice, taken, E);
            taken[e] = 1;
            idx[m * topk + k] = e;
            gates[m * topk + k] = s[e];
            total += s[e];
        }
        for (int64_t k = 0; k < topk; k++) {
            float w = gates[m * topk + k];
            if (normalize && topk > 1) w = w / (total + 1e-20f);
            gates[m * topk + k] = w * route_scale;
        }
    }
    free(xf), free(scores), free(choice), free(group), free(taken);
    return 0;
}

/* ---- Helpers of the attention and block kernels below: activations read and stored by dtype. */

static inline float blk_load(const void *a, int kind, int64_t i) {
    return kind == A_F32 ? ((const float *)a)[i] : bf16_to_f32(((const uint16_t *)a)[i]);
}

static inline void blk_store(void *a, int kind, int64_t i, float v) {
    if (kind == A_F32) ((float *)a)[i] = v;
    else ((uint16_t *)a)[i] = f32_to_bf16(v);
}

/* v as the activation dtype stores it (the rounding of a tensor's ``.to(dtype)``). */
static inline float blk_round(int kind, float v) {
    if (kind == A_F32) return v;
    uint32_t bits = (uint32_t)f32_to_bf16(v) << 16;
    memcpy(&v, &bits, 4);
    return v;
}

/* 8 consecutive fp32 or bf16 values as fp32. */
static inline __m256 blk_load8(const void *a, int kind, int64_t off) {
    if (kind == A_F32) return _mm256_loadu_ps((const float *)a + off);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)a + off));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* sum_k a[off + k] * b[k] over n values: a fp32 or bf16 (kind, read exactly as fp32), b fp32. */
static float blk_dot(const void *a, int kind, int64_t off, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        s0 = _mm256_fmadd_ps(blk_load8(a, kind, off + k), _mm256_loadu_ps(b + k), s0);
        s1 = _mm256_fmadd_ps(blk_load8(a, kind, off + k + 8), _mm256_loadu_ps(b + k + 8), s1);
    }
    for (; k + 8 <= n; k += 8) s0 = _mm256_fmadd_ps(blk_load8(a, kind, off + k), _mm256_loadu_ps(b + k), s0);
    float tail = 0.0f;
    for (; k < n; k++) tail += blk_load(a, kind, off + k) * b[k];
    return hsum(_mm256_add_ps(s0, s1)) + tail;
}

#define ATT_QUERIES 4 /* queries per micro-kernel: each cached row loaded serves four queries */
#define ATT_GROUP 8   /* queries per task while the tasks still cover the threads: the cache read once for 8 */
#define DP_GROUP 16   /* the same for the bf16 dot products: all 16 heads of a row at one token */
#define ATT_TILE 32   /* keys scored, then summed into the outputs while they are still in L1 */

#ifndef ATT_KEYS
#define ATT_KEYS 3 /* keys per score micro-kernel: 4 x 3 accumulators, 3 rows and a query vector in registers */
#endif

/* Where a batch row's cache slots lie (dsv3.model.mla.LatentCache): slot s of row b is at the row's
 * physical position q = s - shift[b], in page table[b * table_stride + q / page_tokens] at offset
 * q % page_tokens (a page of -1: none mapped; table_cols pages a row; a page number outside [0, n_pages) is
 * taken as none, so a bad table cannot reach past the pool). table NULL: the plain cache, one page per row
 * (row b is page b, shift 0). The pages' own strides (elements between pages, between slots) are the
 * caller's: kv_bstride/pe_bstride and kv_sstride/pe_sstride. */
typedef struct {
    const int32_t *table;
    int64_t table_stride, table_cols;
    const int64_t *shift; /* [rows] or NULL (all 0) */
    int64_t page_tokens, n_pages;
} PageMap;

/* The page holding slot s of row b, its offset in *off; -1 for a slot before the row's shift (its left
 * padding, never stored), -2 for one past its mapped pages or in an unmapped one. */
static inline int64_t page_of(const PageMap *m, int64_t b, int64_t s, int64_t *off) {
    if (!m->table) {
        *off = s;
        return b;
    }
    const int64_t q = s - (m->shift ? m->shift[b] : 0), pt = m->page_tokens;
    if (q < 0) return -1;
    if (q >= m->table_cols * pt) return -2;
    const int64_t c = q / pt, page = m->table[b * m->table_stride + c];
    *off = q - c * pt;
    return page >= 0 && page < m->n_pages ? page : -2;
}

/* The cache rows of one batch row's keys as a task reads them: att_keys gives each key's address. */
typedef struct {
    const PageMap *map; /* NULL: the plain cache, keys ``kv_row`` bytes apart from kv, pe */
    int64_t b;
    const char *kv, *pe;          /* the layer's page 0 (paged), or the row's first key (plain) */
    size_t kv_page, pe_page, kv_row, pe_row; /* bytes between pages, between slots */
    const char *kv_none, *pe_none; /* where a key the row does not hold is read: its first held slot */
} RowKeys;

static RowKeys row_keys(const PageMap *map, int64_t b, const void *kv, const void *pe, int64_t kv_pstride,
                        int64_t kv_sstride, int64_t pe_pstride, int64_t pe_sstride, size_t es) {
    RowKeys k = {map->table ? map : NULL, b, (const char *)kv, (const char *)pe, (size_t)kv_pstride * es,
                 (size_t)pe_pstride * es, (size_t)kv_sstride * es, (size_t)pe_sstride * es, NULL, NULL};
    if (!k.map) {
        k.kv += (size_t)b * k.kv_page, k.pe += (size_t)b * k.pe_page;
        return k;
    }
    /* Keys the row does not hold have bias -inf, but their rows are still read (a tile is scored whole): read
     * them where the row's own values lie, finite, not in another row's pages (or past the pool's end). */
    int64_t page = 0;
    for (int64_t c = 0; c < map->table_cols; c++) {
        const int64_t at = map->table[b * map->table_stride + c];
        if (at >= 0 && at < map->n_pages) {
            page = at;
            break;
        }
    }
    k.kv_none = k.kv + (size_t)page * k.kv_page, k.pe_none = k.pe + (size_t)page * k.pe_page;
    return k;
}

/* The addresses kr[j], pr[j] of keys s0 + j, j < n. A tile's keys are scored and summed in the same order
 * whatever their addresses, so a paged cache gives the plain cache's bits for the same values. A paged row is
 * walked a page at a time: one table look-up and division a page, not one a key (the addresses are made for
 * every tile, and again for its prefetch). */
static inline __attribute__((always_inline)) void att_keys(const RowKeys *k, int64_t s0, int64_t n,
                                                           const char **kr, const char **pr) {
    if (!k->map) {
        for (int64_t j = 0; j < n; j++) kr[j] = k->kv + (size_t)(s0 + j) * k->kv_row, pr[j] = k->pe + (size_t)(s0 + j) * k->pe_row;
        return;
    }
    for (int64_t j = 0; j < n;) {
        int64_t off;
        const int64_t page = page_of(k->map, k->b, s0 + j, &off);
        if (page < 0) {
            kr[j] = k->kv_none, pr[j] = k->pe_none;
            j++;
            continue;
        }
        const char *kp = k->kv + (size_t)page * k->kv_page, *pp = k->pe + (size_t)page * k->pe_page;
        const int64_t run = k->map->page_tokens - off < n - j ? k->map->page_tokens - off : n - j;
        for (int64_t i = 0; i < run; i++, j++)
            kr[j] = kp + (size_t)(off + i) * k->kv_row, pr[j] = pp + (size_t)(off + i) * k->pe_row;
    }
}

/* Weights read after the attention (the block's output projection, router and shared expert), fetched
 * into L2 while the attention computes: at long contexts it is FMA-bound and leaves the memory idle. Each
 * thread walks its own share of the ranges, a few cache lines per score step. */
#define PF_RANGES 8
#define PF_LINES_PER_STEP 6
typedef struct { const char *p[PF_RANGES]; size_t n[PF_RANGES]; int count; } PfRanges;
typedef struct { /* [at, end): this thread's share still to fetch, as offsets into the ranges one after another */
    const PfRanges *r;
    int i;       /* the range holding offset ``at`` */
    size_t done; /* the bytes of the ranges before range i */
    size_t at, end;
} PfCursor;
static __thread PfCursor pf_cursor;

/* This thread's share (thread t of T) of the bytes of ``r``, as the cursor's range [at, end) in the ranges'
 * concatenation. */
static void pf_start(const PfRanges *r, int t, int T) {
    size_t total = 0;
    for (int i = 0; i < (r ? r->count : 0); i++) total += r->n[i];
    pf_cursor.r = r, pf_cursor.i = 0, pf_cursor.done = 0;
    pf_cursor.at = total * (size_t)t / (size_t)T, pf_cursor.end = total * (size_t)(t + 1) / (size_t)T;
}

/* Prefetch the next ``lines`` cache lines of this thread's share into L2. */
static inline void pf_step(int lines) {
    PfCursor *c = &pf_cursor;
    for (int l = 0; l < lines && c->at < c->end; l++, c->at += 64) {
        while (c->i < c->r->count && c->at >= c->done + c->r->n[c->i]) c->done += c->r->n[c->i++];
        if (c->i >= c->r->count) { c->at = c->end; return; }
        _mm_prefetch(c->r->p[c->i] + (c->at - c->done), _MM_HINT_T1);
    }
}

/* Adds the products of ATT_QUERIES fp32 queries q [ATT_QUERIES, n] (row stride ldq) with ATT_KEYS cached
 * rows k[u] of n values: columns [0, n / 8 * 8) into acc[i][u] (one 8-wide chain per query and row), the
 * rest into tail[i][u]. A bf16 row is read 16 values at a time as its even then its odd ones (bf16_even8,
 * bf16_odd8: no widened copy of the cache), so bf16 queries come interleaved (interleave). Each loaded query vector serves every row and each loaded row four queries (7 loads
 * per 12 FMAs: bound by the FMA units, not by loads). KIND is a constant after inlining. */
static inline __attribute__((always_inline)) void att_dots(int kind, const float *q, int64_t ldq,
                                                           const char *const *k, int64_t n,
                                                           __m256 acc[ATT_QUERIES][ATT_KEYS],
                                                           float tail[ATT_QUERIES][ATT_KEYS]) {
    int64_t c = 0;
    if (kind == A_BF16) /* whole 16-column blocks: even then odd columns, the queries interleaved to match */
        for (; c + 16 <= n; c += 16)
            for (int half = 0; half < 2; half++) {
                __m256 v[ATT_KEYS];
                for (int u = 0; u < ATT_KEYS; u++)
                    v[u] = half ? bf16_odd8((const uint16_t *)k[u] + c) : bf16_even8((const uint16_t *)k[u] + c);
                for (int i = 0; i < ATT_QUERIES; i++) {
                    __m256 qi = _mm256_loadu_ps(q + i * ldq + c + 8 * half);
                    __asm__("" : "+x"(qi));
                    for (int u = 0; u < ATT_KEYS; u++) acc[i][u] = _mm256_fmadd_ps(qi, v[u], acc[i][u]);
                }
            }
    for (; c + 8 <= n; c += 8) {
        __m256 v[ATT_KEYS];
        for (int u = 0; u < ATT_KEYS; u++) v[u] = blk_load8(k[u], kind, c);
        for (int i = 0; i < ATT_QUERIES; i++) {
            __m256 qi = _mm256_loadu_ps(q + i * ldq + c);
            __asm__("" : "+x"(qi)); /* one load per query vector: keeps the compiler from folding it into each FMA */
            for (int u = 0; u < ATT_KEYS; u++) acc[i][u] = _mm256_fmadd_ps(qi, v[u], acc[i][u]);
        }
    }
    for (; c < n; c++)
        for (int u = 0; u < ATT_KEYS; u++) {
            const float x = blk_load(k[u], kind, c);
            for (int i = 0; i < ATT_QUERIES; i++) tail[i][u] += q[i * ldq + c] * x;
        }
}

/* sc[i * ATT_TILE + j] = q_lat[i] . kv[j] + q_pe[i] . pe[j] for ATT_QUERIES queries and n keys (their rows
 * at kv[j], pe[j]), ATT_KEYS keys at a time (the last keys repeated to fill a pass). A score's summation order
 * is fixed (its chain over kv then pe, reduced, plus the scalar tails), whatever the other queries and keys of
 * the call. */
static inline __attribute__((always_inline)) void att_tile_scores(int kind, const float *q_lat, const float *q_pe,
                                                                  int64_t r, int64_t p, const char *const *kv,
                                                                  const char *const *pe, int64_t n, float *sc) {
    for (int64_t j = 0; j < n; j += ATT_KEYS) {
        const char *kr[ATT_KEYS], *pr[ATT_KEYS];
        for (int u = 0; u < ATT_KEYS; u++) {
            const int64_t ju = j + u < n ? j + u : n - 1;
            kr[u] = kv[ju], pr[u] = pe[ju];
        }
        __m256 acc[ATT_QUERIES][ATT_KEYS];
        float tail[ATT_QUERIES][ATT_KEYS] = {{0.0f}};
        for (int i = 0; i < ATT_QUERIES; i++)
            for (int u = 0; u < ATT_KEYS; u++) acc[i][u] = _mm256_setzero_ps();
        if (pf_cursor.r) pf_step(PF_LINES_PER_STEP);
        att_dots(kind, q_lat, r, kr, r, acc, tail);
        att_dots(kind, q_pe, p, pr, p, acc, tail);
        for (int u = 0; u < ATT_KEYS && j + u < n; u++) {
            float d[ATT_QUERIES];
            _mm_storeu_ps(d, hsum4(acc[0][u], acc[1][u], acc[2][u], acc[3][u]));
            for (int i = 0; i < ATT_QUERIES; i++) sc[i * ATT_TILE + j + u] = d[i] + tail[i][u];
        }
    }
}

/* o[i] += sum_j p[i][j] * rows[j] for ATT_QUERIES queries over n keys;
 * o [ATT_QUERIES, r] fp32, p [ATT_QUERIES, ATT_TILE]; from bf16 rows o comes interleaved (as att_dots reads
 * them). KIND is a constant after inlining. */
static inline __attribute__((always_inline)) void att_values(int kind, float *o, const float *p,
                                                             const char *const *rows, int64_t n, int64_t r) {
    int64_t k = 0;
    for (; k + 16 <= r; k += 16) {
        __m256 a[ATT_QUERIES][2];
        for (int i = 0; i < ATT_QUERIES; i++) a[i][0] = _mm256_loadu_ps(o + i * r + k), a[i][1] = _mm256_loadu_ps(o + i * r + k + 8);
        for (int64_t j = 0; j < n; j++) {
            const char *rj = rows[j];
            const __m256 v0 = kind == A_BF16 ? bf16_even8((const uint16_t *)rj + k) : blk_load8(rj, kind, k);
            const __m256 v1 = kind == A_BF16 ? bf16_odd8((const uint16_t *)rj + k) : blk_load8(rj, kind, k + 8);
            for (int i = 0; i < ATT_QUERIES; i++) {
                const __m256 w = _mm256_broadcast_ss(p + i * ATT_TILE + j);
                a[i][0] = _mm256_fmadd_ps(w, v0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(w, v1, a[i][1]);
            }
        }
        for (int i = 0; i < ATT_QUERIES; i++) _mm256_storeu_ps(o + i * r + k, a[i][0]), _mm256_storeu_ps(o + i * r + k + 8, a[i][1]);
    }
    for (; k < r; k++)
        for (int64_t j = 0; j < n; j++) {
            const float v = blk_load(rows[j], kind, k);
            for (int i = 0; i < ATT_QUERIES; i++) o[i * r + k] += p[i * ATT_TILE + j] * v;
        }
}

/* Online softmax for one query over a tile of n keys from slot s0: sc [n] (scores, -inf = masked), plus the
 * query's bias row [S] from s0 (NULL: none), becomes exp(sc - max) with the running max ``m`` and sum ``l``
 * updated; the output so far o [r] is rescaled when the max grows. */
static void att_softmax_tile(float *sc, const float *bias, int64_t s0, int64_t n, float *m, float *l, float *o,
                             int64_t r) {
    if (bias)
        for (int64_t j = 0; j < n; j++) sc[j] += bias[s0 + j];
    float mx = *m;
    int64_t j = 0;
    if (n >= 8) { /* eight running maxima, then one across them: the scalar chain's compares wait on each other */
        __m256 vm = _mm256_loadu_ps(sc);
        for (j = 8; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sc + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float t = _mm_cvtss_f32(h);
        mx = t > mx ? t : mx;
    }
    for (; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
    if (mx == -INFINITY) { /* every key so far is masked */
        memset(sc, 0, (size_t)n * sizeof(float));
        return;
    }
    if (mx > *m) {
        const float f = expf(*m - mx); /* 0 when nothing was seen yet */
        *l *= f;
        for (int64_t k = 0; k < r; k++) o[k] *= f;
        *m = mx;
    }
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
        _mm256_storeu_ps(sc + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; j < n; j++) sum += (sc[j] = sc[j] == -INFINITY ? 0.0f : expf(sc[j] - mx));
    *l += sum;
}

/* A task's scratch, the larger of att_task's (its queries' q_lat, o_lat [ATT_GROUP, r] and q_pe [ATT_GROUP, p],
 * then one row's worth for reordering) and z_task's (queries and outputs of Z_GROUP queries, padded). */
#define ATT_FLOATS(r, p) (Z_GROUP * (2 * Z_PAD(r) + Z_PAD(p)) + (r) + (p) + 1)
#define Z_PAD(n) (((n) + 15) / 16 * 16) /* n rounded up to whole 512-bit vectors of fp32 (z_task's rows) */

typedef struct { /* dsv3_mla_decode's arguments, for its tasks */
    const void *q, *kv, *pe;
    const float *cos, *sin, *bias;
    const void *w_uk, *w_uv; /* fp32 or bf16 (wkind) */
    int64_t wkind, akind, rot_bstride, uk_hstride, uk_rstride, uv_hstride, uv_rstride, T, H, S, nope, p, r, v;
    int64_t kv_bstride, kv_sstride, pe_bstride, pe_sstride, bias_bstride; /* b: between pages (plain: rows) */
    float scale;
    void *out;
    const PfRanges *pf; /* or NULL */
    PageMap pages;
    const float *qlat; /* [B * T * H, r]: every query's q_lat, computed before the tasks (NULL: each task's own) */
} AttArgs;

/* Row b's keys in this attention's cache (es bytes a value). */
static RowKeys att_row_keys(const AttArgs *a, int64_t b, size_t es) {
    return row_keys(&a->pages, b, a->kv, a->pe, a->kv_bstride, a->kv_sstride, a->pe_bstride, a->pe_sstride, es);
}

#define ABSORB_ROWS 4 /* queries of one head whose q_lat columns stay in registers together */

/* Every query's q_lat = W_UK[h]^T q_nope * scale into qlat [B * T * H, r], one head per iteration of a
 * worksharing loop (called inside a parallel region): for up to ABSORB_ROWS queries of the head and 16
 * columns at a time the sums stay in registers over all of W_UK's rows, each row's 16 weights loaded once for
 * the queries. Each sum takes att_query's products in att_query's order (an FMA per row of W_UK from 0), so
 * the numbers are the same. */
static void att_absorb_queries(const AttArgs *a, int64_t B, float *qlat) {
    const int64_t H = a->H, BT = B * a->T, r = a->r, nope = a->nope, qw = nope + a->p;
    const int ak = (int)a->akind, wk = (int)a->wkind;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++) {
        float qs[ABSORB_ROWS][nope > 0 ? nope : 1];
        for (int64_t bt0 = 0; bt0 < BT; bt0 += ABSORB_ROWS) {
            const int n = BT - bt0 < ABSORB_ROWS ? (int)(BT - bt0) : ABSORB_ROWS;
            for (int i = 0; i < ABSORB_ROWS; i++)
                for (int64_t j = 0; j < nope; j++)
                    qs[i][j] = i < n ? blk_load(a->q, ak, ((bt0 + i) * H + h) * qw + j) * a->scale : 0.0f;
            int64_t k = 0;
            for (; k + 16 <= r; k += 16) {
                __m256 acc[ABSORB_ROWS][2];
                for (int i = 0; i < ABSORB_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
                for (int64_t j = 0; j < nope; j++) {
                    const int64_t row = h * a->uk_hstride + j * a->uk_rstride + k;
                    const __m256 w0 = blk_load8(a->w_uk, wk, row), w1 = blk_load8(a->w_uk, wk, row + 8);
                    for (int i = 0; i < ABSORB_ROWS; i++) {
                        const __m256 qj = _mm256_set1_ps(qs[i][j]);
                        acc[i][0] = _mm256_fmadd_ps(qj, w0, acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(qj, w1, acc[i][1]);
                    }
                }
                for (int i = 0; i < n; i++) {
                    float *ql = qlat + ((bt0 + i) * H + h) * r + k;
                    _mm256_storeu_ps(ql, acc[i][0]), _mm256_storeu_ps(ql + 8, acc[i][1]);
                }
            }
            for (int i = 0; i < n; i++) { /* the columns past the last 16 */
                float *ql = qlat + ((bt0 + i) * H + h) * r;
                for (int64_t kk = k; kk < r; kk++) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j < nope; j++)
                        acc = fmaf(qs[i][j], blk_load(a->w_uk, wk, h * a->uk_hstride + j * a->uk_rstride + kk), acc);
                    ql[kk] = acc;
                }
            }
        }
    }
}

/* Query i of a task, m = m0 + i: q_lat[i] = W_UK[h]^T q_nope * scale, q_pe[i] = rope(q_pe) * scale. */
static void att_query(const AttArgs *a, int64_t b, int64_t m, float *q_lat, float *q_pe) {
    const int64_t t = m / a->H, h = m % a->H, p = a->p, r = a->r, base = ((b * a->T + t) * a->H + h) * (a->nope + p);
    const int ak = (int)a->akind;
    if (a->qlat) {
        memcpy(q_lat, a->qlat + (b * a->T * a->H + m) * r, (size_t)r * sizeof(float));
    } else {
        for (int64_t j = 0; j < a->nope; j++) {
            const float qj = blk_load(a->q, ak, base + j) * a->scale;
            const int64_t row = h * a->uk_hstride + j * a->uk_rstride;
            if (a->wkind == A_F32)
                for (int64_t k = 0; k < r; k++) q_lat[k] += qj * ((const float *)a->w_uk + row)[k];
            else
                for (int64_t k = 0; k < r; k++) q_lat[k] += qj * bf16_to_f32(((const uint16_t *)a->w_uk + row)[k]);
        }
    }
    const float *c = a->cos + a->rot_bstride * b + t * (p / 2), *s = a->sin + a->rot_bstride * b + t * (p / 2);
    for (int64_t j = 0; j < p / 2; j++) {
        const float x0 = blk_load(a->q, ak, base + a->nope + 2 * j), x1 = blk_load(a->q, ak, base + a->nope + 2 * j + 1);
        q_pe[2 * j] = (x0 * c[j] - x1 * s[j]) * a->scale;
        q_pe[2 * j + 1] = (x0 * s[j] + x1 * c[j]) * a->scale;
    }
}

#define ATT_PF 2 /* tiles ahead that a task prefetches its cache rows */

/* Prefetch the cache lines of one cached row of ``bytes`` bytes. */
static inline void att_prefetch_row(const char *row, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    _mm_prefetch(row + bytes - 1, _MM_HINT_T0);
}

/* The tile ATT_PF tiles after the one at key s0 (S keys in all, es bytes a value): the cache streams from
 * L3 or memory, so fetch it ahead of the work. (Fetching the first ATT_PF tiles as well, at the first one,
 * made the attention slower, over plain and paged caches alike.) */
static inline __attribute__((always_inline)) void att_prefetch_ahead(const RowKeys *k, int64_t r, int64_t p,
                                                                     size_t es, int64_t s0, int64_t S) {
    const int64_t at = s0 + ATT_PF * ATT_TILE, n = S - at < ATT_TILE ? S - at : ATT_TILE;
    const char *kr[ATT_TILE], *pr[ATT_TILE];
    att_keys(k, at, n, kr, pr);
    for (int64_t j = 0; j < n; j++) {
        att_prefetch_row(kr[j], (size_t)r * es);
        att_prefetch_row(pr[j], (size_t)p * es);
    }
}

/* Query m's output: out[b, t, h * v:(h + 1) * v] = W_UV[h] o / sum, o [r] in channel order (scaled in place). */
static void att_output(const AttArgs *a, int64_t b, int64_t m, float *o, float sum) {
    const int64_t t = m / a->H, h = m % a->H, r = a->r;
    const float inv = 1.0f / sum;
    for (int64_t k = 0; k < r; k++) o[k] *= inv;
    for (int64_t c = 0; c < a->v; c++)
        blk_store(a->out, (int)a->akind, ((b * a->T + t) * a->H + h) * a->v + c,
                  blk_dot(a->w_uv, (int)a->wkind, h * a->uv_hstride + c * a->uv_rstride, o, r));
}

/* The whole tiles of keys a task's queries may see: [*s0, *s1), *s0 a multiple of ATT_TILE. Outside it every
 * query's bias is -inf: the slots before a row's first token after a merge right-aligned it beside a longer
 * one, or past a prefill chunk's causal end. Those tiles would only add zero weights (att_softmax_tile leaves
 * the running state alone on them), so skipping them changes no bit, and a short row beside a long one
 * attends over its own history only. bias_row NULL: every key. */
static void att_span(const float *const *bias_row, int mb, int64_t S, int64_t *s0, int64_t *s1) {
    int64_t lo = S, hi = 0;
    for (int i = 0; i < mb; i++) {
        const float *b = bias_row[i];
        if (!b) {
            lo = 0, hi = S;
            break;
        }
        if (i > 0 && b == bias_row[i - 1]) continue; /* the heads of one token share a bias row */
        int64_t j = 0, e = S;
        while (j < lo && b[j] == -INFINITY) j++;
        while (e > hi && b[e - 1] == -INFINITY) e--;
        lo = j < lo ? j : lo, hi = e > hi ? e : hi;
    }
    if (lo >= hi) lo = 0, hi = S; /* no key at all (not a mask the engine makes): as without the span */
    *s0 = lo / ATT_TILE * ATT_TILE, *s1 = hi;
}

/* One task: queries [m0, m0 + mb) of batch row b (mb <= ATT_GROUP), in groups of ATT_QUERIES, over the
 * whole cache one tile at a time. buf: ATT_FLOATS(r, p) floats (its query part zeroed here).
 * KIND (the cache's dtype) is a constant after inlining. */
static inline __attribute__((always_inline)) void att_task(int kind, const AttArgs *a, int64_t b, int64_t m0,
                                                           int mb, float *buf) {
    const int64_t r = a->r, p = a->p, S = a->S, quads = (mb + ATT_QUERIES - 1) / ATT_QUERIES;
    float *q_lat = buf, *o_lat = buf + ATT_GROUP * r, *q_pe = buf + 2 * ATT_GROUP * r;
    float *row = q_pe + ATT_GROUP * p; /* [r + p]: a row being reordered */
    memset(buf, 0, (size_t)(ATT_GROUP * (2 * r + p)) * sizeof(float));
    float sc[ATT_GROUP * ATT_TILE], mx[ATT_GROUP], sum[ATT_GROUP];
    const float *bias_row[ATT_GROUP];
    for (int i = 0; i < mb; i++) {
        att_query(a, b, m0 + i, q_lat + i * r, q_pe + i * p);
        bias_row[i] = a->bias ? a->bias + b * a->bias_bstride + ((m0 + i) / a->H) * S : NULL;
        mx[i] = -INFINITY, sum[i] = 0.0f;
        if (kind == A_BF16) { /* the order att_dots reads bf16 rows in */
            interleave(q_lat + i * r, 1, r, row), memcpy(q_lat + i * r, row, (size_t)r * sizeof(float));
            interleave(q_pe + i * p, 1, p, row), memcpy(q_pe + i * p, row, (size_t)p * sizeof(float));
        }
    }
    const size_t es = kind == A_F32 ? 4 : 2;
    const RowKeys keys = att_row_keys(a, b, es);
    const char *kv_t[ATT_TILE], *pe_t[ATT_TILE];
    int64_t first, end;
    att_span(bias_row, mb, S, &first, &end);
    for (int64_t s0 = first; s0 < end; s0 += ATT_TILE) {
        const int64_t n = S - s0 < ATT_TILE ? S - s0 : ATT_TILE;
        att_keys(&keys, s0, n, kv_t, pe_t);
        att_prefetch_ahead(&keys, r, p, es, s0, end);
        for (int64_t g = 0; g < quads; g++) {
            const int64_t i0 = g * ATT_QUERIES;
            float *scg = sc + i0 * ATT_TILE;
            att_tile_scores(kind, q_lat + i0 * r, q_pe + i0 * p, r, p, kv_t, pe_t, n, scg);
            for (int64_t i = i0; i < i0 + ATT_QUERIES; i++) {
                float *si = sc + i * ATT_TILE;
                if (i >= mb) { /* a padding query: weights 0 */
                    memset(si, 0, (size_t)n * sizeof(float));
                    continue;
                }
                att_softmax_tile(si, bias_row[i], s0, n, mx + i, sum + i, o_lat + i * r, r);
            }
            att_values(kind, o_lat + i0 * r, scg, kv_t, n, r);
        }
    }
    for (int i = 0; i < mb; i++) {
        float *o = o_lat + i * r;
        if (kind == A_BF16) deinterleave(o, r, row), memcpy(o, row, (size_t)r * sizeof(float));
        att_output(a, b, m0 + i, o, sum[i]);
    }
}

/* ---- The attention over a bf16 cache with AVX512-BF16 dot products ------------------------------------
 * (VDPBF16PS: see the GEMV's dot products above.) A bf16 model's attention over a bf16 cache (the one att_task above computes in fp32 FMAs and which is FMA-bound
 * at long contexts) then takes its queries and its softmax weights rounded to bf16, which is where the
 * module path rounds them too (its q_lat and probs are bf16 tensors): every product exact, every sum fp32.
 * The tiles, the online softmax, the prefetches and W_UV are att_task's. A query's arithmetic does not
 * depend on its grouping, so the thread count still changes nothing; dsv3_bf16_dots turns the
 * path off (the AVX2 one then runs) and says whether it is on. */

#if DP_COMPILER

#define DP_KEYS 4 /* keys per score micro-kernel: 4 x 4 accumulators, 4 rows and a query vector in registers */

/* acc[i][u] += q_i . k_u over n values: q [ATT_QUERIES, ldq] bf16, zero-padded to a multiple of 32; the rows
 * k[u] read with masks, so nothing past their n values. */
DP_INLINE void dp_dots(const uint16_t *q, int64_t ldq, const uint16_t *const *k, int64_t n,
                       __m512 acc[ATT_QUERIES][DP_KEYS]) {
    for (int64_t c = 0; c < n; c += DP_WIDTH) {
        const __mmask32 m = dp_mask(n - c);
        __m512i kv[DP_KEYS];
        for (int u = 0; u < DP_KEYS; u++) kv[u] = _mm512_maskz_loadu_epi16(m, k[u] + c);
        for (int i = 0; i < ATT_QUERIES; i++) {
            const __m512i qi = _mm512_loadu_si512((const void *)(q + i * ldq + c));
            for (int u = 0; u < DP_KEYS; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)qi, (__m512bh)kv[u]);
        }
    }
}

/* The 16 lanes of a, b, c and d summed pairwise down to one 128-bit block per 128-bit block of the inputs:
 * block L of the result is [a_L, b_L, c_L, d_L], each the sum of that input's 4 lanes in block L. */
DP_INLINE __m512 dp_fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd); /* pairs of lanes moved as one */
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
}

/* The 16 dot products acc[i][u] as one vector: 128-bit block i holds query i's sums over keys u = 0..3. A
 * transposing reduction (45 operations for 16 sums) in place of one horizontal sum per product. */
DP_INLINE __m512 dp_sums(__m512 acc[ATT_QUERIES][DP_KEYS]) {
    __m512 v[ATT_QUERIES]; /* block L of v[i]: query i's four partial sums over block L of the lanes */
    for (int i = 0; i < ATT_QUERIES; i++) v[i] = dp_fold4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
    const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
}

/* att_tile_scores for a bf16 cache and bf16 queries qb [ATT_QUERIES, w] (the kv part, padded to a multiple of
 * 32, then the pe part, padded too), DP_KEYS keys at a time (a last partial group repeats its last key, whose
 * sums land in sc past n, where nothing reads them: sc rows hold ATT_TILE values). */
DP_INLINE void dp_tile_scores(const uint16_t *qb, int64_t w, int64_t wr, int64_t r, int64_t p,
                              const char *const *kv, const char *const *pe, int64_t n, float *sc) {
    _Static_assert(ATT_TILE % DP_KEYS == 0 && ATT_QUERIES == 4, "dp_sums: four queries, whole key groups a tile");
    for (int64_t j = 0; j < n; j += DP_KEYS) {
        const uint16_t *kr[DP_KEYS], *pr[DP_KEYS];
        for (int u = 0; u < DP_KEYS; u++) {
            const int64_t ju = j + u < n ? j + u : n - 1;
            kr[u] = (const uint16_t *)kv[ju], pr[u] = (const uint16_t *)pe[ju];
        }
        __m512 acc[ATT_QUERIES][DP_KEYS];
        for (int i = 0; i < ATT_QUERIES; i++)
            for (int u = 0; u < DP_KEYS; u++) acc[i][u] = _mm512_setzero_ps();
        if (pf_cursor.r) pf_step(PF_LINES_PER_STEP * DP_KEYS / ATT_KEYS);
        dp_dots(qb, w, kr, r, acc);
        dp_dots(qb + wr, w, pr, p, acc);
        const __m512 sums = dp_sums(acc);
        _mm_storeu_ps(sc + j, _mm512_castps512_ps128(sums));
        _mm_storeu_ps(sc + ATT_TILE + j, _mm512_extractf32x4_ps(sums, 1));
        _mm_storeu_ps(sc + 2 * ATT_TILE + j, _mm512_extractf32x4_ps(sums, 2));
        _mm_storeu_ps(sc + 3 * ATT_TILE + j, _mm512_extractf32x4_ps(sums, 3));
    }
}

/* o[i] += sum_j p[i][j] * row_j over n keys of r bf16 values, two keys per VDPBF16PS: in each 32-value block
 * the two rows are interleaved (unpacklo/unpackhi, within 128-bit lanes) against the weights' bf16 pairs
 * pp[i][j / 2] (weight j low, j + 1 high; 0 past n). So o [ATT_QUERIES, w] holds each block's values in that
 * order (dp_unpermute). */
DP_INLINE void dp_values(float *o, int64_t w, const uint32_t *pp, const char *const *rows, int64_t n, int64_t r) {
    for (int64_t c = 0; c < r; c += DP_WIDTH) {
        const __mmask32 m = dp_mask(r - c);
        __m512 lo[ATT_QUERIES], hi[ATT_QUERIES];
        for (int i = 0; i < ATT_QUERIES; i++)
            lo[i] = _mm512_loadu_ps(o + i * w + c), hi[i] = _mm512_loadu_ps(o + i * w + c + 16);
        for (int64_t j = 0; j < n; j += 2) {
            const __m512i a = _mm512_maskz_loadu_epi16(m, (const uint16_t *)rows[j] + c);
            const __m512i b = j + 1 < n ? _mm512_maskz_loadu_epi16(m, (const uint16_t *)rows[j + 1] + c)
                                        : _mm512_setzero_si512();
            const __m512i l = _mm512_unpacklo_epi16(a, b), h = _mm512_unpackhi_epi16(a, b);
            for (int i = 0; i < ATT_QUERIES; i++) {
                const __m512i pw = _mm512_set1_epi32((int)pp[i * (ATT_TILE / 2) + j / 2]);
                lo[i] = _mm512_dpbf16_ps(lo[i], (__m512bh)l, (__m512bh)pw);
                hi[i] = _mm512_dpbf16_ps(hi[i], (__m512bh)h, (__m512bh)pw);
            }
        }
        for (int i = 0; i < ATT_QUERIES; i++)
            _mm512_storeu_ps(o + i * w + c, lo[i]), _mm512_storeu_ps(o + i * w + c + 16, hi[i]);
    }
}

/* x [r] = o [w] in channel order: in block c, lane 4L + t of the low 16 is channel c + 8L + t and of the high
 * 16 channel c + 8L + 4 + t (L < 4, t < 4: unpacklo/unpackhi's order). */
static void dp_unpermute(const float *o, int64_t r, float *x) {
    for (int64_t ch = 0; ch < r; ch++) {
        const int64_t c = ch / DP_WIDTH * DP_WIDTH, q = ch - c, L = q / 8, t = q % 8;
        x[ch] = o[c + (t < 4 ? 0 : 16) + 4 * L + t % 4];
    }
}

/* A tile's softmax weights of one query (sc [n], 0 where masked) as bf16 pairs, 0 past n (round to nearest even). */
DP_INLINE void dp_pairs(const float *sc, int64_t n, uint32_t *pp) {
    const __m512 e0 = _mm512_maskz_loadu_ps((__mmask16)dp_mask(n), sc);
    const __m512 e1 = _mm512_maskz_loadu_ps((__mmask16)dp_mask(n > 16 ? n - 16 : 0), sc + 16);
    _mm512_storeu_si512((void *)pp, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
}

/* att_task for a bf16 model over a bf16 cache, in VDPBF16PS: queries [m0, m0 + mb) of batch row b. */
static DP_TARGET void dp_task(const AttArgs *a, int64_t b, int64_t m0, int mb) {
    _Static_assert(ATT_TILE == 32, "dp_pairs packs one tile of weights into one vector");
    const int64_t r = a->r, p = a->p, S = a->S, quads = (mb + ATT_QUERIES - 1) / ATT_QUERIES;
    const int64_t wr = dp_padded(r), w = wr + dp_padded(p);
    uint16_t *qb = (uint16_t *)calloc((size_t)(DP_GROUP * w), sizeof(uint16_t));
    float *o = (float *)calloc((size_t)(DP_GROUP * wr + r + p), sizeof(float)), *q32 = o + DP_GROUP * wr;
    float sc[DP_GROUP * ATT_TILE], mx[DP_GROUP], sum[DP_GROUP];
    uint32_t pp[DP_GROUP * ATT_TILE / 2];
    const float *bias_row[DP_GROUP];
    for (int i = 0; i < mb; i++) {
        memset(q32, 0, (size_t)(r + p) * sizeof(float));
        att_query(a, b, m0 + i, q32, q32 + r);
        for (int64_t k = 0; k < r; k++) qb[i * w + k] = f32_to_bf16(q32[k]);
        for (int64_t k = 0; k < p; k++) qb[i * w + wr + k] = f32_to_bf16(q32[r + k]);
        bias_row[i] = a->bias ? a->bias + b * a->bias_bstride + ((m0 + i) / a->H) * S : NULL;
        mx[i] = -INFINITY, sum[i] = 0.0f;
    }
    const RowKeys keys = att_row_keys(a, b, 2);
    const char *kv_t[ATT_TILE], *pe_t[ATT_TILE];
    int64_t first, end;
    att_span(bias_row, mb, S, &first, &end);
    for (int64_t s0 = first; s0 < end; s0 += ATT_TILE) {
        const int64_t n = S - s0 < ATT_TILE ? S - s0 : ATT_TILE;
        att_keys(&keys, s0, n, kv_t, pe_t);
        att_prefetch_ahead(&keys, r, p, 2, s0, end);
        for (int64_t g = 0; g < quads; g++) {
            const int64_t i0 = g * ATT_QUERIES;
            dp_tile_scores(qb + i0 * w, w, wr, r, p, kv_t, pe_t, n, sc + i0 * ATT_TILE);
            for (int64_t i = i0; i < i0 + ATT_QUERIES; i++) {
                float *si = sc + i * ATT_TILE;
                if (i >= mb) { /* a padding query: weights 0 */
                    memset(pp + i * (ATT_TILE / 2), 0, sizeof(uint32_t) * (ATT_TILE / 2));
                    continue;
                }
                att_softmax_tile(si, bias_row[i], s0, n, mx + i, sum + i, o + i * wr, wr);
                dp_pairs(si, n, pp + i * (ATT_TILE / 2));
            }
            dp_values(o + i0 * wr, wr, pp + i0 * (ATT_TILE / 2), kv_t, n, r);
        }
    }
    for (int i = 0; i < mb; i++) {
        dp_unpermute(o + i * wr, r, q32);
        att_output(a, b, m0 + i, q32, sum[i]);
    }
    free(qb), free(o);
}

#define USE_BF16_DOTS(ckind, akind) ((ckind) == A_BF16 && (akind) == A_BF16 && dsv3_bf16_dots(-1))
#else
#define USE_BF16_DOTS(ckind, akind) 0
#define dp_task(a, b, m0, mb) ((void)0)
#endif

/* ---- The attention over an fp32 cache in AVX-512 FMAs ---------------------------------------------------
 * att_task's computation 16 lanes wide, where the CPU has AVX-512F (dsv3_int_avx512 turns it off, as it does
 * the GEMV's AVX-512 tiles, so both paths are tested on one machine). Two changes besides the width, both for
 * where a batch's cache comes from (its rows are megabytes each, read from L3 or memory, not from L1):
 * a task takes up to Z_GROUP queries (all 16 heads of a row at one token), so a row's cache is read once, not
 * once per 8 heads; and each tile's keys are scored 8 queries at a time (Z_QUERIES x Z_KEYS accumulators), so
 * each key vector loaded serves 8 queries, while the next tile's rows are fetched into L2 a few at a time
 * between the score steps (att_task fetches two tiles ahead at once, more than L1 holds at this width).
 * A score is one 16-lane chain over the kv then the pe columns (masked past a multiple of 16: no scalar tail),
 * folded onto 8 lanes and summed as dp_task's: another order than the AVX2 chains', so the paths differ in the
 * last bits of a score, as dp_task's does. The outputs take att_values' products in its order, lane by lane.
 * A query's arithmetic does not depend on the queries beside it, so the thread count changes no bit. */
#define Z_QUERIES 8 /* queries per micro-kernel: Z_QUERIES x Z_KEYS accumulators, Z_KEYS rows and a query vector */
#define Z_KEYS 3
#define Z_GROUP 16 /* queries per task while the tasks still cover the threads */

/* The first n (of 16) lanes; none for n <= 0. */
static inline __attribute__((always_inline)) __mmask16 z_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* acc[i][u] += q_i . k_u over n fp32 values: q [Z_QUERIES, ldq] zero-padded to a multiple of 16; the rows
 * k[u] read with masks, so nothing past their n values. */
static inline __attribute__((always_inline)) ZMM_TARGET void z_dots(const float *q, int64_t ldq,
                                                                    const float *const *k, int64_t n,
                                                                    __m512 acc[Z_QUERIES][Z_KEYS]) {
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = z_mask(n - c);
        __m512 kv[Z_KEYS];
        for (int u = 0; u < Z_KEYS; u++) kv[u] = _mm512_maskz_loadu_ps(m, k[u] + c);
        for (int i = 0; i < Z_QUERIES; i++) {
            __m512 qi = _mm512_loadu_ps(q + i * ldq + c);
            __asm__("" : "+v"(qi)); /* one load per query vector, not one folded into each FMA */
            for (int u = 0; u < Z_KEYS; u++) acc[i][u] = _mm512_fmadd_ps(qi, kv[u], acc[i][u]);
        }
    }
}

/* Rows [0, n) of the next tile (kv rows of r values, pe rows of p; fp32) into L2, rows [j, j + Z_KEYS) of it. */
static inline __attribute__((always_inline)) void z_fetch(const char *const *kv, const char *const *pe, int64_t n,
                                                          int64_t j, int64_t r, int64_t p) {
    for (int64_t u = j; u < j + Z_KEYS && u < n; u++) {
        for (int64_t b = 0; b < r * 4; b += 64) _mm_prefetch(kv[u] + b, _MM_HINT_T1);
        for (int64_t b = 0; b < p * 4; b += 64) _mm_prefetch(pe[u] + b, _MM_HINT_T1);
    }
}

/* att_tile_scores for an fp32 cache: queries q [Z_QUERIES, w] (the kv part padded to wr, then the pe part);
 * the next tile's nn rows (next_kv, next_pe) fetched meanwhile. */
static inline __attribute__((always_inline)) ZMM_TARGET void z_tile_scores(
    const float *q, int64_t w, int64_t wr, int64_t r, int64_t p, const char *const *kv, const char *const *pe,
    int64_t n, float *sc, const char *const *next_kv, const char *const *next_pe, int64_t nn) {
    for (int64_t j = 0; j < n; j += Z_KEYS) {
        const float *kr[Z_KEYS], *pr[Z_KEYS];
        for (int u = 0; u < Z_KEYS; u++) {
            const int64_t ju = j + u < n ? j + u : n - 1;
            kr[u] = (const float *)kv[ju], pr[u] = (const float *)pe[ju];
        }
        __m512 acc[Z_QUERIES][Z_KEYS];
        for (int i = 0; i < Z_QUERIES; i++)
            for (int u = 0; u < Z_KEYS; u++) acc[i][u] = _mm512_setzero_ps();
        if (pf_cursor.r) pf_step(PF_LINES_PER_STEP);
        z_fetch(next_kv, next_pe, nn, j, r, p);
        z_dots(q, w, kr, r, acc);
        z_dots(q + wr, w, pr, p, acc);
        for (int u = 0; u < Z_KEYS && j + u < n; u++)
            for (int i0 = 0; i0 < Z_QUERIES; i0 += 4) {
                float d[4];
                _mm_storeu_ps(d, hsum4_512(acc[i0][u], acc[i0 + 1][u], acc[i0 + 2][u], acc[i0 + 3][u]));
                for (int i = 0; i < 4; i++) sc[(i0 + i) * ATT_TILE + j + u] = d[i];
            }
    }
}

/* att_values for fp32 rows, 32 channels a pass: o [Z_QUERIES, w] += p [Z_QUERIES, ATT_TILE] x rows. */
static inline __attribute__((always_inline)) ZMM_TARGET void z_values(float *o, int64_t w, const float *p,
                                                                      const char *const *rows, int64_t n,
                                                                      int64_t r) {
    for (int64_t c = 0; c < r; c += 32) {
        const __mmask16 m0 = z_mask(r - c), m1 = z_mask(r - c - 16);
        __m512 lo[Z_QUERIES], hi[Z_QUERIES];
        for (int i = 0; i < Z_QUERIES; i++)
            lo[i] = _mm512_maskz_loadu_ps(m0, o + i * w + c), hi[i] = _mm512_maskz_loadu_ps(m1, o + i * w + c + 16);
        for (int64_t j = 0; j < n; j++) {
            const float *rj = (const float *)rows[j] + c;
            const __m512 x0 = _mm512_maskz_loadu_ps(m0, rj), x1 = _mm512_maskz_loadu_ps(m1, rj + 16);
            for (int i = 0; i < Z_QUERIES; i++) {
                const __m512 pw = _mm512_set1_ps(p[i * ATT_TILE + j]);
                lo[i] = _mm512_fmadd_ps(pw, x0, lo[i]);
                hi[i] = _mm512_fmadd_ps(pw, x1, hi[i]);
            }
        }
        for (int i = 0; i < Z_QUERIES; i++)
            _mm512_mask_storeu_ps(o + i * w + c, m0, lo[i]), _mm512_mask_storeu_ps(o + i * w + c + 16, m1, hi[i]);
    }
}

/* att_task for an fp32 cache in AVX-512 FMAs: queries [m0, m0 + mb) of batch row b (mb <= Z_GROUP). buf:
 * ATT_FLOATS(r, p) floats, the queries [Z_GROUP, w] then the outputs [Z_GROUP, wr] (zeroed here). */
static ZMM_TARGET void z_task(const AttArgs *a, int64_t b, int64_t m0, int mb, float *buf) {
    const int64_t r = a->r, p = a->p, S = a->S, groups = (mb + Z_QUERIES - 1) / Z_QUERIES;
    const int64_t wr = Z_PAD(r), w = wr + Z_PAD(p);
    float *q = buf, *o = buf + Z_GROUP * w;
    memset(buf, 0, (size_t)(Z_GROUP * (w + wr)) * sizeof(float));
    float sc[Z_GROUP * ATT_TILE], mx[Z_GROUP], sum[Z_GROUP];
    const float *bias_row[Z_GROUP];
    for (int i = 0; i < mb; i++) {
        att_query(a, b, m0 + i, q + i * w, q + i * w + wr);
        bias_row[i] = a->bias ? a->bias + b * a->bias_bstride + ((m0 + i) / a->H) * S : NULL;
        mx[i] = -INFINITY, sum[i] = 0.0f;
    }
    const RowKeys keys = att_row_keys(a, b, 4);
    const char *kv_t[ATT_TILE], *pe_t[ATT_TILE], *next_kv[ATT_TILE], *next_pe[ATT_TILE];
    int64_t first, end;
    att_span(bias_row, mb, S, &first, &end);
    for (int64_t s0 = first; s0 < end; s0 += ATT_TILE) {
        const int64_t n = S - s0 < ATT_TILE ? S - s0 : ATT_TILE;
        const int64_t after = end - s0 - ATT_TILE, nn = after <= 0 ? 0 : after < ATT_TILE ? after : ATT_TILE;
        att_keys(&keys, s0, n, kv_t, pe_t);
        if (nn) att_keys(&keys, s0 + ATT_TILE, nn, next_kv, next_pe);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t i0 = g * Z_QUERIES;
            z_tile_scores(q + i0 * w, w, wr, r, p, kv_t, pe_t, n, sc + i0 * ATT_TILE, next_kv, next_pe,
                          g == 0 ? nn : 0);
            for (int64_t i = i0; i < i0 + Z_QUERIES; i++) {
                float *si = sc + i * ATT_TILE;
                if (i >= mb) { /* a padding query: weights 0 */
                    memset(si, 0, (size_t)n * sizeof(float));
                    continue;
                }
                att_softmax_tile(si, bias_row[i], s0, n, mx + i, sum + i, o + i * wr, r);
            }
            z_values(o + i0 * wr, wr, sc + i0 * ATT_TILE, kv_t, n, r);
        }
    }
    for (int i = 0; i < mb; i++) att_output(a, b, m0 + i, o + i * wr, sum[i]);
}

/* ---- The attention over a bf16 cache in AMX tiles ---------------------------------------------------------
 * Intel's AMX (Sapphire Rapids on) multiplies 16 x 32 bf16 tiles into 16 x 16 fp32 sums in one instruction
 * (TDPBF16PS): 8,192 multiply-adds, where VDPBF16PS does 32 (and on those CPUs issues at a quarter of the
 * FMA rate, see gemv_dots). With the dot products on and AMX usable (the CPU has AMX-BF16, the kernel lets
 * the process use its tile registers: dsv3_amx), a bf16 model's attention over a bf16 cache runs here, with
 * dp_task's roundings (queries and each tile's softmax weights in bf16, every product exact, every sum fp32),
 * up to 16 queries a task, 128 keys a block (its softmax step), 32 keys a tile:
 *
 *   scores^T [32 keys, 16 queries] = K [32 keys, W] x Q^T (the tile's keys copied into one block, so a
 *   paged cache reads as a plain one; Q^T made once a task in the pairs-of-rows order AMX takes its right
 *   operand in), transposed in registers to one row a query, softmax online as att_task's, then
 *   o [16 queries, r] += P [16, 32 keys] x V (V's rows paired as dp_values pairs them, so o comes in its
 *   order: dp_unpermute).
 *
 * A row's keys are cut into segments of 512 slots, a task each (so that the threads share even one row of 16
 * heads), whose running maxima, sums and outputs are merged per query in segment order (amx_attention).
 * A query's scores and outputs are sums over the same products in the same order whatever the other queries
 * of its task (blocks start at multiples of 128 slots and segments at multiples of 512, not at the task's
 * first visible one), so the thread count still changes no bit. */

#if DP_COMPILER && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#define AMX_COMPILER 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AMX_Q 16    /* queries per task: a tile's rows */
#define AMX_KEYS 128 /* keys per tile: four TDPBF16PS depths in bf16 (amx_values) */
#define AMX_SEG 512  /* keys per segment: a task's share of a row's keys (amx_attention) */

/* Whether this CPU and kernel let the process use AMX-BF16: CPUID, the OS's saved state (XCR0's tile bits),
 * and the kernel's permission for the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 on). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

static int amx_can = -1, amx_on = 1;

/* Whether the attention takes AMX tiles where the bf16 dot products are on: want 0 turns them off, 1 on where
 * the CPU and kernel allow, -1 asks. Returns the state. */
int dsv3_amx(int want) {
    if (amx_can < 0) {
        __builtin_cpu_init();
        amx_can = __builtin_cpu_supports("avx512bf16") && amx_usable();
    }
    if (want >= 0) amx_on = want != 0;
    return amx_can && amx_on;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* Tiles 0-1: two halves of a tile's scores^T; 2: keys; 3: Q^T; 4: outputs; 5: softmax weights; 6: values.
 * All 16 rows of 64 bytes. */
static AMX_TARGET void amx_configure(void) {
    AmxConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* ---- bf16 GEMVs in AMX tiles ------------------------------------------------------------------------------
 * y [M, N] = x [M, K] @ W^T as C^T = W x^T: a tile of 16 weight rows by 32 columns, loaded straight from the
 * matrix (A), times 16 activation rows laid out in channel pairs (B, amx_rows_vnni), into a 16 x 16 fp32 tile
 * per 16 activation rows. Every product is exact and every sum fp32, as in the dot products; each output is
 * its own row's chain over K in the same order whatever the other rows of the call, so a row computed with
 * 63 others has the bits it has alone. One TDPBF16PS per KB of weights (16 x 16 x 32 products) keeps far ahead
 * of what DRAM delivers, so one row costs what the memory does and 16 rows nearly the same: the FMAs'
 * micro-tiles were compute-bound there from a few rows (gemv_dots; decode_kernels_speed.py --baseline-rev). */
#define AMX_GEMV_BLOCKS 4 /* 16-row blocks of activations per pass over a weight tile: accumulator tiles 0-3 */

static int use_amx_gemv(int kind, int xkind, int64_t N, int64_t K) {
    return kind == W_BF16 && xkind == A_BF16 && K % 32 == 0 && N >= 16 && dsv3_amx(-1) && dsv3_bf16_dots(-1);
}

/* The rows [n0, n1) of y (ldy apart) for weights w [N, K] (N >= 16, K a multiple of 32) and x's B tiles xt.
 * A tile of 16 weight rows that would pass N starts at N - 16 instead (its rows before n0 are not written).
 * While a weight tile is read, the next one's bytes are prefetched, and at the last tile as many bytes from
 * next on (where this thread reads after the call; NULL: none). */
static AMX_TARGET void amx_gemv_rows(const uint16_t *w, int64_t N, int64_t K, const uint32_t *xt, int64_t M,
                                     float *y, int64_t ldy, int64_t n0, int64_t n1, const char *next) {
    if (n1 <= n0 || M <= 0) return;
    const int64_t kc = K / 32, blocks = (M + 15) / 16, row_bytes = K * 2;
    float c[16 * 16];
    amx_configure();
    for (int64_t n = n0; n < n1; n += 16) {
        const int64_t base = n + 16 <= N ? n : N - 16;
        const char *wt = (const char *)(w + base * K);
        const char *pf = n + 16 < n1 ? wt + 16 * row_bytes : next;
        for (int64_t b0 = 0; b0 < blocks; b0 += AMX_GEMV_BLOCKS) {
            const int nb = blocks - b0 < AMX_GEMV_BLOCKS ? (int)(blocks - b0) : AMX_GEMV_BLOCKS;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < kc; k++) {
                if (pf && b0 == 0) /* the next tile's (or next's) bytes into L2, 16 lines a step: all of them over the
                                    * tile (into L1 they took 1.04-1.18x the time: decode_kernels_speed.py --baseline) */
                    for (int l = 0; l < 16; l++) _mm_prefetch(pf + (k * 16 + l) * 64, _MM_HINT_T1);
                _tile_loadd(4, wt + k * 64, row_bytes);
                const uint32_t *bt = xt + (b0 * kc + k) * 256;
                _tile_loadd(5, bt, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nb > 1) {
                    _tile_loadd(5, bt + kc * 256, 64);
                    _tile_dpbf16ps(1, 4, 5);
                }
                if (nb > 2) {
                    _tile_loadd(5, bt + 2 * kc * 256, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (nb > 3) {
                    _tile_loadd(5, bt + 3 * kc * 256, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            for (int i = 0; i < nb; i++) {
                if (i == 0) _tile_stored(0, c, 64);
                if (i == 1) _tile_stored(1, c, 64);
                if (i == 2) _tile_stored(2, c, 64);
                if (i == 3) _tile_stored(3, c, 64);
                const int64_t m0 = (b0 + i) * 16, mr = M - m0 < 16 ? M - m0 : 16;
                for (int64_t r = n - base; r < 16 && base + r < n1; r++)
                    for (int64_t m = 0; m < mr; m++) y[(m0 + m) * ldy + base + r] = c[r * 16 + m];
            }
        }
    }
    _tile_release();
}

/* out [16, ldo] (its columns [0, 16)) = in [16, ldi]^T (its columns [0, 16)), in registers; only moved, so any
 * 32-bit words go through (bf16 pairs too). */
static inline __attribute__((always_inline)) AMX_TARGET void transpose16(const float *in, int64_t ldi, float *out,
                                                                        int64_t ldo) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(in + ldi * i);
    for (int i = 0; i < 8; i++)
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 4; i++) { /* u[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d)), r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int k = 0; k < 4; k++) {
        const __m512 x0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), x1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
        const __m512 y0 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44), y1 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
        _mm512_storeu_ps(out + (0 + k) * ldo, _mm512_shuffle_f32x4(x0, y0, 0x88));
        _mm512_storeu_ps(out + (4 + k) * ldo, _mm512_shuffle_f32x4(x0, y0, 0xDD));
        _mm512_storeu_ps(out + (8 + k) * ldo, _mm512_shuffle_f32x4(x1, y1, 0x88));
        _mm512_storeu_ps(out + (12 + k) * ldo, _mm512_shuffle_f32x4(x1, y1, 0xDD));
    }
}

/* x [M, K] bf16 as B tiles (amx_rows_at), rows past M zero: each tile the transpose of 16 rows' 16 channel
 * pairs (a pair of bf16 values is one 32-bit word). */
static AMX_TARGET uint32_t *amx_rows_vnni(const uint16_t *x, int64_t M, int64_t K) {
    const int64_t kc = K / 32;
    uint32_t *xt = (uint32_t *)malloc((size_t)((M + 15) / 16 * kc * 256 + 1) * sizeof(uint32_t));
    float rows[16 * 16]; /* a block of fewer than 16 rows, zero-padded */
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int64_t mr = M - m0 < 16 ? M - m0 : 16;
        for (int64_t c = 0; c < kc; c++) {
            const float *in = (const float *)(x + m0 * K + c * 32);
            float *tile = (float *)(xt + ((m0 / 16) * kc + c) * 256);
            if (mr == 16) {
                transpose16(in, K / 2, tile, 16);
                continue;
            }
            memset(rows, 0, sizeof(rows));
            for (int64_t i = 0; i < mr; i++) memcpy(rows + 16 * i, in + i * (K / 2), 64);
            transpose16(rows, 16, tile, 16);
        }
    }
    return xt;
}

/* A segment task's scratch in bytes: keys copied, scores^T and scores, softmax weights, paired values, one
 * query in fp32 and a row of zeros. */
static size_t amx_scratch_bytes(int64_t r, int64_t p) {
    const int64_t wr = dp_padded(r), W = wr + dp_padded(p);
    return (size_t)(AMX_KEYS * W * 2 + 2 * AMX_Q * AMX_KEYS * 4 + AMX_Q * AMX_KEYS * 2 + AMX_KEYS / 2 * wr * 4
                    + (r + p) * 4 + W * 2) + 64;
}

/* Q^T of a query group for the tiles: [W / 32][16 pairs][AMX_Q queries] uint32, and one segment's result:
 * each query's running max and sum, then its outputs [AMX_Q][wr] (dp_values' order, not yet divided). */
static size_t amx_qt_words(int64_t W) { return (size_t)(W / 2 * AMX_Q); }
static size_t amx_part_floats(int64_t wr) { return (size_t)(2 * AMX_Q + AMX_Q * wr); }

/* Where 16 keys' rows are for a tile load: kv at kv, pe at pe, rows kv_ld / pe_ld bytes apart. */
typedef struct { const char *kv, *pe; int64_t kv_ld, pe_ld; } AmxRows;

/* n bf16 values from src to dst, the rest of [0, n32) zeros (n32 a multiple of 32). */
static inline __attribute__((always_inline)) AMX_TARGET void amx_copy(uint16_t *dst, const void *src, int64_t n,
                                                                     int64_t n32) {
    for (int64_t c = 0; c < n32; c += 32)
        _mm512_storeu_si512((void *)(dst + c), _mm512_maskz_loadu_epi16(dp_mask(n - c), (const uint16_t *)src + c));
}

/* Keys [j, j + 16) of a tile where the AMX loads read them: in place when they lie evenly spaced (a plain cache,
 * or 16 slots of one page) and their rows are whole 32-value chunks, else copied into keys [16][W]. */
static AMX_TARGET AmxRows amx_rows(const char *const *kv_t, const char *const *pe_t, int64_t r, int64_t p,
                                   int64_t W, uint16_t *keys) {
    const int64_t kv_ld = kv_t[1] - kv_t[0], pe_ld = pe_t[1] - pe_t[0];
    int even = r % 32 == 0 && p % 32 == 0 && kv_ld > 0 && pe_ld > 0;
    for (int i = 2; even && i < 16; i++) even = kv_t[i] - kv_t[0] == i * kv_ld && pe_t[i] - pe_t[0] == i * pe_ld;
    if (even) return (AmxRows){kv_t[0], pe_t[0], kv_ld, pe_ld};
    const int64_t wr = dp_padded(r);
    for (int i = 0; i < 16; i++) {
        amx_copy(keys + i * W, kv_t[i], r, wr);
        amx_copy(keys + i * W + wr, pe_t[i], p, W - wr);
    }
    return (AmxRows){(const char *)keys, (const char *)(keys + wr), W * 2, W * 2};
}

/* scores^T of 32 keys, a and b their two halves: st [32 keys][16 queries]. */
static inline __attribute__((always_inline)) AMX_TARGET void amx_scores(const uint32_t *qt, AmxRows a, AmxRows b,
                                                                       int64_t wr, int64_t W, float *st) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < W / 32; c++) {
        const int kvc = c * 32 < wr;
        const int64_t off = kvc ? c * 64 : (c * 32 - wr) * 2;
        _tile_loadd(3, qt + c * 256, 64);
        _tile_loadd(2, (kvc ? a.kv : a.pe) + off, kvc ? a.kv_ld : a.pe_ld);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(2, (kvc ? b.kv : b.pe) + off, kvc ? b.kv_ld : b.pe_ld);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, st, 64);
    _tile_stored(1, st + 16 * AMX_Q, 64);
}

/* o [16, wr] += P [16, 128 keys] x V [128 keys, wr]: the weights in tiles 5, 2, 0, 1 (32 keys each), each
 * 16-channel block of o loaded once, the values' pairs of the four key groups through tiles 6 and 3. */
static inline __attribute__((always_inline)) AMX_TARGET void amx_values(const uint16_t *pw, const uint32_t *vp,
                                                                       int64_t wr, float *o) {
    const int64_t set = wr * 16; /* uint32 per key group's pairs */
    _tile_loadd(5, pw, AMX_KEYS * 2);
    _tile_loadd(2, pw + 32, AMX_KEYS * 2);
    _tile_loadd(0, pw + 64, AMX_KEYS * 2);
    _tile_loadd(1, pw + 96, AMX_KEYS * 2);
    for (int64_t c = 0; c < wr / 16; c++) {
        _tile_loadd(4, o + c * 16, wr * 4);
        _tile_loadd(6, vp + c * 256, 64);
        _tile_dpbf16ps(4, 5, 6);
        _tile_loadd(3, vp + set + c * 256, 64);
        _tile_dpbf16ps(4, 2, 3);
        _tile_loadd(6, vp + 2 * set + c * 256, 64);
        _tile_dpbf16ps(4, 0, 6);
        _tile_loadd(3, vp + 3 * set + c * 256, 64);
        _tile_dpbf16ps(4, 1, 3);
        _tile_stored(4, o + c * 16, wr * 4);
    }
}

/* The values' rows of 32 keys in pairs, as dp_values pairs them: vp [wr / 16][16 pairs][16 channels]. */
static inline __attribute__((always_inline)) AMX_TARGET void amx_pair_values(const char *const *kv_t, int64_t r,
                                                                            int64_t wr, uint32_t *vp) {
    for (int k = 0; k < 16; k++)
        for (int64_t c = 0; c < wr; c += 32) {
            const __mmask32 m = dp_mask(r - c);
            const __m512i x = _mm512_maskz_loadu_epi16(m, (const uint16_t *)kv_t[2 * k] + c);
            const __m512i y = _mm512_maskz_loadu_epi16(m, (const uint16_t *)kv_t[2 * k + 1] + c);
            uint32_t *dst = vp + (c / 16) * 256 + k * 16;
            _mm512_storeu_si512((void *)dst, _mm512_unpacklo_epi16(x, y));
            _mm512_storeu_si512((void *)(dst + 256), _mm512_unpackhi_epi16(x, y));
        }
}

/* Query m of batch row b as column i of its group's Q^T (qt, zeroed where no query is): [q_lat, 0 .. | q_pe,
 * 0 ..] in bf16 pairs of channels. q32: r + p floats of scratch. */
static AMX_TARGET void amx_query(const AttArgs *a, int64_t b, int64_t m, int i, uint32_t *qt, float *q32) {
    const int64_t r = a->r, p = a->p, wr = dp_padded(r), W = wr + dp_padded(p);
    memset(q32, 0, (size_t)(r + p) * sizeof(float));
    att_query(a, b, m, q32, q32 + r);
    for (int64_t k = 0; k < W / 2; k++) { /* channel pair (2k, 2k + 1) */
        uint16_t v[2];
        for (int e = 0; e < 2; e++) {
            const int64_t c = 2 * k + e;
            const float x = c < wr ? (c < r ? q32[c] : 0.0f) : (c - wr < p ? q32[r + c - wr] : 0.0f);
            v[e] = f32_to_bf16(x);
        }
        qt[(k / 16) * 256 + (k % 16) * AMX_Q + i] = (uint32_t)v[0] | (uint32_t)v[1] << 16;
    }
}

/* dp_task in AMX tiles over one segment of the keys, [seg0, seg1): queries [m0, m0 + mb) of batch row b
 * (mb <= AMX_Q, their Q^T in qt), AMX_KEYS keys a block, each 16-channel block of the outputs loaded and stored
 * once a tile; the segment's running max, sum and outputs go to part (amx_part_floats); scratch:
 * amx_scratch_bytes. */
static AMX_TARGET void amx_segment(const AttArgs *a, int64_t b, int64_t m0, int mb, const uint32_t *qt,
                                   int64_t seg0, int64_t seg1, char *scratch, float *part) {
    const int64_t r = a->r, p = a->p, S = a->S, wr = dp_padded(r), W = wr + dp_padded(p);
    uint16_t *keys = (uint16_t *)scratch;                /* [AMX_KEYS][W]: keys copied (amx_rows) */
    float *st = (float *)(keys + AMX_KEYS * W);          /* [AMX_KEYS][16 queries] */
    float *sc = st + AMX_KEYS * AMX_Q;                   /* [16 queries][AMX_KEYS] */
    uint16_t *pw = (uint16_t *)(sc + AMX_Q * AMX_KEYS);  /* [16 queries][AMX_KEYS] bf16 */
    uint32_t *vp = (uint32_t *)(pw + AMX_Q * AMX_KEYS);  /* [AMX_KEYS / 32][wr / 16][16 pairs][16 channels] */
    float *q32 = (float *)(vp + AMX_KEYS / 2 * wr);      /* [r + p] */
    const char *zeros = (const char *)(q32 + r + p);     /* [W] bf16: the keys past a tile's end */
    float *mx = part, *sum = part + AMX_Q, *o = part + 2 * AMX_Q; /* o [16 queries][wr], dp_values' order */
    memset(pw, 0, (size_t)(AMX_Q * AMX_KEYS * 2 + AMX_KEYS / 2 * wr * 4)); /* and vp: finite where unwritten */
    memset(q32, 0, (size_t)((r + p) * 4 + W * 2));
    memset(o, 0, (size_t)(AMX_Q * wr) * sizeof(float));
    const float *bias_row[AMX_Q];
    for (int i = 0; i < AMX_Q; i++) mx[i] = -INFINITY, sum[i] = 0.0f;
    for (int i = 0; i < mb; i++) bias_row[i] = a->bias ? a->bias + b * a->bias_bstride + ((m0 + i) / a->H) * S : NULL;
    int64_t first, end;
    att_span(bias_row, mb, S, &first, &end);
    first = first > seg0 ? first : seg0, end = end < seg1 ? end : seg1;
    if (first >= end) return; /* no key of the segment is seen: max -inf, sum 0 */
    const RowKeys rk = att_row_keys(a, b, 2);
    const char *kv_t[AMX_KEYS], *pe_t[AMX_KEYS];
    amx_configure();
    /* blocks at whole multiples of AMX_KEYS, whatever the task's first slot, so that a key meets the same
     * tiles, pairs and softmax blocks whichever queries share its task (the thread count groups them) */
    for (int64_t s0 = first / AMX_KEYS * AMX_KEYS; s0 < end; s0 += AMX_KEYS) {
        const int64_t n = end - s0 < AMX_KEYS ? end - s0 : AMX_KEYS;
        const int64_t lead = first > s0 ? first - s0 : 0; /* slots before the task's first: never read */
        att_keys(&rk, s0 + lead, n - lead, kv_t + lead, pe_t + lead);
        for (int64_t j = 0; j < lead; j++) kv_t[j] = pe_t[j] = zeros;
        for (int64_t j = n; j < AMX_KEYS; j++) kv_t[j] = pe_t[j] = zeros; /* weighted 0, and finite */
        for (int64_t h = 0; h < AMX_KEYS / ATT_TILE; h++)
            att_prefetch_ahead(&rk, r, p, 2, s0 + AMX_KEYS - ATT_PF * ATT_TILE + h * ATT_TILE, end);
        for (int64_t h = 0; h < AMX_KEYS / 32 && 32 * h < n; h++) {
            const AmxRows lo = amx_rows(kv_t + 32 * h, pe_t + 32 * h, r, p, W, keys + 32 * h * W);
            const AmxRows hi = amx_rows(kv_t + 32 * h + 16, pe_t + 32 * h + 16, r, p, W, keys + (32 * h + 16) * W);
            amx_scores(qt, lo, hi, wr, W, st + h * 32 * AMX_Q);
            transpose16(st + h * 32 * AMX_Q, 16, sc + h * 32, AMX_KEYS);
            transpose16(st + h * 32 * AMX_Q + 16 * AMX_Q, 16, sc + h * 32 + 16, AMX_KEYS);
            amx_pair_values(kv_t + 32 * h, r, wr, vp + h * wr * 16);
        }
        for (int i = 0; i < mb; i++) {
            float *si = sc + i * AMX_KEYS;
            for (int64_t j = 0; j < lead; j++) si[j] = -INFINITY; /* masked for every query of the task */
            att_softmax_tile(si, bias_row[i], s0, n, mx + i, sum + i, o + i * wr, wr);
            for (int64_t h = 0; h < AMX_KEYS / 32; h++) {
                const int64_t nh = n - 32 * h;
                dp_pairs(si + 32 * h, nh < 0 ? 0 : nh > 32 ? 32 : nh, (uint32_t *)(pw + i * AMX_KEYS + 32 * h));
            }
        }
        amx_values(pw, vp, wr, o);
    }
    _tile_release();
}

/* Query i of a group: its segments' results (parts, nseg of them, amx_part_floats apart) merged in segment
 * order, the running maxima brought to the largest (a segment with none seen adds nothing; with one segment
 * the outputs and sum are that segment's, to the bit), then W_UV and the division (att_output). o: wr floats
 * of scratch, q32: r. */
static void amx_merge(const AttArgs *a, int64_t b, int64_t m, int i, const float *parts, int64_t nseg,
                      float *o, float *q32) {
    const int64_t wr = dp_padded(a->r);
    const size_t stride = amx_part_floats(wr);
    float top = -INFINITY, sum = 0.0f;
    for (int64_t g = 0; g < nseg; g++) top = parts[g * stride + i] > top ? parts[g * stride + i] : top;
    memset(o, 0, (size_t)wr * sizeof(float));
    for (int64_t g = 0; top != -INFINITY && g < nseg; g++) {
        const float *part = parts + g * stride, mx = part[i];
        if (mx == -INFINITY) continue;
        const float f = expf(mx - top), *og = part + 2 * AMX_Q + i * wr;
        sum += part[AMX_Q + i] * f;
        for (int64_t k = 0; k < wr; k++) o[k] += og[k] * f;
    }
    dp_unpermute(o, a->r, q32);
    att_output(a, b, m, q32, sum);
}

/* amx_attention for a cache of one segment: each task prepares its group's queries, attends and finishes
 * them (the same functions, so the same bits as through the shared buffers, without their two barriers). */
static int amx_attention_whole(const AttArgs *a, int64_t B, int64_t M, int64_t group, int nthreads) {
    const int64_t r = a->r, p = a->p, wr = dp_padded(r), W = wr + dp_padded(p), mblocks = (M + group - 1) / group;
#pragma omp parallel num_threads(nthreads)
    {
        char *tiles = (char *)malloc(amx_scratch_bytes(r, p));
        float *o = (float *)malloc((size_t)(wr + r + p) * sizeof(float));
        float *part = (float *)malloc(amx_part_floats(wr) * sizeof(float));
        uint32_t *qt = (uint32_t *)malloc(amx_qt_words(W) * sizeof(uint32_t));
        pf_start(a->pf, omp_get_thread_num(), omp_get_num_threads());
#pragma omp for schedule(static)
        for (int64_t g = 0; g < B * mblocks; g++) {
            const int64_t b = g / mblocks, m0 = (g % mblocks) * group;
            const int mb = M - m0 < group ? (int)(M - m0) : (int)group;
            memset(qt, 0, amx_qt_words(W) * sizeof(uint32_t));
            for (int i = 0; i < mb; i++) amx_query(a, b, m0 + i, i, qt, o);
            amx_segment(a, b, m0, mb, qt, 0, a->S, tiles, part);
            for (int i = 0; i < mb; i++) amx_merge(a, b, m0 + i, i, part, 1, o, o + wr);
        }
        free(tiles), free(o), free(part), free(qt);
        pf_cursor.r = NULL;
    }
    return 0;
}

/* The attention in AMX tiles (mla_decode's path where they run): every row's keys cut into segments of
 * AMX_SEG slots at fixed places, each (row, query group, segment) a task, so that two threads share even one
 * row of 16 heads (a decode step at batch 1), then each query's segments merged. The segments depend on the
 * cache's length only, so the thread count and the rows beside a row change none of its bits. */
static int amx_attention(const AttArgs *a, int64_t B, int64_t M, int nthreads) {
    const int64_t r = a->r, p = a->p, wr = dp_padded(r), W = wr + dp_padded(p);
    const int64_t nseg = (a->S + AMX_SEG - 1) / AMX_SEG;
    int64_t group = B * ((M + AMX_Q - 1) / AMX_Q) * nseg >= nthreads ? AMX_Q : ATT_GROUP;
    if (B * ((M + group - 1) / group) * nseg < nthreads) group = ATT_QUERIES;
    const int64_t mblocks = (M + group - 1) / group, groups = B * mblocks;
    if (nseg == 1) return amx_attention_whole(a, B, M, group, nthreads);
    uint32_t *qts = (uint32_t *)calloc((size_t)groups * amx_qt_words(W), sizeof(uint32_t));
    float *parts = (float *)malloc((size_t)(groups * nseg) * amx_part_floats(wr) * sizeof(float));
    if (!qts || !parts) {
        free(qts), free(parts);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        char *tiles = (char *)malloc(amx_scratch_bytes(r, p));
        float *o = (float *)malloc((size_t)(wr + r + p) * sizeof(float));
        pf_start(a->pf, omp_get_thread_num(), omp_get_num_threads());
#pragma omp for schedule(static)
        for (int64_t q = 0; q < B * M; q++) { /* the queries, each into its group's Q^T */
            const int64_t b = q / M, m = q % M;
            amx_query(a, b, m, (int)(m % group), qts + (b * mblocks + m / group) * amx_qt_words(W), o);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < groups * nseg; task++) {
            const int64_t g = task / nseg, seg = task % nseg, b = g / mblocks, m0 = (g % mblocks) * group;
            const int mb = M - m0 < group ? (int)(M - m0) : (int)group;
            const int64_t seg0 = seg * AMX_SEG, seg1 = seg0 + AMX_SEG < a->S ? seg0 + AMX_SEG : a->S;
            amx_segment(a, b, m0, mb, qts + g * amx_qt_words(W), seg0, seg1, tiles,
                        parts + (size_t)task * amx_part_floats(wr));
        }
#pragma omp for schedule(static)
        for (int64_t q = 0; q < B * M; q++) {
            const int64_t b = q / M, m = q % M, g = b * mblocks + m / group;
            amx_merge(a, b, m, (int)(m % group), parts + (size_t)(g * nseg) * amx_part_floats(wr), nseg, o, o + wr);
        }
        free(tiles), free(o);
        pf_cursor.r = NULL;
    }
    free(qts), free(parts);
    return 0;
}
#define USE_AMX(dots) ((dots) && dsv3_amx(-1))
#else
static int use_amx_gemv(int kind, int xkind, int64_t N, int64_t K) {
    (void)kind, (void)xkind, (void)N, (void)K;
    return 0;
}
static uint32_t *amx_rows_vnni(const uint16_t *x, int64_t M, int64_t K) { (void)x, (void)M, (void)K; return NULL; }
static void amx_gemv_rows(const uint16_t *w, int64_t N, int64_t K, const uint32_t *xt, int64_t M, float *y,
                          int64_t ldy, int64_t n0, int64_t n1, const char *next) {
    (void)w, (void)N, (void)K, (void)xt, (void)M, (void)y, (void)ldy, (void)n0, (void)n1, (void)next;
}
int dsv3_amx(int want) { (void)want; return 0; }
#define USE_AMX(dots) 0
#define amx_attention(a, B, M, nthreads) (-1)
#endif

/* The absorbed MLA attention of a decode step from the query projection to the heads' outputs, for
 * B rows x T tokens x H heads (query m = t * H + h): q [B, T, H, nope + rope] (activation dtype) ->
 * q_lat = W_UK[h]^T q_nope, q_pe roped by cos/sin [B or 1, T, rope/2] (interleaved pairs), attention over
 * the latent cache (softmax of scale * (q_lat . kv + q_pe . pe) + bias), then out[b, t, h * v:(h + 1) * v] = W_UV[h] o_lat.
 * W_UK[h] is [nope, r] and W_UV[h] is [v, r], fp32 or bf16 (wkind: kv_b_proj's own bf16 weights are read
 * in place, converted exactly), at w + h * hstride elements, rows ``rstride`` apart.
 * out [B, T, H * v] in the activation dtype. The cache's keys [0, S) of row b are found through ``pages``
 * (PageMap: NULL table for the plain cache, row b then at kv + b * kv_bstride); a key a row does not hold
 * must have bias -inf (it is read, from the row's first held slot, and weighted 0). Returns 0.
 *
 * The attention is compute-bound (at context 2048 a layer's 8 queries take 2048 x (160 + 128) FMAs each,
 * against 0.6 MB of cache), so it is organised for the FMA units: each task takes up to ATT_GROUP queries
 * of one batch row (DP_GROUP in the dot products, Z_GROUP in 16-lane FMAs: a row's 16 heads read its cache
 * once, not twice; fewer, ATT_QUERIES, when that leaves a thread idle) and reads the cache once, in tiles
 * of ATT_TILE keys: a tile's scores four queries by a few keys at a time (ATT_KEYS, DP_KEYS in the dot
 * products; the scale folded into the queries), their exponentials against a running max (online softmax),
 * then the tile's rows weighted into the outputs while still in L1. From ABSORB_ROWS rows on, the queries'
 * W_UK absorption runs head by head before the tasks (att_absorb_queries). A query's arithmetic is the same
 * in every grouping, so the result does not depend on the thread count. An fp32 cache on an AVX-512 CPU takes z_task (16 lanes, up to 16
 * queries a task); a bf16 one the dot products (dp_task) or AMX tiles (amx_attention) where the CPU has them. */
static int mla_decode(const PfRanges *pf, const void *q, int akind, const float *cos, const float *sin, int64_t rot_bstride,
                    const void *w_uk, int64_t uk_hstride, int64_t uk_rstride, const void *w_uv, int64_t uv_hstride,
                    int64_t uv_rstride, int wkind, const void *kv, const void *pe, int ckind, int64_t B, int64_t T, int64_t H,
                    int64_t S, int64_t nope, int64_t p, int64_t r, int64_t v, int64_t kv_bstride, int64_t kv_sstride,
                    int64_t pe_bstride, int64_t pe_sstride, const PageMap *pages, const float *bias,
                    int64_t bias_bstride, float scale, void *out, int nthreads) {
    const AttArgs a = {q, kv, pe, cos, sin, bias, w_uk, w_uv, wkind, akind, rot_bstride, uk_hstride, uk_rstride,
                       uv_hstride, uv_rstride, T, H, S, nope, p, r, v, kv_bstride, kv_sstride, pe_bstride,
                       pe_sstride, bias_bstride, scale, out, pf, *pages};
    const int64_t M = T * H;
    const int dots = USE_BF16_DOTS(ckind, akind), wide = !dots && ckind == A_F32 && dsv3_int_avx512(-1);
    if (USE_AMX(dots) && amx_attention(&a, B, M, nthreads) == 0) return 0;
    int64_t group = B * ((M + ATT_GROUP - 1) / ATT_GROUP) >= nthreads ? ATT_GROUP : ATT_QUERIES;
    if (wide || dots) { /* the widest group that still gives every thread a task: a row's cache read as few times as that allows */
        const int64_t widest = wide ? Z_GROUP : DP_GROUP;
        group = B * ((M + widest - 1) / widest) >= nthreads ? widest : group;
    }
    const int64_t mblocks = (M + group - 1) / group;
    /* From ABSORB_ROWS rows on, every query's q_lat is computed head by head before the tasks (where there is
     * memory): the same numbers, W_UK read once for several rows. A single row gains nothing there and reads
     * W_UK across its rows rather than along them: a large bf16 step at batch 1 spent 0.3 ms more in its
     * attention that way, batch 16 0.6 ms less (decode_step_ab.py --phases, context 256). */
    AttArgs ab = a;
    float *qlat = B * T >= ABSORB_ROWS ? (float *)malloc((size_t)(B * M * r + 1) * sizeof(float)) : NULL;
    ab.qlat = qlat;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc((size_t)ATT_FLOATS(r, p) * sizeof(float));
        pf_start(pf, omp_get_thread_num(), omp_get_num_threads());
        if (qlat) att_absorb_queries(&ab, B, qlat); /* a worksharing loop: its barrier orders it before the tasks */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * mblocks; task++) {
            const int64_t b = task / mblocks, m0 = (task % mblocks) * group;
            const int mb = M - m0 < group ? (int)(M - m0) : (int)group;
            if (dots) dp_task(&ab, b, m0, mb);
            else if (wide) z_task(&ab, b, m0, mb, buf);
            else if (ckind == A_F32) att_task(A_F32, &ab, b, m0, mb, buf);
            else att_task(A_BF16, &ab, b, m0, mb, buf);
        }
        free(buf);
        pf_cursor.r = NULL;
    }
    free(qlat);
    return 0;
}

/* mla_decode, its cache seen through a PageMap: table [B, table_cols] (rows table_stride apart) of n_pages
 * pages kv_bstride / pe_bstride elements apart, page_tokens slots each, shift [B] or NULL; table NULL: the
 * plain cache. */
int dsv3_mla_decode(const void *q, int akind, const float *cos, const float *sin, int64_t rot_bstride,
                    const void *w_uk, int64_t uk_hstride, int64_t uk_rstride, const void *w_uv, int64_t uv_hstride,
                    int64_t uv_rstride, int wkind, const void *kv, const void *pe, int ckind, int64_t B, int64_t T, int64_t H,
                    int64_t S, int64_t nope, int64_t p, int64_t r, int64_t v, int64_t kv_bstride, int64_t kv_sstride,
                    int64_t pe_bstride, int64_t pe_sstride, const int32_t *table, int64_t table_stride,
                    int64_t table_cols, const int64_t *shift, int64_t page_tokens, int64_t n_pages,
                    const float *bias, int64_t bias_bstride, float scale, void *out, int nthreads) {
    const PageMap pages = {table, table_stride, table_cols, shift, page_tokens, n_pages};
    return mla_decode(NULL, q, akind, cos, sin, rot_bstride, w_uk, uk_hstride, uk_rstride, w_uv, uv_hstride, uv_rstride,
                      wkind, kv, pe, ckind, B, T, H, S, nope, p, r, v, kv_bstride, kv_sstride, pe_bstride, pe_sstride,
                      &pages, bias, bias_bstride, scale, out, nthreads);
}

/* ---- A whole transformer block's decode step in one call ----------------------------------------------
 * What FastDecode's per-op path does for one block (decode.py, BlockPlan), with the same roundings: every
 * activation between two steps is stored in the activation dtype (fp32 or bf16) exactly where the per-op
 * path stores a tensor, so the two agree to fp32 rounding in fp32 and within bf16 rounding in bf16. The
 * heavy parts are the exported kernels above (dsv3_linear, dsv3_route, dsv3_swiglu_experts,
 * dsv3_mla_decode); this part adds the glue that used to be 30-40 PyTorch calls per block: the RMSNorms,
 * RoPE of the shared key, the latent cache write and the residual adds. The helpers here are the block's
 * own (prefixed blk_) so that the GEMV code above can change freely. */


typedef struct { /* stacked SwiGLU experts: gate, up [E, inter, dim], down [E, dim, inter] */
    const void *gate, *up, *down;
    const void *gate_scale, *up_scale, *down_scale; /* FP8 blocks x 256, integer groups' fp16, or NULL */
    int64_t kind, n_experts, inter, dim;
} BlkExperts;

typedef struct { /* one block's weights and constants (made once per plan) */
    int64_t akind, dim, layer;
    const void *input_norm, *post_norm, *q_norm, *kv_norm; /* in the activation dtype */
    float input_eps, post_eps, q_eps, kv_eps;
    BlkLinear q_a, q_b, kv_a, o; /* q_a.w NULL: no query compression and q_b is q_proj */
    const void *w_uk, *w_uv;     /* W_UK [H, nope, r], W_UV [H, v, r] (strided), fp32 or bf16 (w_kind) */
    int64_t uk_hstride, uk_rstride, uv_hstride, uv_rstride;
    int64_t heads, nope, rope, v_dim, kv_rank;
    float softmax_scale;
    const float *router, *router_bias; /* router NULL: a dense MLP (in ``shared``), no routed experts */
    int64_t softmax, n_group, topk_group, group_sum, topk, normalize;
    float route_scale;
    BlkExperts routed, shared; /* shared.gate NULL: no shared expert */
    int64_t w_kind;            /* of w_uk and w_uv */
    int64_t *expert_counts;    /* [routed.n_experts]: each row's chosen experts are added here; NULL: not counted */
} BlkDesc;

typedef struct { /* one decode step, shared by all blocks */
    int64_t rows, T, start; /* rows x T new tokens, written at cache slots [start, start + T) */
    const float *cos, *sin; /* [rows or 1, T, rope/2] fp32, or NULL: looked up for ``positions`` */
    int64_t rot_bstride;    /* 0 when one rotation serves every row */
    void *kv, *pe;          /* the latent cache [layers, pages, slots, r | rope] (plain: a page per row) */
    int64_t ckind, kv_lstride, kv_bstride, kv_sstride, pe_lstride, pe_bstride, pe_sstride; /* b: between pages */
    PageMap pages;          /* where each row's slots lie (pages.table NULL: row b is page b) */
    const float *bias; /* additive mask [rows or 1, T, start + T], or NULL */
    int64_t bias_bstride, nthreads;
    const int64_t *positions;          /* [rows or 1, T] (with cos NULL) */
    int64_t pos_bstride;               /* 0 when every row has the same positions */
    const float *table_cos, *table_sin; /* cos and sin of positions [0, table_len), [table_len, rope/2] fp32 */
    int64_t table_len, half;
} BlkStep;

/* The step with its RoPE rows in place: s itself when it carries them, else *local, a copy pointing at the
 * table's rows for its positions, copied into *rows (freed by the caller); NULL (nothing allocated) when a
 * position lies outside the table. */
static const BlkStep *blk_rope_rows(const BlkStep *s, BlkStep *local, float **rows) {
    *rows = NULL;
    if (s->cos) return s;
    const int64_t B = s->pos_bstride ? s->rows : 1, n = B * s->T, half = s->half;
    for (int64_t i = 0; i < n; i++) {
        const int64_t pos = s->positions[(i / s->T) * s->pos_bstride + i % s->T];
        if (pos < 0 || pos >= s->table_len) return NULL;
    }
    float *buf = (float *)malloc((size_t)(2 * n * half + 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        const int64_t pos = s->positions[(i / s->T) * s->pos_bstride + i % s->T];
        memcpy(buf + i * half, s->table_cos + pos * half, (size_t)half * sizeof(float));
        memcpy(buf + (n + i) * half, s->table_sin + pos * half, (size_t)half * sizeof(float));
    }
    *local = *s;
    local->cos = buf, local->sin = buf + n * half, local->rot_bstride = s->pos_bstride ? s->T * half : 0;
    *rows = buf;
    return local;
}

#ifdef DSV3_BLOCK_PROFILE /* per-phase wall time of the block kernel (a profiling build only) */
#include <time.h>
enum { PH_NORM, PH_Q, PH_KV, PH_LATENT, PH_ATT, PH_O, PH_ROUTE, PH_ROUTED, PH_SHARED, PH_N };
static double blk_prof[PH_N], prof_t;
static double blk_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PROF_START (prof_t = blk_now())
#define PROF(ph) do { const double prof_u = blk_now(); blk_prof[ph] += prof_u - prof_t; prof_t = prof_u; } while (0)
int dsv3_block_profile(double *out, int reset) {
    for (int i = 0; i < PH_N; i++) out[i] = blk_prof[i];
    if (reset) memset(blk_prof, 0, sizeof(blk_prof));
    return PH_N;
}
#else
#define PROF_START ((void)0)
#define PROF(ph)
#endif

/* RMSNorm.forward for M rows of n values, x rows ``ldx`` apart: w * (x / rms(x)).to(dtype), normalised in
 * fp32, in the activation dtype (as decode.rms_norm). out may be x. */
static void blk_rms_norm(const void *x, int64_t ldx, const void *w, float eps, int kind, int64_t M, int64_t n,
                         void *out, int64_t ldo) {
    for (int64_t m = 0; m < M; m++) {
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float v = blk_load(x, kind, m * ldx + i);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++)
            blk_store(out, kind, m * ldo + i, blk_load(w, kind, i) * blk_round(kind, blk_load(x, kind, m * ldx + i) * inv));
    }
}

/* x (+)= y elementwise in the activation dtype (the residual add). */
static void blk_add(void *x, const void *y, int kind, int64_t n) {
    for (int64_t i = 0; i < n; i++) blk_store(x, kind, i, blk_load(x, kind, i) + blk_load(y, kind, i));
}

/* The block's linear l, prefetching on into ``then`` (the one it reads next, or NULL). */
static void blk_linear(const BlkLinear *l, const void *x, int akind, int64_t M, void *out, int nthreads,
                       const BlkLinear *then) {
    linear(l->w, l->scale, (int)l->kind, l->n, l->k, x, akind, M, out, akind, nthreads, then);
}

static void blk_experts(const BlkExperts *e, const void *x, int akind, int64_t M, const int64_t *idx,
                        const float *gates, int64_t topk, void *out, int accumulate, int nthreads) {
    dsv3_swiglu_experts(e->gate, e->up, e->down, e->gate_scale, e->up_scale, e->down_scale, (int)e->kind,
                        e->n_experts, e->inter, e->dim, x, akind, M, idx, gates, topk, out, akind, accumulate,
                        nthreads);
}

/* Whether every slot the step writes, [start, start + T) of each row, lies in the row's pages or before its
 * shift (left padding, not stored): 0, or -3 (LatentCache.write's error: a slot outside a row's pages). */
static int blk_check_slots(const BlkStep *s) {
    for (int64_t b = 0; b < s->rows; b++)
        for (int64_t t = 0; t < s->T; t++) {
            int64_t off;
            if (page_of(&s->pages, b, s->start + t, &off) == -2) return -3;
        }
    return 0;
}

/* The cache write of the new tokens: c_KV normed (kv_a_layernorm, in the activation dtype) and k_R roped
 * (in fp32), from kv_a's output kv [M, r + rope], each converted to the cache's dtype; a slot before a row's
 * shift is not stored (blk_check_slots has refused any other slot outside the pages). */
static void blk_write_latents(const BlkDesc *d, const BlkStep *s, const void *kv) {
    const int ak = (int)d->akind, ck = (int)s->ckind;
    const int64_t r = d->kv_rank, p = d->rope, width = r + p;
    const size_t aes = ak == A_F32 ? 4 : 2, ces = ck == A_F32 ? 4 : 2;
    void *c = malloc((size_t)(r > 0 ? r : 1) * aes);
    for (int64_t b = 0; b < s->rows; b++) {
        for (int64_t t = 0; t < s->T; t++) {
            int64_t off;
            const int64_t m = b * s->T + t, page = page_of(&s->pages, b, s->start + t, &off);
            if (page < 0) continue;
            char *kv_out = (char *)s->kv + (size_t)(d->layer * s->kv_lstride + page * s->kv_bstride + off * s->kv_sstride) * ces;
            char *pe_out = (char *)s->pe + (size_t)(d->layer * s->pe_lstride + page * s->pe_bstride + off * s->pe_sstride) * ces;
            blk_rms_norm((const char *)kv + (size_t)(m * width) * aes, 0, d->kv_norm, d->kv_eps, ak, 1, r, c, 0);
            for (int64_t i = 0; i < r; i++) blk_store(kv_out, ck, i, blk_load(c, ak, i));
            const float *cs = s->cos + s->rot_bstride * b + t * (p / 2), *sn = s->sin + s->rot_bstride * b + t * (p / 2);
            for (int64_t j = 0; j < p / 2; j++) {
                const float x0 = blk_load(kv, ak, m * width + r + 2 * j), x1 = blk_load(kv, ak, m * width + r + 2 * j + 1);
                blk_store(pe_out, ck, 2 * j, x0 * cs[j] - x1 * sn[j]);
                blk_store(pe_out, ck, 2 * j + 1, x0 * sn[j] + x1 * cs[j]);
            }
        }
    }
    free(c);
}

/* The feed-forward half's output y [M, dim] (activation dtype) from its normed input h: the router and
 * the routed experts, plus the shared expert (or the dense MLP, as one expert every row goes to). */
static void blk_feed_forward(const BlkDesc *d, const BlkStep *s, const void *h, int64_t M, void *y) {
    const int ak = (int)d->akind, nt = (int)s->nthreads;
    int have = 0;
    if (d->router) {
        const int64_t k = d->topk;
        int64_t *idx = (int64_t *)malloc((size_t)(M * k + 1) * sizeof(int64_t));
        float *gates = (float *)malloc((size_t)(M * k + 1) * sizeof(float));
        dsv3_route(d->router, d->router_bias, d->routed.n_experts, d->dim, h, ak, M, (int)d->softmax, d->n_group,
                   d->topk_group, (int)d->group_sum, k, (int)d->normalize, d->route_scale, idx, gates, nt);
        if (d->expert_counts) /* the server's expert load, counted where the routing is known */
            for (int64_t p = 0; p < M * k; p++)
                if (idx[p] >= 0 && idx[p] < d->routed.n_experts) d->expert_counts[idx[p]]++;
        PROF(PH_ROUTE);
        blk_experts(&d->routed, h, ak, M, idx, gates, k, y, 0, nt);
        PROF(PH_ROUTED);
        free(idx), free(gates);
        have = 1;
    }
    if (d->shared.gate) {
        int64_t *zero = (int64_t *)calloc((size_t)(M + 1), sizeof(int64_t));
        float *one = (float *)malloc((size_t)(M + 1) * sizeof(float));
        for (int64_t m = 0; m < M; m++) one[m] = 1.0f;
        blk_experts(&d->shared, h, ak, M, zero, one, 1, y, have, nt);
        free(zero), free(one);
        PROF(PH_SHARED);
    }
}

/* The weights the block reads right after its attention, in order (the output projection, the router, the
 * shared expert or dense MLP), for the attention to fetch while it computes. */
static void blk_read_after_attention(const BlkDesc *d, PfRanges *after) {
    after->count = 0;
    const BlkLinear *o = &d->o;
    after->p[after->count] = o->w, after->n[after->count++] = weight_bytes((int)o->kind, o->n * o->k);
    if (d->router)
        after->p[after->count] = (const char *)d->router,
        after->n[after->count++] = (size_t)(d->routed.n_experts * d->dim) * sizeof(float);
    if (d->shared.gate) {
        const BlkExperts *e = &d->shared;
        const size_t bytes = weight_bytes((int)e->kind, e->n_experts * e->inter * e->dim);
        const void *parts[3] = {e->gate, e->up, e->down};
        for (int i = 0; i < 3; i++) after->p[after->count] = parts[i], after->n[after->count++] = bytes;
    }
}

/* One block's decode step on x [rows * T, dim] (activation dtype), in place: x += attn(norm(x)), then
 * x += ffn(norm(x)); the new tokens' latents are written to the cache at layer ``d->layer``. Returns 0, or
 * (nothing done) -2 when a position lies outside the step's RoPE table, -3 when a slot it writes lies outside
 * a row's pages. */
static void decode_block(const BlkDesc *d, const BlkStep *s, void *x);
int dsv3_decode_block(const BlkDesc *d, const BlkStep *s, void *x) {
    if (blk_check_slots(s)) return -3;
    BlkStep local;
    float *rope_rows;
    const BlkStep *step = blk_rope_rows(s, &local, &rope_rows);
    if (!step) return -2;
    decode_block(d, step, x);
    free(rope_rows);
    return 0;
}

static void decode_block(const BlkDesc *d, const BlkStep *s, void *x) {
    const int ak = (int)d->akind, nt = (int)s->nthreads;
    const size_t es = ak == A_F32 ? 4 : 2;
    const int64_t M = s->rows * s->T, D = d->dim, H = d->heads, width = d->kv_rank + d->rope;
    const int64_t S = s->start + s->T, ces = s->ckind == A_F32 ? 4 : 2;
    char *h = (char *)malloc((size_t)(M * D + 1) * es), *y = (char *)malloc((size_t)(M * D + 1) * es);
    char *q = (char *)malloc((size_t)(M * d->q_b.n + 1) * es), *kv = (char *)malloc((size_t)(M * width + 1) * es);
    char *att = (char *)malloc((size_t)(M * H * d->v_dim + 1) * es);
    PROF_START;
    blk_rms_norm(x, D, d->input_norm, d->input_eps, ak, M, D, h, D);
    PROF(PH_NORM);
    if (d->q_a.w) {
        char *qa = (char *)malloc((size_t)(M * d->q_a.n + 1) * es);
        blk_linear(&d->q_a, h, ak, M, qa, nt, &d->q_b);
        blk_rms_norm(qa, d->q_a.n, d->q_norm, d->q_eps, ak, M, d->q_a.n, qa, d->q_a.n);
        blk_linear(&d->q_b, qa, ak, M, q, nt, &d->kv_a);
        free(qa);
    } else {
        blk_linear(&d->q_b, h, ak, M, q, nt, &d->kv_a);
    }
    PROF(PH_Q);
    blk_linear(&d->kv_a, h, ak, M, kv, nt, NULL);
    PROF(PH_KV);
    blk_write_latents(d, s, kv);
    PROF(PH_LATENT);
    PfRanges after;
    blk_read_after_attention(d, &after);
    mla_decode(&after, q, ak, s->cos, s->sin, s->rot_bstride, d->w_uk, d->uk_hstride, d->uk_rstride, d->w_uv,
                    d->uv_hstride, d->uv_rstride, (int)d->w_kind,
                    (const char *)s->kv + (size_t)(d->layer * s->kv_lstride) * ces, (const char *)s->pe + (size_t)(d->layer * s->pe_lstride) * ces, (int)s->ckind, s->rows, s->T,
                    H, S, d->nope, d->rope, d->kv_rank, d->v_dim, s->kv_bstride, s->kv_sstride, s->pe_bstride,
                    s->pe_sstride, &s->pages, s->bias, s->bias_bstride, d->softmax_scale, att, nt);
    PROF(PH_ATT);
    blk_linear(&d->o, att, ak, M, y, nt, NULL);
    PROF(PH_O);
    blk_add(x, y, ak, M * D);
    blk_rms_norm(x, D, d->post_norm, d->post_eps, ak, M, D, h, D);
    PROF(PH_NORM);
    blk_feed_forward(d, s, h, M, y);
    blk_add(x, y, ak, M * D);
    PROF(PH_NORM);
    free(h), free(y), free(q), free(kv), free(att);
}

/* RMSNorm of M rows of n values (the final norms): out = w * (x / rms(x)).to(dtype). Returns 0. */
int dsv3_rms_norm(const void *x, const void *w, float eps, int akind, int64_t M, int64_t n, void *out) {
    blk_rms_norm(x, n, w, eps, akind, M, n, out, n);
    return 0;
}

/* ---- a whole decode step in one call ---- */

typedef struct { /* the model around its blocks (made once per set of block plans) */
    int64_t akind, dim, vocab, n_blocks;
    const void *embed;            /* [vocab, dim] in the activation dtype */
    const BlkDesc *const *blocks; /* n_blocks block descriptors, in order */
    const void *norm;             /* the final norm's weight */
    float norm_eps;
    BlkLinear head; /* [N, dim]: logits [M, N] in the activation dtype */
} StepDesc;

/* The embedding of ids [rows * T], every block (dsv3_decode_block), the final norm into h [rows * T, dim] and
 * the head into logits [rows * T, head.n]: what FastDecode runs per step as separate calls, in one, so that no
 * interpreter work sits between the weight streams. Returns 0, or (nothing computed, cache untouched) -1 when
 * an id is outside [0, vocab), -2 when a position is outside the step's RoPE table, -3 when a slot it writes
 * is outside a row's pages. With ``scan`` (else NULL), also dsv3_scan_logits of those logits into scan [rows * T]:
 * the engine's check and greedy pick, while the logits are still in cache and before any interpreter work (a
 * call of its own would go through PyTorch's dispatcher after the weights have streamed through the caches). */
int dsv3_scan_logits(const void *x, int kind, int64_t M, int64_t n, int64_t ld, int64_t *idx);
int dsv3_decode_step(const StepDesc *m, const BlkStep *s, const int64_t *ids, void *h, void *logits, int64_t *scan) {
    const int ak = (int)m->akind;
    const int64_t M = s->rows * s->T, D = m->dim;
    const size_t row = (size_t)D * (ak == A_F32 ? 4 : 2);
    for (int64_t i = 0; i < M; i++)
        if (ids[i] < 0 || ids[i] >= m->vocab) return -1;
    if (blk_check_slots(s)) return -3;
    BlkStep local;
    float *rope_rows;
    const BlkStep *step = blk_rope_rows(s, &local, &rope_rows);
    if (!step) return -2;
    char *x = (char *)malloc((size_t)M * row + 1);
    for (int64_t i = 0; i < M; i++) memcpy(x + (size_t)i * row, (const char *)m->embed + (size_t)ids[i] * row, row);
    for (int64_t b = 0; b < m->n_blocks; b++) decode_block(m->blocks[b], step, x);
    blk_rms_norm(x, D, m->norm, m->norm_eps, ak, M, D, h, D);
    blk_linear(&m->head, h, ak, M, logits, (int)s->nthreads, NULL);
    if (scan) dsv3_scan_logits(logits, ak, M, m->head.n, m->head.n, scan);
    free(x), free(rope_rows);
    return 0;
}

/* ---- the engine's scan of a step's logits ---- */

/* For M rows of n values (fp32 or bf16, rows ld values apart): idx[m] = the first index of row m's largest
 * value (torch.argmax's choice) when every value of the row is finite, else -1. One vector pass for the
 * maximum and the finiteness (v - v is 0 only for finite v), one for the first index holding the maximum:
 * the engine's check of every row and its greedy pick in one call over logits the head has just written
 * (still in cache), instead of two PyTorch/NumPy calls per row. Returns 0. */
int dsv3_scan_logits(const void *x, int kind, int64_t M, int64_t n, int64_t ld, int64_t *idx) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t m = 0; m < M; m++) {
        const int64_t off = m * ld;
        __m256 vmax = _mm256_set1_ps(-INFINITY), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = blk_load8(x, kind, off + i);
            vmax = _mm256_max_ps(vmax, v);
            ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ));
        }
        int finite = _mm256_movemask_ps(ok) == 0xFF;
        float lanes[8], best = -INFINITY;
        _mm256_storeu_ps(lanes, vmax);
        for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
        for (int64_t j = i; j < n; j++) {
            const float v = blk_load(x, kind, off + j);
            finite &= isfinite(v) != 0;
            best = v > best ? v : best;
        }
        idx[m] = -1;
        if (!finite) continue;
        const __m256 vbest = _mm256_set1_ps(best);
        for (i = 0; i + 8 <= n; i += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(blk_load8(x, kind, off + i), vbest, _CMP_EQ_OQ));
            if (hit) {
                idx[m] = i + __builtin_ctz((unsigned)hit);
                break;
            }
        }
        for (; idx[m] < 0 && i < n; i++)
            if (blk_load(x, kind, off + i) == best) idx[m] = i;
    }
    return 0;
}


/* ---- descriptors made and filled by name ----
 * Python never lays the block and step structures out: it asks for one (dsv3_desc_new) and sets its fields by
 * name (dsv3_desc_set), and the name tables below, made by the compiler with offsetof, say where each lives. A
 * field added on one side only is an unknown name (an error), never a pointer written into the wrong place. */

enum { DESC_BLOCK = 0, DESC_STEP = 1, DESC_MODEL = 2 };
enum { F_I64, F_F32, F_PTR };
typedef struct { const char *name; size_t offset; int type; } DescField;

#define FIELD(S, f, t) { #f, offsetof(S, f), t }
#define LINEAR(S, l) FIELD(S, l.w, F_PTR), FIELD(S, l.scale, F_PTR), FIELD(S, l.kind, F_I64), \
    FIELD(S, l.n, F_I64), FIELD(S, l.k, F_I64)
#define EXPERTS(S, e) FIELD(S, e.gate, F_PTR), FIELD(S, e.up, F_PTR), FIELD(S, e.down, F_PTR), \
    FIELD(S, e.gate_scale, F_PTR), FIELD(S, e.up_scale, F_PTR), FIELD(S, e.down_scale, F_PTR), \
    FIELD(S, e.kind, F_I64), FIELD(S, e.n_experts, F_I64), FIELD(S, e.inter, F_I64), FIELD(S, e.dim, F_I64)

static const DescField BLOCK_FIELDS[] = {
    FIELD(BlkDesc, akind, F_I64), FIELD(BlkDesc, dim, F_I64), FIELD(BlkDesc, layer, F_I64),
    FIELD(BlkDesc, input_norm, F_PTR), FIELD(BlkDesc, post_norm, F_PTR), FIELD(BlkDesc, q_norm, F_PTR),
    FIELD(BlkDesc, kv_norm, F_PTR), FIELD(BlkDesc, input_eps, F_F32), FIELD(BlkDesc, post_eps, F_F32),
    FIELD(BlkDesc, q_eps, F_F32), FIELD(BlkDesc, kv_eps, F_F32),
    LINEAR(BlkDesc, q_a), LINEAR(BlkDesc, q_b), LINEAR(BlkDesc, kv_a), LINEAR(BlkDesc, o),
    FIELD(BlkDesc, w_uk, F_PTR), FIELD(BlkDesc, w_uv, F_PTR), FIELD(BlkDesc, uk_hstride, F_I64),
    FIELD(BlkDesc, uk_rstride, F_I64), FIELD(BlkDesc, uv_hstride, F_I64), FIELD(BlkDesc, uv_rstride, F_I64),
    FIELD(BlkDesc, heads, F_I64), FIELD(BlkDesc, nope, F_I64), FIELD(BlkDesc, rope, F_I64),
    FIELD(BlkDesc, v_dim, F_I64), FIELD(BlkDesc, kv_rank, F_I64), FIELD(BlkDesc, softmax_scale, F_F32),
    FIELD(BlkDesc, router, F_PTR), FIELD(BlkDesc, router_bias, F_PTR), FIELD(BlkDesc, softmax, F_I64),
    FIELD(BlkDesc, n_group, F_I64), FIELD(BlkDesc, topk_group, F_I64), FIELD(BlkDesc, group_sum, F_I64),
    FIELD(BlkDesc, topk, F_I64), FIELD(BlkDesc, normalize, F_I64), FIELD(BlkDesc, route_scale, F_F32),
    EXPERTS(BlkDesc, routed), EXPERTS(BlkDesc, shared), FIELD(BlkDesc, w_kind, F_I64),
    FIELD(BlkDesc, expert_counts, F_PTR),
};
static const DescField STEP_FIELDS[] = {
    FIELD(BlkStep, rows, F_I64), FIELD(BlkStep, T, F_I64), FIELD(BlkStep, start, F_I64),
    FIELD(BlkStep, cos, F_PTR), FIELD(BlkStep, sin, F_PTR), FIELD(BlkStep, rot_bstride, F_I64),
    FIELD(BlkStep, kv, F_PTR), FIELD(BlkStep, pe, F_PTR), FIELD(BlkStep, ckind, F_I64),
    FIELD(BlkStep, kv_lstride, F_I64), FIELD(BlkStep, kv_bstride, F_I64), FIELD(BlkStep, kv_sstride, F_I64),
    FIELD(BlkStep, pe_lstride, F_I64), FIELD(BlkStep, pe_bstride, F_I64), FIELD(BlkStep, pe_sstride, F_I64),
    FIELD(BlkStep, bias, F_PTR), FIELD(BlkStep, bias_bstride, F_I64), FIELD(BlkStep, nthreads, F_I64),
    FIELD(BlkStep, positions, F_PTR), FIELD(BlkStep, pos_bstride, F_I64), FIELD(BlkStep, table_cos, F_PTR),
    FIELD(BlkStep, table_sin, F_PTR), FIELD(BlkStep, table_len, F_I64), FIELD(BlkStep, half, F_I64),
    FIELD(BlkStep, pages.table, F_PTR), FIELD(BlkStep, pages.table_stride, F_I64),
    FIELD(BlkStep, pages.table_cols, F_I64), FIELD(BlkStep, pages.shift, F_PTR),
    FIELD(BlkStep, pages.page_tokens, F_I64), FIELD(BlkStep, pages.n_pages, F_I64),
};
static const DescField MODEL_FIELDS[] = {
    FIELD(StepDesc, akind, F_I64), FIELD(StepDesc, dim, F_I64), FIELD(StepDesc, vocab, F_I64),
    FIELD(StepDesc, n_blocks, F_I64), FIELD(StepDesc, embed, F_PTR), FIELD(StepDesc, blocks, F_PTR),
    FIELD(StepDesc, norm, F_PTR), FIELD(StepDesc, norm_eps, F_F32), LINEAR(StepDesc, head),
};
#undef EXPERTS
#undef LINEAR
#undef FIELD

static const struct { const DescField *fields; size_t count, size; } DESCS[] = {
    {BLOCK_FIELDS, sizeof BLOCK_FIELDS / sizeof *BLOCK_FIELDS, sizeof(BlkDesc)},
    {STEP_FIELDS, sizeof STEP_FIELDS / sizeof *STEP_FIELDS, sizeof(BlkStep)},
    {MODEL_FIELDS, sizeof MODEL_FIELDS / sizeof *MODEL_FIELDS, sizeof(StepDesc)},
};

/* A zeroed descriptor of ``kind`` (DESC_BLOCK: BlkDesc, DESC_STEP: BlkStep, DESC_MODEL: StepDesc), freed with
   dsv3_desc_free; NULL for an unknown kind or no memory. */
void *dsv3_desc_new(int kind) {
    return kind < 0 || kind > DESC_MODEL ? NULL : calloc(1, DESCS[kind].size);
}

void dsv3_desc_free(void *desc) { free(desc); }

/* Set field ``name`` (a dotted path into a nested linear layer or experts: "q_a.w", "routed.n_experts") of a
   descriptor of ``kind``: integers and addresses from ``i``, floats from ``f``. Returns 0, or -1 for a name
   the structure does not have. */
int dsv3_desc_set(int kind, void *desc, const char *name, int64_t i, double f) {
    if (kind < 0 || kind > DESC_MODEL) return -1;
    for (size_t n = 0; n < DESCS[kind].count; n++) {
        const DescField *fd = &DESCS[kind].fields[n];
        if (strcmp(fd->name, name) != 0) continue;
        char *at = (char *)desc + fd->offset;
        if (fd->type == F_I64) *(int64_t *)at = i;
        else if (fd->type == F_F32) *(float *)at = (float)f;
        else *(void **)at = (void *)(intptr_t)i;
        return 0;
    }
    return -1;
}
