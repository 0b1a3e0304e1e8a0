/* Matrix kernels over group-wise integer weights (dsv3/kernels/int_weights.py describes the format), a part of
 * decode_kernels.c (which includes this file: one translation unit, so the linear layers, the experts and the
 * block kernel read integer weights through the same code as fp32, bf16 and FP8 ones).
 *
 * A weight [N, K] is stored as N rows of K/32 groups. Each group has one fp16 scale d and 32 signed
 * integers q; its values are d * q. int8: 32 bytes per group, q[j] in byte j. int4: 16 bytes per group,
 * q[j] + 8 in the low nibble of byte j and q[j + 16] + 8 in its high nibble (j < 16).
 *
 * Widening a group to fp32 costs more operations than its bytes take to arrive from memory, so the weights
 * stay bytes and the activations become integers: each activation group of 32 is rounded to int8 with an
 * fp32 scale (its largest magnitude / 127; llama.cpp rounds activations so for its Q8_0 and Q4_0 dot
 * products), once per call, and a group's dot product is exact int32 sums of byte products; one conversion
 * and two multiplies by (activation scale, weight scale) add it to the row's fp32 total.
 * ``dsv3.precision.int_groups.round_activations`` is that rounding in PyTorch, which the references apply
 * too, so every path multiplies the same numbers. A row's result does not depend on how many rows share the
 * call. Two paths, chosen at run time (dsv3_int_avx512(0) forces the second, so both can be tested on one
 * machine):
 * - AVX-512 VNNI (AVX-512F/BW and AVX512-VNNI): vpdpbusd multiplies 64 unsigned weight bytes by 64 signed
 *   activation bytes into 16 int32 sums in one operation. Its first operand must be unsigned, so the weights
 *   enter with their offset: int4 nibbles as stored (q + 8), int8 bytes with their top bit flipped (q + 128),
 *   and each group's sum starts from -8 (-128) times the activations' group sum, computed with them.
 * - AVX2 (the baseline): vpmaddubsw multiplies 32 unsigned by 32 signed bytes into 16 int16 pair sums, which
 *   saturate past 32767: int4 nibbles (at most 15) enter as stored, with the same offset; int8 weights as
 *   their magnitudes, the activations taking their signs (|q| <= 127, so no pair saturates).
 * The activations are laid out once per call in the order the weight bytes meet them (int8_blocks), with
 * each group's offset and scale beside them in the lanes its sums land in, so the inner loops only load.
 * With few activation rows (decode: 1 to 4 on AVX-512, 1 or 2 on AVX2) several weight rows run at once, for
 * independent totals and shared activation loads; with more, one weight row for a tile of up to 16 (8).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INT_GROUP 32
#define INT_SCALES 8 /* group scales widened to fp32 at a time on AVX2 (one F16C conversion) */
#define VNNI_SCALES 16 /* on AVX-512 */

static int int_use_avx512 = -1, int_use_vnni = -1;

/* want 0: the AVX2 paths; 1: AVX-512 where the CPU has it; -1: query. Returns whether AVX-512 runs. */
int dsv3_int_avx512(int want) {
    if (int_use_avx512 < 0 || want >= 0)
        int_use_avx512 = want != 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return int_use_avx512;
}

/* Whether the integer GEMV takes its AVX-512 VNNI path (the AVX-512 paths on, and AVX512-VNNI). */
int dsv3_int_vnni(void) {
    if (int_use_vnni < 0) int_use_vnni = __builtin_cpu_supports("avx512vnni");
    return int_use_vnni && dsv3_int_avx512(-1);
}

/* Bytes of one row of K integer values (K a multiple of INT_GROUP). */
static inline int64_t int_row_bytes(int bits, int64_t K) { return bits == 8 ? K : K / 2; }

/* ---- the activations as int8 blocks ------------------------------------------------------------------------- */

/* A block is what one zmm of weights holds, 64 bytes: 4 int4 groups or 2 int8 groups. For each activation row
 * and block, int8_blocks writes (bytes): the int8 activations in the order of the block's weight values (int4:
 * the 16 values each group's low nibbles meet, group after group, then the 16 its high nibbles meet; int8: in
 * column order), then 16 int32 offsets (group j's in lane 16 / G * j, the others 0; int8 weights on AVX2 leave
 * them out), then 16 fp32 lane scales (lanes 16 / G * j to 16 / G * (j + 1) - 1: group j's). A zmm's
 * vpdpbusd sums land group by group in those lanes; AVX2 reads each block in halves the same way. */
static inline int block_groups(int bits) { return bits == 4 ? 4 : 2; }
static inline int64_t block_act_bytes(int bits) { return bits == 4 ? 128 : 64; }
static inline int64_t block_bytes(int bits) { return block_act_bytes(bits) + 128; }
static inline int64_t blocks_of(int bits, int64_t K) {
    return (K / INT_GROUP + block_groups(bits) - 1) / block_groups(bits);
}

/* x [M, K] (fp32) as the blocks above, into xb (M * blocks_of(bits, K) blocks). A group holding an inf or NaN
 * gets a NaN scale, so that the result is NaN as in fp32. */
static void int8_blocks(int bits, const float *x, int64_t M, int64_t K, uint8_t *xb) {
    const int G = block_groups(bits), lanes = 16 / G;
    const int64_t groups = K / INT_GROUP, blocks = blocks_of(bits, K), bb = block_bytes(bits);
    const int64_t ab = block_act_bytes(bits);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    memset(xb, 0, (size_t)(M * blocks * bb));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + m * K + g * INT_GROUP;
            __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xg + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[j], v[j]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
            }
            float lane_max[8];
            _mm256_storeu_ps(lane_max, amax);
            float top = lane_max[0];
            for (int j = 1; j < 8; j++) top = lane_max[j] > top ? lane_max[j] : top;
            const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
            __m256i q[4];
            for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
            /* packs works within 128-bit lanes: the dwords back in column order after both packs */
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
            const int32_t sum = _mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(s2, s2), s2));
            uint8_t *block = xb + (m * blocks + g / G) * bb;
            const int j = (int)(g % G);
            _mm_storeu_si128((__m128i *)(block + (bits == 4 ? 16 * j : 32 * j)), _mm256_castsi256_si128(bytes));
            _mm_storeu_si128((__m128i *)(block + (bits == 4 ? 64 + 16 * j : 32 * j + 16)),
                             _mm256_extracti128_si256(bytes, 1));
            ((int32_t *)(block + ab))[lanes * j] = (bits == 4 ? -8 : -128) * sum;
            const float scale = _mm256_movemask_ps(bad) ? __builtin_nanf("") : top / 127.0f;
            for (int l = 0; l < lanes; l++) ((float *)(block + ab + 64))[lanes * j + l] = scale;
        }
}

/* ---- AVX2 path ------------------------------------------------------------------------------------------------ */

/* The fp32 scales of groups [g, g + INT_SCALES) of a row (fp16 s); past the row's end 0. */
static inline __attribute__((always_inline)) __m256 group_scales(const uint16_t *s, int64_t g, int64_t groups) {
    if (g + INT_SCALES <= groups) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g)));
    uint16_t part[INT_SCALES] = {0};
    for (int64_t j = g; j < groups; j++) part[j - g] = s[j];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)part));
}

static inline float int_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Half h of a block (int4: groups 2h and 2h + 1, of which n are in the row; int8: group h) of one weight row
 * (w: the block's first weight byte) times R activation rows (block: row 0's block, rows xrow bytes apart)
 * into acc[r]; sv: the weight scales of the half's lanes. */
static inline __attribute__((always_inline)) void half_avx2(int bits, int R, const uint8_t *w, int h, int n,
                                                            const uint8_t *block, int64_t xrow, __m256 sv,
                                                            __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    const int64_t ab = block_act_bytes(bits);
    __m256i u0, u1 = _mm256_setzero_si256(), wq = _mm256_setzero_si256();
    if (bits == 4) {
        const __m256i v = n == 2 ? _mm256_loadu_si256((const __m256i *)(w + 32 * h))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(w + 32 * h)));
        u0 = _mm256_and_si256(v, low), u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    } else {
        wq = _mm256_loadu_si256((const __m256i *)(w + 32 * h));
        u0 = _mm256_abs_epi8(wq);
    }
    for (int r = 0; r < R; r++) {
        const uint8_t *b = block + r * xrow;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(b + 32 * h));
        __m256i p;
        if (bits == 4) /* pairs of at most 2 * 15 * 127 each, two of them: no int16 overflow */
            p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, x0),
                                 _mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(b + 64 + 32 * h))));
        else
            p = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(x0, wq));
        __m256i d = _mm256_madd_epi16(p, ones);
        if (bits == 4) d = _mm256_add_epi32(d, _mm256_loadu_si256((const __m256i *)(b + ab + 32 * h)));
        const __m256 xs = _mm256_loadu_ps((const float *)(b + ab + 64 + 32 * h));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), xs), sv, acc[r]);
    }
}

/* out[m * ldo + i] = sum_k W[n + i, k] x[m, k] for the NW weight rows n + i (rows rb bytes apart) and the
 * activation rows m < R, x as int8_blocks laid it out (row m at xb + m * xrow); NW * R <= 8. */
static inline __attribute__((always_inline)) void row_avx2(int bits, int NW, int R, const uint8_t *q,
                                                           const uint16_t *s, int64_t rb, int64_t K,
                                                           const uint8_t *xb, int64_t xrow, float *out,
                                                           int64_t ldo) {
    const int G = block_groups(bits);
    const int64_t groups = K / INT_GROUP, blocks = blocks_of(bits, K), bb = block_bytes(bits);
    __m256 acc[4][8], ws[4];
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t g = b * G;
        if (g % INT_SCALES == 0)
            for (int i = 0; i < NW; i++) ws[i] = group_scales(s + i * groups, g, groups);
        const int c = (int)(g % INT_SCALES), left = (int)(groups - g < G ? groups - g : G);
        for (int i = 0; i < NW; i++) {
            const uint8_t *w = q + i * rb + g * (bits == 8 ? INT_GROUP : INT_GROUP / 2);
            for (int h = 0; 2 * h < (bits == 4 ? left : 2 * left); h++) {
                /* int4: lanes 0-3 group c + 2h, 4-7 group c + 2h + 1; int8: all lanes group c + h */
                const __m256i index = bits == 4 ? _mm256_setr_epi32(c + 2 * h, c + 2 * h, c + 2 * h, c + 2 * h,
                                                                    c + 2 * h + 1, c + 2 * h + 1, c + 2 * h + 1,
                                                                    c + 2 * h + 1)
                                                : _mm256_set1_epi32(c + h);
                const int n = bits == 4 ? (left - 2 * h >= 2 ? 2 : 1) : 1;
                half_avx2(bits, R, w, h, n, xb + b * bb, xrow, _mm256_permutevar8x32_ps(ws[i], index), acc[i]);
            }
        }
    }
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = int_hsum8(acc[i][r]);
}

/* row_avx2 for int4, one activation row (the decode GEMV) and four weight rows whose groups fill whole blocks:
 * the same operations in the same order, so the same bits, with the sums in named registers (GCC keeps
 * row_avx2's arrays on the stack, each half a block's sum stored and reloaded). The one-row GEMVs of `small`'s
 * matrices read 1.11-1.35x as many bytes per second from memory this way (decode_kernels_speed.py --avx2,
 * record 7) and a whole int4 step of `large` took 0.75-0.91x the time in two runs (decode_step_ab.py --avx2).
 * int8, which takes two weight rows at once, was no faster with four this way, nor with its two in named
 * registers, so it keeps row_avx2. */
static inline __attribute__((always_inline)) void row4_int4_avx2(const uint8_t *q, const uint16_t *s, int64_t rb,
                                                                 int64_t K, const uint8_t *xb, float *out) {
    const int G = block_groups(4);
    const int64_t groups = K / INT_GROUP, blocks = groups / G, bb = block_bytes(4);
    const uint8_t *w0 = q, *w1 = q + rb, *w2 = q + 2 * rb, *w3 = q + 3 * rb;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, s0 = a0, s1 = a0, s2 = a0, s3 = a0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t g = b * G;
        const int c = (int)(g % INT_SCALES);
        if (c == 0) {
            s0 = group_scales(s, g, groups), s1 = group_scales(s + groups, g, groups);
            s2 = group_scales(s + 2 * groups, g, groups), s3 = group_scales(s + 3 * groups, g, groups);
        }
        const uint8_t *block = xb + b * bb;
        const int64_t at = g * (INT_GROUP / 2);
        for (int h = 0; h < 2; h++) { /* lanes 0-3 group c + 2h, 4-7 group c + 2h + 1 */
            const int lo = c + 2 * h, hi = lo + 1;
            const __m256i index = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
            half_avx2(4, 1, w0 + at, h, 2, block, 0, _mm256_permutevar8x32_ps(s0, index), &a0);
            half_avx2(4, 1, w1 + at, h, 2, block, 0, _mm256_permutevar8x32_ps(s1, index), &a1);
            half_avx2(4, 1, w2 + at, h, 2, block, 0, _mm256_permutevar8x32_ps(s2, index), &a2);
            half_avx2(4, 1, w3 + at, h, 2, block, 0, _mm256_permutevar8x32_ps(s3, index), &a3);
        }
    }
    out[0] = int_hsum8(a0), out[1] = int_hsum8(a1), out[2] = int_hsum8(a2), out[3] = int_hsum8(a3);
}

/* The cases R = 1..7 of a switch over the activation rows, each calling the INT_ROW(1, R) of the function it
 * is expanded in (one weight row, R as a constant): the part that AVX2 and VNNI share. */
#define INT_ROWS_1_TO_7                                                                                             \
    case 1: INT_ROW(1, 1); break;                                                                                   \
    case 2: INT_ROW(1, 2); break;                                                                                   \
    case 3: INT_ROW(1, 3); break;                                                                                   \
    case 4: INT_ROW(1, 4); break;                                                                                   \
    case 5: INT_ROW(1, 5); break;                                                                                   \
    case 6: INT_ROW(1, 6); break;                                                                                   \
    case 7: INT_ROW(1, 7); break;

/* row_avx2 with the width, NW and R as constants (accumulators in registers): NW 1 to 4 with R 1, NW 1 or 2
 * with R 2, NW 1 with R up to 8. */
static void rows_avx2(int bits, int NW, int R, const uint8_t *q, const uint16_t *s, int64_t rb, int64_t K,
                      const uint8_t *xb, int64_t xrow, float *out, int64_t ldo) {
#define INT_ROW(nw, r)                                                                                              \
    (bits == 8 ? row_avx2(8, nw, r, q, s, rb, K, xb, xrow, out, ldo)                                               \
               : row_avx2(4, nw, r, q, s, rb, K, xb, xrow, out, ldo))
    if (NW == 4 && R == 1 && bits == 4 && K / INT_GROUP % block_groups(4) == 0) {
        row4_int4_avx2(q, s, rb, K, xb, out);
        return;
    }
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
        INT_ROWS_1_TO_7
    default: INT_ROW(1, 8); break;
    }
#undef INT_ROW
}

/* ---- AVX-512 VNNI path ----------------------------------------------------------------------------------------- */

#define INT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,avx2")))

/* Lane l of block c (of the VNNI_SCALES groups whose scales are widened together) takes scale c * G + l / (16 /
 * G): the indices, a table filled when the library loads, so that a block loads them rather than builds them. */
static int32_t vnni_index[2][8][16] __attribute__((aligned(64)));

__attribute__((constructor)) static void vnni_index_init(void) {
    for (int w = 0; w < 2; w++) {
        const int G = w ? 4 : 2; /* [0]: int8, [1]: int4 */
        for (int c = 0; c < VNNI_SCALES / G; c++)
            for (int l = 0; l < 16; l++) vnni_index[w][c][l] = c * G + l / (16 / G);
    }
}

static inline INT_VNNI __m512i vnni_scale_index(int bits, int c) {
    return _mm512_load_si512(vnni_index[bits == 4][c]);
}

/* out[m * ldo + i] = sum_k W[n + i, k] x[m, k] for the NW weight rows n + i (rows rb bytes apart) and the
 * activation rows m < R, x as int8_blocks laid it out (row m at xb + m * xrow); NW * R <= 16. */
static inline __attribute__((always_inline)) INT_VNNI void row_vnni(int bits, int NW, int R, const uint8_t *q,
                                                                     const uint16_t *s, int64_t rb, int64_t K,
                                                                     const uint8_t *xb, int64_t xrow, float *out,
                                                                     int64_t ldo) {
    const int G = block_groups(bits);
    const int64_t groups = K / INT_GROUP, blocks = blocks_of(bits, K), bb = block_bytes(bits);
    const int64_t gbytes = bits == 8 ? INT_GROUP : INT_GROUP / 2, ab = block_act_bytes(bits);
    __m512 acc[4][16], ws[4];
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t g = b * G, left = groups - g;
        const int c = (int)(g % VNNI_SCALES) / G;
        if (c == 0) {
            const __mmask16 m = left >= VNNI_SCALES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            for (int i = 0; i < NW; i++) ws[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s + i * groups + g));
        }
        const __m512i index = vnni_scale_index(bits, c);
#pragma GCC unroll 4
        for (int i = 0; i < NW; i++) {
            const uint8_t *w = q + i * rb + g * gbytes;
            const __m512i v = left >= G ? _mm512_loadu_si512(w)
                                        : _mm512_maskz_loadu_epi8(((__mmask64)1 << (left * gbytes)) - 1, w);
            __m512i w0, w1 = _mm512_setzero_si512();
            if (bits == 4) {
                w0 = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
            } else {
                w0 = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
            }
            const __m512 sv = _mm512_permutexvar_ps(index, ws[i]);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const uint8_t *block = xb + r * xrow + b * bb;
                __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(block + ab), w0, _mm512_loadu_si512(block));
                if (bits == 4) d = _mm512_dpbusd_epi32(d, w1, _mm512_loadu_si512(block + 64));
                const __m512 xs = _mm512_loadu_ps(block + ab + 64);
                acc[i][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), xs), sv, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = _mm512_reduce_add_ps(acc[i][r]);
}

/* row_vnni with the width, NW and R as constants: NW 1 to 4 with R 1 or 2, NW 1 or 2 with R 3 or 4, or NW 1
 * with R up to 16. */
static INT_VNNI void rows_vnni(int bits, int NW, int R, const uint8_t *q, const uint16_t *s, int64_t rb, int64_t K,
                               const uint8_t *xb, int64_t xrow, float *out, int64_t ldo) {
#define INT_ROW(nw, r)                                                                                              \
    (bits == 8 ? row_vnni(8, nw, r, q, s, rb, K, xb, xrow, out, ldo)                                               \
               : row_vnni(4, nw, r, q, s, rb, K, xb, xrow, out, ldo))
    if (NW > 1 && R <= 2) {
        if (NW == 4) { if (R == 1) INT_ROW(4, 1); else INT_ROW(4, 2); }
        else if (NW == 3) { if (R == 1) INT_ROW(3, 1); else INT_ROW(3, 2); }
        else if (R == 1) INT_ROW(2, 1);
        else INT_ROW(2, 2);
        return;
    }
    if (NW == 2) {
        if (R == 3) INT_ROW(2, 3);
        else INT_ROW(2, 4);
        return;
    }
    switch (R) {
        INT_ROWS_1_TO_7
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
    const int vnni = dsv3_int_vnni();
    /* few activation rows: NW weight rows at once, for independent sums and shared activation loads (VNNI: 4
     * for one or two rows, 2 for three or four; AVX2: 4 for one row of int4, else 2: int8 measured no faster
     * with 4 in a whole step); many: one weight row for a tile of up to 16 (8) rows */
    const int few = M <= (vnni ? 4 : 2), tile = few ? (int)M : vnni ? 16 : 8;
    const int nw = few ? (vnni ? (M <= 2 ? 4 : 2) : M == 1 && bits == 4 ? 4 : 2) : 1;
    const int64_t rb = int_row_bytes(bits, K), groups = K / INT_GROUP;
    const char *end = (const char *)q + n1 * rb;
    /* the activations rounded to int8 once per call (xb: a row every xrow bytes) */
    const int64_t xrow = blocks_of(bits, K) * block_bytes(bits);
    uint8_t *xb = (uint8_t *)malloc((size_t)(M * xrow));
    if (!xb) {
        int_rows_failed(M, y, ldy, n0, n1);
        return;
    }
    int8_blocks(bits, x, M, K, xb);
    for (const char *p = (const char *)q + n0 * rb; p < end && p < (const char *)q + n0 * rb + PF_BYTES; p += 64)
        _mm_prefetch(p, _MM_HINT_T0); /* this call's own first bytes */
    for (int64_t n = n0; n < n1; n += nw) {
        const int NW = (int)(n1 - n < nw ? n1 - n : nw);
        /* the bytes PF_BYTES on, and the scales of the rows as far on */
        const char *pf = (const char *)q + n * rb + PF_BYTES;
        if (pf >= end) pf = next ? next + (pf - end) : NULL;
        if (pf)
            for (int64_t b = 0; b < NW * rb; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        const char *spf = (const char *)(s + (n + PF_BYTES / rb) * groups);
        if (spf < (const char *)(s + n1 * groups))
            for (int64_t b = 0; b < NW * groups * 2; b += 64) _mm_prefetch(spf + b, _MM_HINT_T0);
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            const int R = (int)(M - m0 < tile ? M - m0 : tile);
            if (vnni)
                rows_vnni(bits, NW, R, q + n * rb, s + n * groups, rb, K, xb + m0 * xrow, xrow, y + m0 * ldy + n, ldy);
            else
                rows_avx2(bits, NW, R, q + n * rb, s + n * groups, rb, K, xb + m0 * xrow, xrow, y + m0 * ldy + n, ldy);
        }
    }
    free(xb);
}
