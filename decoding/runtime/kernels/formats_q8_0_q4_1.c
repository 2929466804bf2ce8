/* ragspec CPU kernels for the Q8_0 and Q4_1 formats (AVX2 + FMA + F16C; AVX-512 VNNI and the AMX int8 tiles where
 * compiled for them), the formats a safetensors model is quantized to at load; matmul.c's dispatch hands them here.
 *
 * Weights stay in the GGUF block formats they were stored in (or that they were quantized to at load):
 *   Q8_0: blocks of 32 weights = fp16 scale d + 32 int8 q            (34 bytes),  w = d * q
 *   Q4_1: blocks of 32 weights = fp16 scale d + fp16 min m + 16 bytes (20 bytes), w = d * q + m, q in 0..15
 *         (byte t holds weight t in its low nibble and weight t + 16 in its high nibble)
 * Activations are quantized per row and per block of 32 to int8 (rows.c: d_x = max|x| / 127, q_x = round(x / d_x)),
 * so a block's dot product is an exact integer sum (maddubs + madd), scaled once in fp32:
 *   Q8_0: d_w d_x sum(q_w q_x);   Q4_1: d_w d_x sum(q_w q_x) + m_w (d_x sum(q_x)).
 *
 * The kernels read them repacked 8 rows interleaved (same bytes, see "Packed weights" below), so one
 * integer instruction serves 8 output rows and the fp32 scale work happens once per 8 outputs.
 *
 * Batch invariance, as for the fp32 kernels: an output element is computed by the same operations whatever
 * the number of rows, their order, the tile they land in or the thread: the activation row is quantized by
 * itself; a block's integer sum is exact; each output's fp32 sum runs over the blocks in order
 * (acc = fma(isum, d_w d_x, acc), plus m_w s_x for Q4_1) in its own lane. A group's weights are unpacked once
 * per tile and reused by every activation row of it, so a verify over several rows costs far less than that
 * many decode steps.
 *
 * Every kernel here is a "part": it contains orphaned `omp for` loops and runs inside a parallel region,
 * so the whole forward of a layer shares one region (rs_* entry points open one for a single call).
 *
 * ISA paths (one build each, chosen at load): AVX2 sums a block's byte products with maddubs (pairs into int16)
 * and madd (int16 pairs into int32); AVX-512 VNNI (built with -mavx512vnni -mavx512vl) adds the same four
 * byte products into each int32 lane with one dpbusd, on 512-bit registers holding two groups (16 outputs); AMX (built with -mamx-int8 too) computes the block sums
 * of 16 activation rows x 16 weight rows with one tdpbssd (see "the AMX path" below). The integer sums are
 * exact and equal, and everything after them is the same fp32 code, so every path gives the same bits.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "api.h"
#include "formats.h"
#include "rows.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* A block's integer dot products: DOT4(acc, u, s) adds, per 32-bit lane, the four products of u's unsigned and
   s's signed bytes; FINISH turns the accumulator into int32 lanes. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#if defined(__AMX_INT8__)
#define RS_ISA_NAME "amx" /* the tiles for the linear layers (below), VNNI where vectors remain */
#else
#define RS_ISA_NAME "avx512"
#endif
#define DOT4(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DOT4_WIDE(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define FINISH(acc) (acc)
#else
#define RS_ISA_NAME "avx2"
/* int16 lanes: |a lane's sum| stays below 2^15 for the Q4_1 blocks summed into it (see the group kernel) */
#define DOT4(acc, u, s) _mm256_add_epi16((acc), _mm256_maddubs_epi16((u), (s)))
/* Q8_0: |q_w| reaches 128, so each chunk's pairs are widened to int32 at once */
#define DOT4_WIDE(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), ones))
#define FINISH(acc) _mm256_madd_epi16((acc), ones)
#endif

/* Which ISA path this library was built for (the loader checks it against the path it asked for). */
const char *rs_isa(void) { return RS_ISA_NAME; }

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }


/* ---- quantized linear -------------------------------------------------------------------------------- */

/* Packed ("x8") weights: rows in groups of 8 (the last group padded with zero rows); per group and block of
 * 32 weights one record, the GGUF bytes of the group's 8 blocks rearranged (no value changes):
 *   Q4_1 (160 bytes): d[8] fp16, m[8] fp16, then 4 chunks of 32 bytes: chunk cc holds at bytes 4j..4j+3 row
 *         j's GGUF bytes qs[4cc .. 4cc+4): low nibbles = weights 4cc+t, high nibbles = weights 16+4cc+t;
 *   Q8_0 (272 bytes): d[8] fp16, then 8 chunks of 32 bytes: chunk c holds at bytes 4j..4j+3 row j's int8
 *         weights 4c..4c+3.
 * One maddubs of a chunk against 4 activations broadcast to every lane adds 4 products to each of the 8 rows'
 * sums, so a block's 8 integer dot products end in 8 lanes and its scales apply to all 8 at once. */

static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* For MB activation rows x one group of 8 weight rows: acc[i] lanes += (sum of block products) * d_w * d_x,
   block by block in order; mins[i] lanes += m_w * s_x (Q4_1). Integer block sums are exact (Q4_1: |one
   lane's int16 sum| <= 8 * 2 * 15 * 127 < 2^15; Q8_0: widened to int32 per chunk). */
#define GROUP_KERNEL(MB)                                                                                      \
    static void q41_group_##MB(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *w,   \
                               __m256 *acc, __m256 *mins) {                                                   \
        const int nb = K / QK;                                                                                \
        const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                              \
        (void)ones; /* the AVX2 path's int16 -> int32 widening */                                             \
        for (int b = 0; b < nb; ++b) {                                                                        \
            const uint8_t *rec = w + (long)b * REC_Q4_1;                                                       \
            __m256i sums[MB], highs[MB]; /* few rows: high nibbles on chains of their own (dpbusd's latency) */ \
            for (int i = 0; i < MB; ++i) sums[i] = highs[i] = _mm256_setzero_si256();                         \
            for (int cc = 0; cc < 4; ++cc) {                                                                  \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 32 + 32 * cc));                \
                const __m256i lo = _mm256_and_si256(raw, low);                                                \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);                          \
                for (int i = 0; i < MB; ++i) {                                                                \
                    const int8_t *xb = xq + (long)i * K + b * QK;                                             \
                    sums[i] = DOT4(sums[i], lo, bcast4(xb + 4 * cc));                                         \
                    if (MB <= 2)                                                                              \
                        highs[i] = DOT4(highs[i], hi, bcast4(xb + 16 + 4 * cc));                              \
                    else                                                                                      \
                        sums[i] = DOT4(sums[i], hi, bcast4(xb + 16 + 4 * cc));                                \
                }                                                                                             \
            }                                                                                                 \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));                         \
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));                  \
            for (int i = 0; i < MB; ++i) {                                                                    \
                const __m256i whole = MB <= 2 ? _mm256_add_epi32(FINISH(sums[i]), FINISH(highs[i])) : FINISH(sums[i]); \
                const __m256 isum = _mm256_cvtepi32_ps(whole);                                                \
                acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(long)i * nb + b])), acc[i]); \
                mins[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[(long)i * nb + b]), mins[i]);                 \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    static void q80_group_##MB(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *w,   \
                               __m256 *acc, __m256 *mins) {                                                   \
        (void)xs, (void)mins;                                                                                 \
        const int nb = K / QK;                                                                                \
        const __m256i ones = _mm256_set1_epi16(1);                                                            \
        (void)ones;                                                                                           \
        for (int b = 0; b < nb; ++b) {                                                                        \
            const uint8_t *rec = w + (long)b * REC_Q8_0;                                                       \
            __m256i s32[MB], odd[MB]; /* few rows: odd chunks on chains of their own */                     \
            for (int i = 0; i < MB; ++i) s32[i] = odd[i] = _mm256_setzero_si256();                            \
            for (int c = 0; c < 8; ++c) {                                                                     \
                const __m256i wc = _mm256_loadu_si256((const __m256i *)(rec + 16 + 32 * c));                  \
                const __m256i aw = _mm256_sign_epi8(wc, wc); /* |q_w| as u8 (-128 -> 128) */                  \
                for (int i = 0; i < MB; ++i) {                                                                \
                    const __m256i xv = _mm256_sign_epi8(bcast4(xq + (long)i * K + b * QK + 4 * c), wc);       \
                    if (MB <= 2 && (c & 1))                                                                   \
                        odd[i] = DOT4_WIDE(odd[i], aw, xv);                                                   \
                    else                                                                                      \
                        s32[i] = DOT4_WIDE(s32[i], aw, xv);                                                   \
                }                                                                                             \
            }                                                                                                 \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));                         \
            for (int i = 0; i < MB; ++i)                                                                      \
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s32[i], odd[i])),                \
                                         _mm256_mul_ps(dw, _mm256_set1_ps(xd[(long)i * nb + b])), acc[i]);    \
        }                                                                                                     \
    }

GROUP_KERNEL(1)
GROUP_KERNEL(2)
GROUP_KERNEL(3)
GROUP_KERNEL(4)
GROUP_KERNEL(5)
GROUP_KERNEL(6)
#if defined(__AVX512VL__) /* 32 vector registers: a tile's sums and scales stay in registers up to 8 rows */
GROUP_KERNEL(7)
GROUP_KERNEL(8)
#define GROUP_ROWS 8 /* activation rows per tile of one group */
#define GROUP_MORE , q41_group_7, q41_group_8
#define GROUP_MORE_Q80 , q80_group_7, q80_group_8
#else
#define GROUP_ROWS 6
#define GROUP_MORE
#define GROUP_MORE_Q80
#endif

typedef void (*group_fn)(const int8_t *, const float *, const float *, int, const uint8_t *, __m256 *, __m256 *);
static const group_fn Q41_GROUP[GROUP_ROWS + 1] = {0, q41_group_1, q41_group_2, q41_group_3, q41_group_4, q41_group_5,
                                                   q41_group_6 GROUP_MORE};
static const group_fn Q80_GROUP[GROUP_ROWS + 1] = {0, q80_group_1, q80_group_2, q80_group_3, q80_group_4, q80_group_5,
                                                   q80_group_6 GROUP_MORE_Q80};

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* ---- 512-bit vectors: a pair of groups (16 weight rows) per register ------------------------------------------
 * The same records, two groups side by side in one register (group g in lanes 0..7, g + 1 in 8..15): one dpbusd of
 * 64 products serves 16 output rows, and the scale work runs once per 16 outputs. Per lane the operations are the
 * 8-lane kernel's exactly (the block's exact integer sum, then acc = fma(isum, d_w d_x, acc), mins = fma(m_w, s_x,
 * mins) in block order), so this path keeps the baseline's bits. */
#define PAIRS 1

static inline __m512i concat256(const uint8_t *a, const uint8_t *b) {
    const __m256i hi = b ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)), hi, 1);
}

static inline __m512 halves_f16(const uint8_t *a, const uint8_t *b) {
    const __m128i hi = b ? _mm_loadu_si128((const __m128i *)b) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)), hi, 1));
}

static inline __m512i bcast4z(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
}

#define PAIR_KERNEL(MB)                                                                                       \
    static void q41_pair_##MB(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *w0,  \
                              const uint8_t *w1, __m512 *acc, __m512 *mins) {                                 \
        const int nb = K / QK;                                                                                \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                           \
        for (int b = 0; b < nb; ++b) {                                                                        \
            const uint8_t *r0 = w0 + (long)b * REC_Q4_1, *r1 = w1 + (long)b * REC_Q4_1;                         \
            __m512i sums[MB];                                                                                 \
            for (int i = 0; i < MB; ++i) sums[i] = _mm512_setzero_si512();                                    \
            _Pragma("GCC unroll 4")                                                                           \
            for (int cc = 0; cc < 4; ++cc) {                                                                  \
                const __m512i raw = concat256(r0 + 32 + 32 * cc, r1 + 32 + 32 * cc);                          \
                const __m512i lo = _mm512_and_si512(raw, low);                                                \
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);                          \
                for (int i = 0; i < MB; ++i) {                                                                \
                    const int8_t *xb = xq + (long)i * K + b * QK;                                             \
                    sums[i] = _mm512_dpbusd_epi32(sums[i], lo, bcast4z(xb + 4 * cc));                         \
                    sums[i] = _mm512_dpbusd_epi32(sums[i], hi, bcast4z(xb + 16 + 4 * cc));                    \
                }                                                                                             \
            }                                                                                                 \
            const __m512 dw = halves_f16(r0, r1), mw = halves_f16(r0 + 16, r1 + 16);                          \
            for (int i = 0; i < MB; ++i) {                                                                    \
                const __m512 isum = _mm512_cvtepi32_ps(sums[i]);                                              \
                acc[i] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(long)i * nb + b])), acc[i]); \
                mins[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[(long)i * nb + b]), mins[i]);                 \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    static void q80_pair_##MB(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *w0,  \
                              const uint8_t *w1, __m512 *acc, __m512 *mins) {                                 \
        (void)xs, (void)mins;                                                                                 \
        const int nb = K / QK;                                                                                \
        for (int b = 0; b < nb; ++b) {                                                                        \
            const uint8_t *r0 = w0 + (long)b * REC_Q8_0, *r1 = w1 + (long)b * REC_Q8_0;                         \
            __m512i s32[MB];                                                                                  \
            for (int i = 0; i < MB; ++i) s32[i] = _mm512_setzero_si512();                                     \
            _Pragma("GCC unroll 8")                                                                           \
            for (int c = 0; c < 8; ++c) {                                                                     \
                const __m512i wc = concat256(r0 + 16 + 32 * c, r1 + 16 + 32 * c);                             \
                const __m512i aw = _mm512_abs_epi8(wc); /* |q_w| as u8 (-128 -> 128), as the sign trick */     \
                const __mmask64 neg = _mm512_movepi8_mask(wc);                                                \
                for (int i = 0; i < MB; ++i) {                                                                \
                    const __m512i x4 = bcast4z(xq + (long)i * K + b * QK + 4 * c);                            \
                    const __m512i xv = _mm512_mask_sub_epi8(x4, neg, _mm512_setzero_si512(), x4);             \
                    s32[i] = _mm512_dpbusd_epi32(s32[i], aw, xv);                                             \
                }                                                                                             \
            }                                                                                                 \
            const __m512 dw = halves_f16(r0, r1);                                                             \
            for (int i = 0; i < MB; ++i)                                                                      \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i]),                                          \
                                         _mm512_mul_ps(dw, _mm512_set1_ps(xd[(long)i * nb + b])), acc[i]);    \
        }                                                                                                     \
    }

PAIR_KERNEL(1)
PAIR_KERNEL(2)
PAIR_KERNEL(3)
PAIR_KERNEL(4)
PAIR_KERNEL(5)
PAIR_KERNEL(6)
PAIR_KERNEL(7)
PAIR_KERNEL(8)

#define PAIR_ROWS 8 /* 32 registers: a tile's sums, the chunk and its nibbles stay in registers */
typedef void (*pair_fn)(const int8_t *, const float *, const float *, int, const uint8_t *, const uint8_t *, __m512 *,
                        __m512 *);
static const pair_fn Q41_PAIR[PAIR_ROWS + 1] = {0, q41_pair_1, q41_pair_2, q41_pair_3, q41_pair_4, q41_pair_5, q41_pair_6,
                                                 q41_pair_7, q41_pair_8};
static const pair_fn Q80_PAIR[PAIR_ROWS + 1] = {0, q80_pair_1, q80_pair_2, q80_pair_3, q80_pair_4, q80_pair_5, q80_pair_6,
                                                 q80_pair_7, q80_pair_8};

/* Weight groups g, g + 1 for every activation row (tiles of up to PAIR_ROWS rows): y columns 8g .. 8g + 15. */
static void qpair(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                  long ldg, int N, int g, float *y, long ldy, const float *bias, const float *res, long ldr) {
    const int nb = K / QK, n0 = 8 * g, valid = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0, tiles = (M + PAIR_ROWS - 1) / PAIR_ROWS, mb; m < M; m += mb, --tiles) {
        mb = even_tile(M - m, tiles);
        __m512 acc[PAIR_ROWS], mins[PAIR_ROWS];
        for (int i = 0; i < PAIR_ROWS; ++i) acc[i] = mins[i] = _mm512_setzero_ps();
        (wtype == W_Q4_1 ? Q41_PAIR : Q80_PAIR)[mb](xq + (long)m * K, xd + (long)m * nb, xs + (long)m * nb, K,
                                                    w + g * ldg, w + (g + 1) * ldg, acc, mins);
        for (int i = 0; i < mb; ++i) {
            __m512 v = _mm512_add_ps(acc[i], mins[i]);
            if (bias) v = _mm512_add_ps(v, bv);
            if (res) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, res + (long)(m + i) * ldr + n0), v);
            _mm512_mask_storeu_ps(y + (long)(m + i) * ldy + n0, mask, v);
        }
    }
}
#else
#define PAIRS 0
#endif

/* Weight groups [g0, g1) for every activation row (tiles of up to GROUP_ROWS rows, of even size: the group's records
   stay in L1; pairs of groups on 512-bit vectors where built for them). */
static void qgroups(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                    long ldg, int N, int g0, int g1, float *y, long ldy, const float *bias, const float *res,
                    long ldr) {
    const int nb = K / QK;
#if PAIRS /* where the table says (formats.h: measured per CPU; the same bits either way) */
    for (; rs_pairs(M) && g0 + 1 < g1; g0 += 2)
        qpair(xq, xd, xs, M, K, w, wtype, ldg, N, g0, y, ldy, bias, res, ldr);
#endif
    for (int g = g0; g < g1; ++g) {
        const int n0 = 8 * g, valid = N - n0 < 8 ? N - n0 : 8;
        for (int m = 0, tiles = (M + GROUP_ROWS - 1) / GROUP_ROWS, mb; m < M; m += mb, --tiles) {
            mb = even_tile(M - m, tiles);
            __m256 acc[GROUP_ROWS], mins[GROUP_ROWS];
            for (int i = 0; i < GROUP_ROWS; ++i) acc[i] = mins[i] = _mm256_setzero_ps();
            (wtype == W_Q4_1 ? Q41_GROUP : Q80_GROUP)[mb](xq + (long)m * K, xd + (long)m * nb, xs + (long)m * nb,
                                                          K, w + g * ldg, acc, mins);
            for (int i = 0; i < mb; ++i)
                store_tile8(_mm256_add_ps(acc[i], mins[i]), bias ? bias + n0 : 0,
                            res ? res + (long)(m + i) * ldr + n0 : 0, y + (long)(m + i) * ldy + n0, valid);
        }
    }
}

#define GROUPS_PER_TASK 4 /* 32 weight rows per task */

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
/* ---- the AMX path: a block's integer dot products on the tiles ---------------------------------------------
 * Per pair of 8-row groups (16 weight rows) and tile of up to 16 activation rows, one TDPBSSD per block of 32
 * multiplies the activation rows' int8 values (tile A: rows of xq, 32 bytes each) by the 16 weight rows (tile B:
 * 8 rows of 64 bytes, row kk holding weights 4kk..4kk+3 of each of the 16 rows: the x8 records' chunks of two
 * groups side by side, Q4_1 nibbles masked out to bytes 0..15). C[n][j] is then exactly the integer sum the
 * other paths compute for activation row n and weight row j, and everything after it is their fp32 code on
 * 16 lanes: acc = fma(isum, d_w d_x, acc) per block in order, mins = fma(m_w, s_x, mins) per block in order,
 * acc + mins (+ bias) (+ res). So this path gives the same bits as avx2 / avx512, and a row's result depends
 * on nothing but its own activations. */
#include <stdlib.h>

/* Linux lets a process use the tiles' 8 KB of state only after asking (arch_prctl ARCH_REQ_XCOMP_PERM,
   XTILEDATA): the loader asks (kernels.tiles_permitted) before this library runs. */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles for blocks b (0 C, 1 A, 2 B) and b + 1 (3 C, 4 A, 5 B) in flight together; A and C have `rows` rows (16, or
   M when M < 16: the activation scratch holds whole tiles of 16 rows, the rows past M are never read back). */
static void amx_configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = rows, c.colsb[t] = 64;
        c.rows[t + 1] = rows, c.colsb[t + 1] = QK;
        c.rows[t + 2] = QK / 4, c.colsb[t + 2] = 64;
    }
    /* gcc 12's _tile_loadconfig tells the compiler it reads 8 of the 64 bytes, so the stores above could be
       dropped as dead: make the whole struct visible to memory first */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* Per-thread unpacked weights of one pair: per block a B tile (512 bytes), d_w and m_w (16 floats each). */
#define B_BYTES (QK / 4 * 64)
#define PAIR_BYTES (B_BYTES + 2 * 16 * 4)
static __thread uint8_t *pair_buf;
static __thread long pair_cap;

static uint8_t *pair_scratch(int nb) {
    if (pair_cap < (long)nb * PAIR_BYTES) {
        free(pair_buf);
        pair_cap = (long)nb * PAIR_BYTES;
        pair_buf = aligned_alloc(64, pair_cap);
    }
    return pair_buf;
}

/* The records of groups g0 and g1 (g1 null: a lone last group, zeros beside it) -> nb blocks of B tile, d, m. */
static void unpack_pair(const uint8_t *g0, const uint8_t *g1, int wtype, int nb, uint8_t *out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; ++b) {
        uint8_t *bt = out + (long)b * PAIR_BYTES;
        float *dm = (float *)(bt + B_BYTES);
        if (wtype == W_Q4_1) {
            const uint8_t *r0 = g0 + (long)b * REC_Q4_1, *r1 = g1 ? g1 + (long)b * REC_Q4_1 : 0;
            for (int cc = 0; cc < 4; ++cc) {
                const __m512i raw = concat256(r0 + 32 + 32 * cc, r1 ? r1 + 32 + 32 * cc : 0);
                _mm512_store_si512((__m512i *)(bt + 64 * cc), _mm512_and_si512(raw, low));
                _mm512_store_si512((__m512i *)(bt + 64 * (4 + cc)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
            }
            _mm512_store_ps(dm, halves_f16(r0, r1));
            _mm512_store_ps(dm + 16, halves_f16(r0 + 16, r1 ? r1 + 16 : 0));
        } else {
            const uint8_t *r0 = g0 + (long)b * REC_Q8_0, *r1 = g1 ? g1 + (long)b * REC_Q8_0 : 0;
            for (int c = 0; c < 8; ++c)
                _mm512_store_si512((__m512i *)(bt + 64 * c), concat256(r0 + 16 + 32 * c, r1 ? r1 + 16 + 32 * c : 0));
            _mm512_store_ps(dm, halves_f16(r0, r1));
        }
    }
}

/* acc[n] += C[n] d_w d_x[n] for one block's int32 sums c (row n of C: activation row m0 + n, 16 weight rows). */
#define AMX_SCALE(c, bt, b)                                                                                         \
    do {                                                                                                            \
        const __m512 dw = _mm512_load_ps((const float *)((bt) + B_BYTES));                                          \
        for (int n = 0; n < R; ++n)                                                                                 \
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const __m512i *)((c) + 16 * n))),        \
                                     _mm512_mul_ps(dw, _mm512_set1_ps(xd[(long)(m0 + n) * nb + (b)])), acc[n]);     \
    } while (0)

/* R (1..16) activation rows from m0 (tile A reads the configured rows) x one unpacked pair -> y columns
   n0..n0+valid. Two blocks at a time on separate tiles, so one block's products overlap the other's. */
static inline __attribute__((always_inline)) void amx_rows(
    const int R, const int8_t *xq, const float *xd, const float *xs, int m0, int K, const uint8_t *pair, int wtype,
    int n0, int valid, float *y, long ldy, const float *bias, const float *res, long ldr) {
    const int nb = K / QK;
    /* sums of blocks b, b + 1 in c[b / 2 % 2]: a pair is scaled one iteration after its tiles are stored, so
       the vector loads never wait for the tile stores just issued (the scaling stays in block order) */
    int32_t c[2][2][16 * 16] __attribute__((aligned(64)));
    const int8_t *xa = xq + (long)m0 * K;
    __m512 acc[16];
    for (int n = 0; n < R; ++n) acc[n] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *bt0 = pair + (long)b * PAIR_BYTES, *bt1 = bt0 + PAIR_BYTES;
        int32_t *c0 = c[b / 2 % 2][0], *c1 = c[b / 2 % 2][1];
        _tile_loadd(2, bt0, 64);
        _tile_loadd(1, xa + b * QK, K);
        _tile_zero(0);
        _tile_loadd(5, bt1, 64);
        _tile_loadd(4, xa + (b + 1) * QK, K);
        _tile_zero(3);
        _tile_dpbssd(0, 1, 2);
        _tile_dpbssd(3, 4, 5);
        _tile_stored(0, c0, 64);
        _tile_stored(3, c1, 64);
        if (b >= 2) {
            const uint8_t *pt0 = bt0 - 2 * PAIR_BYTES, *pt1 = pt0 + PAIR_BYTES;
            AMX_SCALE(c[b / 2 % 2 ^ 1][0], pt0, b - 2);
            AMX_SCALE(c[b / 2 % 2 ^ 1][1], pt1, b - 1);
        }
    }
    if (b >= 2) {
        const uint8_t *pt0 = pair + (long)(b - 2) * PAIR_BYTES, *pt1 = pt0 + PAIR_BYTES;
        AMX_SCALE(c[b / 2 % 2 ^ 1][0], pt0, b - 2);
        AMX_SCALE(c[b / 2 % 2 ^ 1][1], pt1, b - 1);
    }
    if (b < nb) {
        int32_t *c0 = c[0][0];
        const uint8_t *bt0 = pair + (long)b * PAIR_BYTES;
        _tile_loadd(2, bt0, 64);
        _tile_loadd(1, xa + b * QK, K);
        _tile_zero(0);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, c0, 64);
        AMX_SCALE(c0, bt0, b);
    }
    if (wtype == W_Q4_1) {
        __m512 mins[16];
        for (int n = 0; n < R; ++n) mins[n] = _mm512_setzero_ps();
        for (b = 0; b < nb; ++b) {
            const __m512 mw = _mm512_load_ps((const float *)(pair + (long)b * PAIR_BYTES + B_BYTES) + 16);
            for (int n = 0; n < R; ++n)
                mins[n] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[(long)(m0 + n) * nb + b]), mins[n]);
        }
        for (int n = 0; n < R; ++n) acc[n] = _mm512_add_ps(acc[n], mins[n]);
    }
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int n = 0; n < R; ++n) {
        __m512 v = acc[n];
        if (bias) v = _mm512_add_ps(v, bv);
        if (res) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, res + (long)(m0 + n) * ldr + n0), v);
        _mm512_mask_storeu_ps(y + (long)(m0 + n) * ldy + n0, mask, v);
    }
}

/* Weight groups [g0, g1) (g0 even) for every activation row, a pair of groups at a time. */
static void amx_groups(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                       long ldg, int N, int g0, int g1, float *y, long ldy, const float *bias, const float *res,
                       long ldr) {
    const int nb = K / QK, groups = (N + 7) / 8;
    uint8_t *pair = pair_scratch(nb);
    for (int g = g0; g < g1; g += 2) {
        unpack_pair(w + g * ldg, g + 1 < groups ? w + (g + 1) * ldg : 0, wtype, nb, pair);
        const int n0 = 8 * g, valid = N - n0 < 16 ? N - n0 : 16;
        for (int m0 = 0; m0 < M; m0 += 16) {
            switch (M - m0 < 16 ? M - m0 : 16) {
#define AMX_CASE(R) \
    case R: amx_rows(R, xq, xd, xs, m0, K, pair, wtype, n0, valid, y, ldy, bias, res, ldr); break;
                AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7) AMX_CASE(8)
                AMX_CASE(9) AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13) AMX_CASE(14) AMX_CASE(15)
                AMX_CASE(16)
#undef AMX_CASE
            }
        }
    }
}
#define AMX 1
/* Fewer rows go to the vector kernel: a tile's weights are unpacked per call, which only pays over several rows
   (the two give the same bits, so the choice never changes a result). */
#define AMX_MIN_ROWS 8
#else
#define AMX 0
#endif

/* qmatmul_part for Q8_0 and Q4_1 (below): the tiles where they pay, else the vector kernels. */
void q8_q41_matmul_part(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w,
                        int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res, long ldr) {
    const int groups = (N + 7) / 8, tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
#if AMX
    if (M >= AMX_MIN_ROWS) {
        /* a last tile of fewer than AMX_MIN_ROWS rows costs a whole tile's work: those rows go to the vector
           kernel, on the task's weights just read (the same bits either way) */
        const int rest = M > 16 && M % 16 < AMX_MIN_ROWS ? M % 16 : 0, tiled = M - rest, nb = K / QK;
        amx_configure(tiled < 16 ? tiled : 16);
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; ++t) {
            const int g0 = t * GROUPS_PER_TASK, g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
            amx_groups(xq, xd, xs, tiled, K, w, wtype, ldg, N, g0, g1, y, ldy, bias, res, ldr);
            if (rest)
                qgroups(xq + (long)tiled * K, xd + (long)tiled * nb, xs + (long)tiled * nb, rest, K, w, wtype, ldg, N,
                        g0, g1, y + (long)tiled * ldy, ldy, bias, res ? res + (long)tiled * ldr : 0, ldr);
        }
        _tile_release();
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        const int g0 = t * GROUPS_PER_TASK, g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
        qgroups(xq, xd, xs, M, K, w, wtype, ldg, N, g0, g1, y, ldy, bias, res, ldr);
    }
}

/* ---- dequantization (embedding rows, references) -------------------------------------------------------- */

void q8_q41_dequant_row(const uint8_t *group, int wtype, int K, int j, float *out) {
    for (int b = 0; b < K / QK; ++b) {
        if (wtype == W_Q4_1) {
            const uint8_t *rec = group + (long)b * REC_Q4_1;
            const float d = h2f(((const uint16_t *)rec)[j]), m = h2f(((const uint16_t *)(rec + 16))[j]);
            for (int cc = 0; cc < 4; ++cc)
                for (int t = 0; t < 4; ++t) {
                    const uint8_t byte = rec[32 + 32 * cc + 4 * j + t];
                    out[b * QK + 4 * cc + t] = d * (float)(byte & 0x0F) + m;
                    out[b * QK + 16 + 4 * cc + t] = d * (float)(byte >> 4) + m;
                }
        } else {
            const uint8_t *rec = group + (long)b * REC_Q8_0;
            const float d = h2f(((const uint16_t *)rec)[j]);
            for (int c = 0; c < 8; ++c)
                for (int t = 0; t < 4; ++t)
                    out[b * QK + 4 * c + t] = d * (float)((const int8_t *)rec)[16 + 32 * c + 4 * j + t];
        }
    }
}
