/* ragspec CPU kernels on quantized weights (AVX2 + FMA + F16C; AVX-512 VNNI and the AMX int8 tiles where compiled
 * for them): the lean Llama forward's building blocks.
 *
 * Weights stay in the GGUF block formats they were stored in (or that they were quantized to at load):
 *   Q8_0: blocks of 32 weights = fp16 scale d + 32 int8 q            (34 bytes),  w = d * q
 *   Q4_1: blocks of 32 weights = fp16 scale d + fp16 min m + 16 bytes (20 bytes), w = d * q + m, q in 0..15
 *         (byte t holds weight t in its low nibble and weight t + 16 in its high nibble)
 * Activations are quantized per row and per block of 32 to int8 (d_x = max|x| / 127, q_x = round(x / d_x)),
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

#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
enum { W_Q8_0 = 1, W_Q4_1 = 2, W_F16 = 11 }; /* the K-quants, other 32-blocks and parts: kquant_kernels.c; F16, BF16,
                                                F32 (W_F16 and on): float_kernels.c */
void kq_matmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                    const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                    long ldr);
void kq_dequant_row(const uint8_t *group, int wtype, int K, int j, float *out);
void fl_matmul_part(const float *x, long ldx, int M, int K, const uint8_t *w, int wtype, long ldg, int N, float *y,
                    long ldy, const float *bias, const float *res, long ldr);
void fl_dequant_row(const uint8_t *group, int wtype, long ldg, int K, int j, float *out);

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


/* ---- activations ------------------------------------------------------------------------------------- */

/* Row x[0..K) (K a multiple of 32) -> q[K] int8, d[K/32] scales, s[K/32] = d * sum(q) per block. */
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K / QK; ++b) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(db != 0.0f ? 127.0f / amax : 0.0f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)); /* round to nearest even */
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, perm));
        d[b] = db;
        s[b] = db * (float)_mm_cvtsi128_si32(s4);
    }
}

/* ---- quantized linear -------------------------------------------------------------------------------- */

/* Packed ("x8") weights: rows in groups of 8 (the last group padded with zero rows); per group and block of
 * 32 weights one record, the GGUF bytes of the group's 8 blocks rearranged (no value changes):
 *   Q4_1 (160 bytes): d[8] fp16, m[8] fp16, then 4 chunks of 32 bytes: chunk cc holds at bytes 4j..4j+3 row
 *         j's GGUF bytes qs[4cc .. 4cc+4): low nibbles = weights 4cc+t, high nibbles = weights 16+4cc+t;
 *   Q8_0 (272 bytes): d[8] fp16, then 8 chunks of 32 bytes: chunk c holds at bytes 4j..4j+3 row j's int8
 *         weights 4c..4c+3.
 * One maddubs of a chunk against 4 activations broadcast to every lane adds 4 products to each of the 8 rows'
 * sums, so a block's 8 integer dot products end in 8 lanes and its scales apply to all 8 at once. */
#define REC_Q41 160
#define REC_Q80 272

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
            const uint8_t *rec = w + (long)b * REC_Q41;                                                       \
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
            const uint8_t *rec = w + (long)b * REC_Q80;                                                       \
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

typedef void (*group_fn)(const int8_t *, const float *, const float *, int, const uint8_t *, __m256 *, __m256 *);
static const group_fn Q41_GROUP[5] = {0, q41_group_1, q41_group_2, q41_group_3, q41_group_4};
static const group_fn Q80_GROUP[5] = {0, q80_group_1, q80_group_2, q80_group_3, q80_group_4};

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
            const uint8_t *r0 = w0 + (long)b * REC_Q41, *r1 = w1 + (long)b * REC_Q41;                         \
            __m512i sums[MB];                                                                                 \
            for (int i = 0; i < MB; ++i) sums[i] = _mm512_setzero_si512();                                    \
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
            const uint8_t *r0 = w0 + (long)b * REC_Q80, *r1 = w1 + (long)b * REC_Q80;                         \
            __m512i s32[MB];                                                                                  \
            for (int i = 0; i < MB; ++i) s32[i] = _mm512_setzero_si512();                                     \
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

#define PAIR_ROWS 6
#define PAIR_MIN_ROWS 6 /* qgroups: fewer activation rows go one group at a time */
typedef void (*pair_fn)(const int8_t *, const float *, const float *, int, const uint8_t *, const uint8_t *, __m512 *,
                        __m512 *);
static const pair_fn Q41_PAIR[PAIR_ROWS + 1] = {0, q41_pair_1, q41_pair_2, q41_pair_3, q41_pair_4, q41_pair_5, q41_pair_6};
static const pair_fn Q80_PAIR[PAIR_ROWS + 1] = {0, q80_pair_1, q80_pair_2, q80_pair_3, q80_pair_4, q80_pair_5, q80_pair_6};

/* Weight groups g, g + 1 for every activation row (tiles of PAIR_ROWS rows): y columns 8g .. 8g + 15. */
static void qpair(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                  long ldg, int N, int g, float *y, long ldy, const float *bias, const float *res, long ldr) {
    const int nb = K / QK, n0 = 8 * g, valid = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; m += PAIR_ROWS) {
        const int mb = M - m < PAIR_ROWS ? M - m : PAIR_ROWS;
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

/* Weight groups [g0, g1) for every activation row (tiles of 4 rows: the group's records stay in L1; pairs of groups
   on 512-bit vectors where built for them). */
static void qgroups(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                    long ldg, int N, int g0, int g1, float *y, long ldy, const float *bias, const float *res,
                    long ldr) {
    const int nb = K / QK;
#if PAIRS /* from PAIR_MIN_ROWS rows on: a pair reads two streams of weights at once, slower for a row or two read
            from memory (docs/benchmarks.md; the same bits either way, so the choice never changes a result) */
    for (; M >= PAIR_MIN_ROWS && g0 + 1 < g1; g0 += 2)
        qpair(xq, xd, xs, M, K, w, wtype, ldg, N, g0, y, ldy, bias, res, ldr);
#endif
    for (int g = g0; g < g1; ++g) {
        const int n0 = 8 * g, valid = N - n0 < 8 ? N - n0 : 8;
        for (int m = 0; m < M; m += 4) {
            const int mb = M - m < 4 ? M - m : 4;
            __m256 acc[4], mins[4];
            for (int i = 0; i < 4; ++i) acc[i] = mins[i] = _mm256_setzero_ps();
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
            const uint8_t *r0 = g0 + (long)b * REC_Q41, *r1 = g1 ? g1 + (long)b * REC_Q41 : 0;
            for (int cc = 0; cc < 4; ++cc) {
                const __m512i raw = concat256(r0 + 32 + 32 * cc, r1 ? r1 + 32 + 32 * cc : 0);
                _mm512_store_si512((__m512i *)(bt + 64 * cc), _mm512_and_si512(raw, low));
                _mm512_store_si512((__m512i *)(bt + 64 * (4 + cc)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
            }
            _mm512_store_ps(dm, halves_f16(r0, r1));
            _mm512_store_ps(dm + 16, halves_f16(r0 + 16, r1 ? r1 + 16 : 0));
        } else {
            const uint8_t *r0 = g0 + (long)b * REC_Q80, *r1 = g1 ? g1 + (long)b * REC_Q80 : 0;
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

/* Quantize x [M, K] into the scratch (xq: M*K int8, xd / xs: M*K/32 floats each). */
void quantize_part(const float *x, long ldx, int M, int K, int8_t *xq, float *xd, float *xs) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) quantize_row(x + m * ldx, K, xq + (long)m * K, xd + (long)m * (K / QK), xs + (long)m * (K / QK));
}

/* y[M, N] = x @ w^T (+ bias) (+ res): the activations x [M, K] (ldx floats a row) already quantized by quantize_part
   into xq / xd / xs, which the quantized formats read (the float formats read x); w packed, ldg bytes per group of 8
   rows. */
void qmatmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                  const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                  long ldr) {
    if (wtype >= W_F16 && wtype < 16) {
        fl_matmul_part(x, ldx, M, K, w, wtype, ldg, N, y, ldy, bias, res, ldr);
        return;
    }
    if (wtype > W_Q4_1) {
        kq_matmul_part(x, ldx, xq, xd, xs, M, K, w, wtype, ldg, N, y, ldy, bias, res, ldr);
        return;
    }
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

/* y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias) (+ res, which may alias y): one call, its own threads. */
void rs_qlinear(const float *x, int M, int K, const uint8_t *w, int wtype, long ldg, int N, const float *bias,
                const float *res, float *y, int8_t *xq, float *xd, float *xs, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        quantize_part(x, K, M, K, xq, xd, xs);
        qmatmul_part(x, K, xq, xd, xs, M, K, w, wtype, ldg, N, y, N, bias, res, N);
    }
}

/* ---- dequantization (embedding rows, references) -------------------------------------------------------- */

static void dequant_row(const uint8_t *group, int wtype, long ldg, int K, int j, float *out) {
    if (wtype >= W_F16 && wtype < 16) {
        fl_dequant_row(group, wtype, ldg, K, j, out);
        return;
    }
    if (wtype > W_Q4_1) {
        kq_dequant_row(group, wtype, K, j, out);
        return;
    }
    for (int b = 0; b < K / QK; ++b) {
        if (wtype == W_Q4_1) {
            const uint8_t *rec = group + (long)b * REC_Q41;
            const float d = h2f(((const uint16_t *)rec)[j]), m = h2f(((const uint16_t *)(rec + 16))[j]);
            for (int cc = 0; cc < 4; ++cc)
                for (int t = 0; t < 4; ++t) {
                    const uint8_t byte = rec[32 + 32 * cc + 4 * j + t];
                    out[b * QK + 4 * cc + t] = d * (float)(byte & 0x0F) + m;
                    out[b * QK + 16 + 4 * cc + t] = d * (float)(byte >> 4) + m;
                }
        } else {
            const uint8_t *rec = group + (long)b * REC_Q80;
            const float d = h2f(((const uint16_t *)rec)[j]);
            for (int c = 0; c < 8; ++c)
                for (int t = 0; t < 4; ++t)
                    out[b * QK + 4 * c + t] = d * (float)((const int8_t *)rec)[16 + 32 * c + 4 * j + t];
        }
    }
}

/* out[r, :] = dequant(w[rows[r], :]) for r < R (w packed, ldg bytes per group of 8 rows). */
void rs_dequant_rows(const uint8_t *w, int wtype, long ldg, int K, const int64_t *rows, int R, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 64)
    for (int r = 0; r < R; ++r) dequant_row(w + (rows[r] / 8) * ldg, wtype, ldg, K, (int)(rows[r] % 8), out + (long)r * K);
}

/* ---- norms, rotary embedding, activation ---------------------------------------------------------------- */

/* y = x * rsqrt(mean(x^2) + eps) * weight, per row (sum of squares in 8 fixed lanes, then hsum). */
static void rmsnorm_row(const float *xr, int K, const float *weight, float eps, float *yr) {
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_loadu_ps(xr + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; k < K; ++k) ss += xr[k] * xr[k];
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (k = 0; k < K; ++k) yr[k] = (xr[k] * r) * weight[k];
}

/* Each row of x [M, K] normalized (rmsnorm_row into y) and quantized as quantize_part does, one row at a time: one
   pass and one barrier where the two would take two. */
void norm_quantize_part(const float *x, long ldx, int M, int K, const float *weight, float eps, float *y, long ldy,
                        int8_t *xq, float *xd, float *xs) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        rmsnorm_row(x + m * ldx, K, weight, eps, y + m * ldy);
        quantize_row(y + m * ldy, K, xq + (long)m * K, xd + (long)m * (K / QK), xs + (long)m * (K / QK));
    }
}

/* Rotary embedding of the query and key heads of qkv rows [M, (H + 2G) * D] (q heads, k heads, v heads) at
   positions pos[m] (HF's rotate-half layout: pairs (t, t + D/2); tables cos / sin [positions, D/2]). Queries
   go to q [M, H * D]; keys and values are stored at cache row start + m, as kv_mode says: 0 fp32, 1 fp16, 3 bf16,
   2 int8 (a row of D values quantized per 32 as the activations are, then its D/32 fp32 scales: D + D/8 bytes;
   offsets and strides count elements of the storage type). */
static void store_kv(const float *x, int D, void *buf, long off, int kv_mode) {
    if (kv_mode == 2) {
        int8_t *row = (int8_t *)buf + off;
        float d[8], s[8]; /* D <= 256 */
        quantize_row(x, D, row, d, s);
        memcpy(row + D, d, sizeof(float) * (D / QK));
    } else if (kv_mode == 3) { /* bf16, rounded to nearest even (in integers: the same bits on every path) */
        for (int t = 0; t < D; t += 8) {
            const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + t));
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
            const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128((__m128i *)((uint16_t *)buf + off + t), _mm256_castsi256_si128(pk));
        }
    } else if (kv_mode == 1) {
        for (int t = 0; t < D; t += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)buf + off + t),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + t), _MM_FROUND_TO_NEAREST_INT));
    } else {
        memcpy((float *)buf + off, x, sizeof(float) * D);
    }
}

static void rope_store_row(const float *row, int H, int G, int D, int64_t pos, const float *cos_t,
                           const float *sin_t, const float *q_norm, const float *k_norm, float eps, float *q,
                           void *kbuf, void *vbuf, long kv_sh, long kv_sn, long at, int kv_mode) {
    const int half = D / 2;
    const float *c = cos_t + pos * half, *s = sin_t + pos * half;
    float kr[256], normed[256];
    for (int h = 0; h < H + G; ++h) {
        const float *src = row + (long)h * D;
        const float *norm = h < H ? q_norm : k_norm;
        if (norm) { /* Qwen3 / Gemma 3: each query / key head RMS-normalized before the rotation */
            rmsnorm_row(src, D, norm, eps, normed);
            src = normed;
        }
        float *dst = h < H ? q + (long)h * D : kr;
        for (int t = 0; t < half; ++t) {
            const float a = src[t], b = src[t + half];
            dst[t] = a * c[t] - b * s[t];
            dst[t + half] = b * c[t] + a * s[t];
        }
        if (h >= H) {
            const long off = (long)(h - H) * kv_sh + at * kv_sn;
            store_kv(kr, D, kbuf, off, kv_mode);
            store_kv(row + (long)(H + G) * D + (long)(h - H) * D, D, vbuf, off, kv_mode);
        }
    }
}

/* sigmoid(x) elementwise: 1/(1+e) if x >= 0 else e/(1+e), e = exp(-|x|) (no overflow either side). */
static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_nonpos(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_div_ps(num, _mm256_add_ps(one, e));
}

/* a[m, t] = act(gu[m, t]) * gu[m, I + t] for gate / up rows gu [M, 2I] (I a multiple of 8), each row then
   quantized as quantize_part does (xq, xd, xs). act 0: SiLU, x sigmoid(x); 1: GELU's tanh form (Gemma),
   0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). */
void act_mul_quantize_part(const float *gu, int M, int I, int act, float *a, int8_t *xq, float *xd, float *xs) {
    const __m256 k0 = _mm256_set1_ps(2.0f * 0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f);
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        const float *g = gu + (long)m * 2 * I, *u = g + I;
        float *o = a + (long)m * I;
        for (int t = 0; t < I; t += 8) {
            const __m256 x = _mm256_loadu_ps(g + t);
            const __m256 z = act ? _mm256_mul_ps(k0, _mm256_fmadd_ps(_mm256_mul_ps(k1, x), _mm256_mul_ps(x, x), x)) : x;
            _mm256_storeu_ps(o + t, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(z)), _mm256_loadu_ps(u + t)));
        }
        quantize_row(o, I, xq + (long)m * I, xd + (long)m * (I / QK), xs + (long)m * (I / QK));
    }
}

/* ---- one decoder layer of a Llama-family model, in one parallel region ----------------------------------- */

typedef struct {
    const float *attn_norm, *ffn_norm;          /* [E] */
    const uint8_t *wqkv, *wo, *wgu, *wdown;     /* rows: (H+2G)*D, E, 2I, E */
    int t_qkv, t_o, t_gu, t_down;               /* W_Q8_0 / W_Q4_1 */
    long ld_qkv, ld_o, ld_gu, ld_down;          /* bytes per weight row */
    const float *b_qkv;                         /* optional q/k/v biases [(H+2G)*D] (Qwen2) */
    const float *q_norm, *k_norm;               /* optional per-head RMSNorm weights [D] (Qwen3, Gemma 3) */
    const float *post_attn_norm, *post_ffn_norm; /* optional [E] (Gemma 2 / 3): the block's output normed before
                                                    the residual add */
    const float *cos_t, *sin_t;                 /* the layer's rotary tables [positions, D/2] */
    int window;                                 /* sliding-window attention: keys a query sees (0: all) */
} rs_layer_weights;

typedef struct {
    int E, H, G, D, I;
    float eps, scale;  /* RMSNorm epsilon; the queries' scale */
    int act;           /* the gated MLP's activation: 0 SiLU, 1 GELU (tanh) */
    float softcap;     /* attention scores soft-capped at this (Gemma 2; 0: none) */
    int tiles;         /* a bf16 cache's attention may run on the tiles (0: a model with windows or soft-capping) */
} rs_shape;

void attention_kv_part(const float *, long, long, int, int, int, const void *, const void *, long, long, int, int,
                       const int32_t *, const int32_t *, float, float *, long, long, float *, int, uint16_t *, long, int);
void attention_seqs_part(const att_seq *, int, int, int, int, long, long, long, float, float, long, long, float *,
                         int);
int rs_tile_keys(void);
int rs_attention_tiles(void);

/* Scratch (floats unless noted), per forward of M rows: h [M*E], qkv [M*(H+2G)*D], q [M*H*D], att [M*H*D],
   gu [M*2I], act [M*I], xq (int8) [M*max(E,I)], xd / xs [M*max(E,I)/32], work (attention). */
typedef struct {
    float *h, *qkv, *q, *att, *gu, *act, *xd, *xs, *work;
    int8_t *xq;
} rs_scratch;

/* One layer of a sequence's cache: rows below split (whole blocks of 64) are a prefix read in place (k0 / v0, sh0
   elements per key head), perhaps by other sequences of the forward too; row j >= split lies at row j - own0 of
   kbuf / vbuf (kv_sh elements per key head, kv_sn per row), row j < split at row j - pre0 of k0 / v0 (own0 > split,
   pre0 > 0: a sliding-window layer dropped the rows below, in whole blocks). tiles / tiled (own0 == split) (optional, a bf16 cache where the library
   lays out blocks, rs_tile_keys): the cache's own whole blocks (from row split on) laid out for the bf16 products,
   tiles_sh elements per key head, and how many are valid; tiles0 / tiled0 (optional, not on the tiles): the shared
   prefix's blocks laid out once for every cache reading it. */
typedef struct {
    void *kbuf, *vbuf;
    long kv_sh, kv_sn;
    uint16_t *tiles;
    long tiles_sh;
    int32_t *tiled;
    const void *k0, *v0;
    long sh0, split;
    uint16_t *tiles0;
    long tiles0_sh;
    int32_t *tiled0;
    long own0, pre0; /* the first cache row kbuf / k0 hold (split / 0, or past the rows a sliding window dropped) */
} rs_kv_layer;

/* One sequence's rows of a forward: its positions and its cache (kv: one entry per layer). Keys / values of its rows
   are written at cache rows start..start+rows-1; query i sees rows 0..past-1, then path[path_off[i]..path_off[i+1])
   (past = start for a tree pass). */
typedef struct {
    int rows;
    const int64_t *pos;
    long start;
    int past;
    const int32_t *path, *path_off;
    const rs_kv_layer *kv;
} rs_sequence;

/* x [M, E] <- layer l (weights L) of x for the rows of n sequences one after the other (M: their rows in all): the
   linear layers run once over every row (a weight is read once for all of them), rope and the KV store per
   sequence into its own cache, attention of every sequence at once (a prefix several sequences read in place is
   read once for all of them; on the tiles, per sequence). A row's result does not depend on the rows beside it. */
/* x [M, E] += rmsnorm(y) * weight, per row (y, scratch, is normed in place): Gemma's post-norms. */
static void norm_add_part(float *y, int M, int E, const float *weight, float eps, float *x) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        float *yr = y + (long)m * E, *xr = x + (long)m * E;
        rmsnorm_row(yr, E, weight, eps, yr);
        for (int k = 0; k < E; ++k) xr[k] += yr[k];
    }
}

/* y [n] <- cap * tanh(y / cap), tanh(u) = 2 sigmoid(2u) - 1 elementwise (Gemma 2's final logits; n a multiple of 8
   or the tail done alone, every element by the same operations). */
static void soft_cap_part(float *y, long n, float cap) {
    const __m256 two = _mm256_set1_ps(2.0f), one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(cap);
    const __m256 inv2 = _mm256_set1_ps(2.0f / cap);
#pragma omp for schedule(static)
    for (long j = 0; j < n; j += 8) {
        float tail[8];
        const int k = n - j < 8 ? (int)(n - j) : 8;
        for (int t = 0; t < 8; ++t) tail[t] = t < k ? y[j + t] : 0.0f;
        const __m256 t = _mm256_fmsub_ps(two, sigmoid8(_mm256_mul_ps(_mm256_loadu_ps(tail), inv2)), one);
        _mm256_storeu_ps(tail, _mm256_mul_ps(t, c));
        for (int t2 = 0; t2 < k; ++t2) y[j + t2] = tail[t2];
    }
}

static void layer_batch(const rs_layer_weights *L, int l, const rs_shape *S, float *x, int n, const rs_sequence *seq,
                        int kv_mode, const rs_scratch *T, int threads) {
    const int E = S->E, H = S->H, G = S->G, D = S->D, I = S->I;
    const int QKV = (H + 2 * G) * D;
    int M = 0, valid[n > 0 ? n : 1], row0[n > 0 ? n : 1]; /* rows in all; each sequence's first row */
    for (int i = 0; i < n; ++i) row0[i] = M, M += seq[i].rows;
    int row_seq[M > 0 ? M : 1]; /* the sequence of each row */
    for (int i = 0; i < n; ++i)
        for (int m = 0; m < seq[i].rows; ++m) row_seq[row0[i] + m] = i;
    const int tk = kv_mode == 3 && D % 32 == 0 ? rs_tile_keys() : 0; /* keys per block kept laid out (0: none) */
    const int tiles_path = tk && rs_attention_tiles() && S->tiles;
    att_seq att[n > 0 ? n : 1]; /* the attention's view of each sequence (on the tiles: per sequence, below) */
    for (int i = 0; i < n; ++i) {
        const rs_sequence *s = seq + i;
        const rs_kv_layer *c = s->kv + l;
        const long own = s->start - c->own0; /* the sequence's own rows from here on are rewritten: stale blocks */
        if (tk && c->tiles && *c->tiled > own / tk) *c->tiled = (int32_t)(own / tk);
        valid[i] = tk && c->tiles ? *c->tiled : 0;
        const att_seq a = {T->q + (long)row0[i] * H * D, T->att + (long)row0[i] * H * D, s->rows, s->past, s->path, s->path_off,
                           c->kbuf, c->vbuf, c->k0, c->v0, c->kv_sh, c->sh0, (int)c->split,
                           tk ? c->tiles : 0, tk ? c->tiles0 : 0, c->tiles_sh, c->tiles0_sh, valid[i],
                           tk && c->tiles0 ? *c->tiled0 : 0, L->window, c->own0, c->pre0};
        att[i] = a;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        norm_quantize_part(x, E, M, E, L->attn_norm, S->eps, T->h, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->h, E, T->xq, T->xd, T->xs, M, E, L->wqkv, L->t_qkv, L->ld_qkv, QKV, T->qkv, QKV, L->b_qkv, 0, 0);
#pragma omp for schedule(static) /* rotary embedding, keys and values stored: every row of every sequence */
        for (int r = 0; r < M; ++r) {
            const int i = row_seq[r], m = r - row0[i];
            const rs_kv_layer *c = seq[i].kv + l;
            rope_store_row(T->qkv + (long)r * QKV, H, G, D, seq[i].pos[m], L->cos_t, L->sin_t, L->q_norm, L->k_norm,
                           S->eps, T->q + (long)r * H * D, c->kbuf, c->vbuf, c->kv_sh, c->kv_sn,
                           seq[i].start - c->own0 + m, kv_mode);
        }
        if (tiles_path) {
            for (int i = 0, r = 0; i < n; r += seq[i++].rows) {
                const rs_sequence *s = seq + i;
                const rs_kv_layer *c = s->kv + l;
                attention_kv_part(T->q + (long)r * H * D, D, (long)H * D, H, s->rows, D, c->kbuf, c->vbuf, c->kv_sh,
                                  c->kv_sn, G, s->past, s->path, s->path_off, S->scale, T->att + (long)r * H * D,
                                  (long)H * D, D, T->work, kv_mode, c->tiles, c->tiles_sh, valid[i]);
            }
        } else {
            attention_seqs_part(att, n, H, D, G, D, (long)H * D, seq[0].kv[l].kv_sn, S->scale, S->softcap, (long)H * D,
                                D, T->work, kv_mode);
        }
        quantize_part(T->att, (long)H * D, M, H * D, T->xq, T->xd, T->xs);
        if (L->post_attn_norm) { /* x += norm(o(att)) */
            qmatmul_part(T->att, (long)H * D, T->xq, T->xd, T->xs, M, H * D, L->wo, L->t_o, L->ld_o, E, T->h, E, 0, 0, 0);
            norm_add_part(T->h, M, E, L->post_attn_norm, S->eps, x);
        } else { /* x += o(att), the sum in the matmul */
            qmatmul_part(T->att, (long)H * D, T->xq, T->xd, T->xs, M, H * D, L->wo, L->t_o, L->ld_o, E, x, E, 0, x, E);
        }
        norm_quantize_part(x, E, M, E, L->ffn_norm, S->eps, T->h, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->h, E, T->xq, T->xd, T->xs, M, E, L->wgu, L->t_gu, L->ld_gu, 2 * I, T->gu, 2 * I, 0, 0, 0);
        act_mul_quantize_part(T->gu, M, I, S->act, T->act, T->xq, T->xd, T->xs);
        if (L->post_ffn_norm) {
            qmatmul_part(T->act, I, T->xq, T->xd, T->xs, M, I, L->wdown, L->t_down, L->ld_down, E, T->h, E, 0, 0, 0);
            norm_add_part(T->h, M, E, L->post_ffn_norm, S->eps, x);
        } else {
            qmatmul_part(T->act, I, T->xq, T->xd, T->xs, M, I, L->wdown, L->t_down, L->ld_down, E, x, E, 0, x, E);
        }
    }
    for (int i = 0; i < n && tk; ++i) { /* the attention laid out every whole block below past */
        const rs_kv_layer *c = seq[i].kv + l;
        const long past = seq[i].past, own = (past - c->own0) / tk, pre = (past < c->split ? past : c->split) / tk;
        if (c->tiles && own > valid[i]) *c->tiled = (int32_t)own;
        if (c->tiles0 && pre > *c->tiled0) *c->tiled0 = (int32_t)pre;
    }
}

/* x [M, E] <- every layer of x in turn (layer_batch), in one call: the whole forward runs without its caller. */
void rs_forward(const rs_layer_weights *L, int layers, const rs_shape *S, float *x, int n, const rs_sequence *seq,
                int kv_mode, const rs_scratch *T, int threads) {
    for (int l = 0; l < layers; ++l) layer_batch(L + l, l, S, x, n, seq, kv_mode, T, threads);
}

/* Final norm + LM head over the last `keep` rows of x [M, E]: logits [keep, V], soft-capped at softcap if > 0. */
void rs_head(const float *x, int M, int keep, int E, const float *norm, float eps, const uint8_t *w, int wtype,
             long ldw, int V, float softcap, float *logits, const rs_scratch *T, int threads) {
    const float *xs = x + (long)(M - keep) * E;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        norm_quantize_part(xs, E, keep, E, norm, eps, T->h, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->h, E, T->xq, T->xd, T->xs, keep, E, w, wtype, ldw, V, logits, V, 0, 0, 0);
        if (softcap > 0.0f) soft_cap_part(logits, (long)keep * V, softcap);
    }
}

int rs_quant_kernels_version(void) { return 1; }
