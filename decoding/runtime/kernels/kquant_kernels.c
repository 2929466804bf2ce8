/* ragspec CPU kernels on GGUF's block formats beyond Q8_0 / Q4_1, read as stored: the K-quants Q4_K, Q5_K, Q6_K, the
 * 32-weight blocks Q5_0, Q4_0, Q5_1, the non-linear IQ4_NL and IQ4_XS (and a "parts" matrix:
 * rows of several formats, e.g. a fused q/k/v whose v is Q6_K and q, k Q4_K, each part computed in its own format).
 * quant_kernels.c's qmatmul_part and dequant_row hand these formats here (kq_matmul_part, kq_dequant_row).
 *
 * GGUF blocks (ggml-common.h), one weight row a run of them:
 *   Q4_K, 256 weights (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (one each per
 *         sub-block of 32), 128 bytes qs; in each 64 weights, qs byte l (0..31) holds weight l (sub-block 2j) in
 *         its low nibble and weight 32 + l (sub-block 2j + 1) in its high nibble;  w = d sc q - dmin m.
 *   Q6_K, 256 weights (210 bytes): ql[128], qh[64], int8 scales[16] (one per 16), fp16 d; in each half of 128,
 *         ql byte l (0..63) holds the low 4 bits of weights l (low nibble) and 64 + l (high nibble), qh byte l
 *         (0..31) the high 2 bits of weights l, 32 + l, 64 + l, 96 + l (bits 0-1, 2-3, 4-5, 6-7);
 *         w = d sc (q - 32), q in 0..63.
 *   Q5_0, 32 weights (22 bytes): fp16 d, 32 bits qh (bit t: weight t's fifth bit), 16 bytes qs (weight t low nibble,
 *         16 + t high nibble);  w = d (q - 16), q in 0..31.
 *   Q5_K, 256 weights (176 bytes): Q4_K's fields, then qh[32] before qs: bit 2j of qh byte l is the fifth bit of
 *         weight 64j + l, bit 2j + 1 of weight 64j + 32 + l;  w = d sc q - dmin m, q in 0..31.
 *   Q4_0, 32 weights (18 bytes): fp16 d, 16 bytes qs as Q5_0's;  w = d (q - 8).
 *   Q5_1, 32 weights (24 bytes): fp16 d, fp16 m, qh as Q5_0's, qs;  w = d q + m, q in 0..31.
 *   IQ4_NL, 32 weights (18 bytes): as Q4_0, q indexing 16 values v[q] from -127 to 113;  w = d v[q].
 *   IQ4_XS, 256 weights (136 bytes): fp16 d, 8 six-bit scales (uint16 of their top 2 bits, 4 bytes of low nibbles),
 *         per sub-block of 32 its 16 bytes of indices as IQ4_NL's;  w = d (ls - 32) v[q].
 *
 * Packed ("x8") as the other formats are: rows in groups of 8 (zero rows pad the last), per group and block one
 * record of the 8 rows' bytes rearranged (decoding/runtime/quant.py's pack_rows; no value changes, the same bytes
 * but for the K-quants' scales, unpacked from 12 to 16 bytes a block: 148 bytes of 144, 1.028x, and IQ4_XS's, 6 to
 * 8: 138 of 136), where a "chunk" of 32
 * bytes holds 4 bytes of each row in turn (bytes 4j..4j+3: row j):
 *   Q4_K (1184 bytes): d[8], dmin[8] (fp16), sc[sub][row] (64 bytes), m[sub][row] (64), 32 chunks of qs (chunk k:
 *         each row's qs bytes 4k..4k+3);
 *   Q6_K (1680 bytes): d[8] (fp16), then per block of 32 weights b, in the order the kernel reads them (208 bytes):
 *         the rows' scale pairs (sc[2b], sc[2b+1]) (16 bytes), 4 chunks of low bits (chunk p, byte 4j + t: the low 4
 *         bits of row j's weights 32b + 4p + t (low nibble) and 32b + 16 + 4p + t (high nibble)), 2 chunks of high
 *         bits (chunk k, byte 4j + t, bits 2u, 2u + 1: the high 2 bits of row j's weight 32b + 16k + 4u + t): the
 *         file's bit fields regrouped by block, so every byte is read once and in order;
 *   Q5_0 (176 bytes a block of 32): d[8] (fp16), a chunk of fifth bits (byte 4j + t, bit 2c + h: row j's weight
 *         16h + 4c + t), 4 chunks of qs (chunk c: each row's qs bytes 4c..4c+3);
 *   Q5_K (1440): as Q4_K, with 8 chunks of qh (chunk c: each row's qh bytes 4c..4c+3) before the qs chunks;
 *   Q4_0, IQ4_NL (144): d[8], 4 chunks of qs;  Q5_1 (192): d[8], m[8], the fifth bits and qs chunks as Q5_0's;
 *   IQ4_XS (1104): d[8], the scales minus 32 as int8 (sub-block s of row j at 8s + j: 64 bytes), 32 chunks of qs.
 * One integer instruction on a chunk against 4 activations broadcast to every lane then adds 4 products to each
 * of 8 rows' sums (16 rows on 512-bit vectors: two groups side by side).
 *
 * Activations are the same int8 rows every format reads (quant_kernels.c's quantize_row: per row and block of
 * 32, d_x = max|x| / 127, q_x = round(x / d_x), s_x = d_x sum(q_x)); Q6_K, Q5_0, Q4_0 and the IQ4s also read the
 * rows' integer sums per 16 (S, made per thread from q_x). Per output element, in this order whatever the batch, the tile, the
 * lane or the path (every sum of integers exact):
 *   Q4_K, Q5_K: per super-block, for each sub-block j in order: i = sc_j * sum(q_w q_x)   (int32)
 *                                                        T = fma(float(i), d_x, T),  U = fma(float(m_j), s_x, U)
 *         then acc = fma(d, T, acc); acc = acc - dmin U (one fused step);
 *   Q6_K: per super-block, for each block of 32 b in order:
 *         i = sc_2b (sum(q_w q_x) - 32 S_2b) + sc_2b+1 (the same over the second 16)   (int32)
 *         T = fma(float(i), d_x, T);  then acc = fma(d, T, acc);
 *   Q5_0, Q4_0: per block in order: i = sum(q_w q_x) - 16 (Q4_0: 8) (S_2b + S_2b+1);  acc = fma(float(i), d d_x, acc);
 *   Q5_1: the same with i = sum(q_w q_x), then acc = fma(m, s_x, acc);
 *   IQ4_NL: as Q5_0 with i = sum(v[q_w] q_x) (on dpbusd: the table plus 128, then 128 (S_2b + S_2b+1) taken off);
 *   IQ4_XS: per super-block, for each sub-block j: i = (ls_j - 32) sum(v[q_w] q_x); T = fma(float(i), d_x, T); then
 *         acc = fma(d, T, acc);
 * then y = acc (+ bias) (+ res), as the other formats. The AVX2 path sums byte products with maddubs (int16
 * pairs, never more than fit; the IQ4 values signed, so |v| times x with v's sign) and madd; AVX-512 VNNI with dpbusd
 * (one or two chains a row); both reach the same integers and run the same
 * fp32 steps, so every path gives the same bits (the AMX build runs these formats on its AVX-512 vectors).
 */
#ifndef KQ_LANES
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#define QK_K 256
enum { KW_Q4_1 = 2, KW_Q4_K = 3, KW_Q6_K = 4, KW_Q5_0 = 5, KW_Q4_0 = 6, KW_Q5_1 = 7, KW_IQ4_NL = 8, KW_IQ4_XS = 9,
       KW_Q5_K = 10, KW_PARTS = 16 }; /* WeightType in quant.py */
#define REC_Q4K 1184
#define REC_Q6K 1680
#define REC_Q5K 1440
#define REC_IQ4XS 1104
#define REC_Q50 176
#define REC_Q40 144 /* IQ4_NL's too */
#define REC_Q51 192

/* IQ4_NL's and IQ4_XS's 16 weight values (ggml-common.h's kvalues_iq4nl), as int8 and plus 128 as uint8 (the VNNI
   paths multiply unsigned weights by signed activations, then take 128 times the activations' sum back off). */
static const int8_t kq_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const uint8_t kq_iq4_plus128[16] __attribute__((unused)) = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
#define GROUPS_PER_TASK 4 /* 32 weight rows per task, as quant_kernels.c */
#define KQ_PAIR_ROWS 6     /* activation rows from which AVX-512 runs pairs of groups (kq_groups) */
/* Tiles of at most this many rows sum a block's integer products on two chains each (even and odd chunks) on the
   VNNI paths: one dpbusd waits for the last one's result, so one chain a row leaves the units idle when a tile has
   few rows (a decode step). Integer sums: the split never changes a value. */
#define KQ_SPLIT(MB) ((MB) <= 2)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define KQ_VNNI 1
#else
#define KQ_VNNI 0
#endif

void qmatmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                  const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                  long ldr);

static inline float kq_h2f(uint16_t h) { return _cvtsh_ss(h); }

/* The rows' integer sums per 16 activations (int16: |sum| <= 16 * 127), in this thread's scratch. */
static __thread int16_t *kq_sums;
static __thread long kq_sums_cap;

static const int16_t *kq_bsums(const int8_t *xq, int M, int K) {
    const long n = (long)M * (K / 16);
    if (n > kq_sums_cap) {
        free(kq_sums);
        kq_sums_cap = n > 4096 ? n : 4096;
        kq_sums = malloc(sizeof(int16_t) * kq_sums_cap);
    }
    for (long k = 0; k < n; ++k) {
        const int8_t *x = xq + 16 * k;
        int s = 0;
        for (int t = 0; t < 16; ++t) s += x[t];
        kq_sums[k] = (int16_t)s;
    }
    return kq_sums;
}

static inline int32_t kq_pair(const int16_t *s) { /* sums 2b, 2b + 1 as one int32 (int16 pairs for madd) */
    int32_t v;
    memcpy(&v, s, 4);
    return v;
}

/* ---- one instantiation per vector width: 8 lanes (one group) and, on AVX-512, 16 (two groups) ------------------ */
#define KQ_LANES 8
#include "kquant_kernels.c"
#undef KQ_LANES
#if KQ_VNNI
#define KQ_LANES 16
#include "kquant_kernels.c"
#undef KQ_LANES
#endif

/* Weight groups [g0, g1) for every activation row. On AVX-512, from KQ_PAIR_ROWS rows on, two groups at a time on
   16 lanes (fewer instructions a weight); fewer rows (a decode step, a small verify), one group at a time: a pair
   reads two streams of weights at once, which made one row from memory about twice as slow (measured on an EPYC;
   the two give the same bits, so the choice never changes a result). */
static void kq_groups(int wtype, const int8_t *xq, const float *xd, const float *xs, const int16_t *S, int M, int K,
                      const uint8_t *w, long ldg, int N, int g0, int g1, float *y, long ldy, const float *bias,
                      const float *res, long ldr) {
#if KQ_VNNI
    for (; M >= KQ_PAIR_ROWS && g0 + 1 < g1; g0 += 2)
        kq_rows_16(wtype, xq, xd, xs, S, M, K, w + g0 * ldg, w + (g0 + 1) * ldg, N, 8 * g0, y, ldy, bias, res, ldr);
#endif
    for (; g0 < g1; ++g0) kq_rows_8(wtype, xq, xd, xs, S, M, K, w + g0 * ldg, 0, N, 8 * g0, y, ldy, bias, res, ldr);
}

/* A parts matrix: w points at {n, then per part: weights, type, bytes per group, rows} (int64 each); part p's rows
   follow part p - 1's in y (and in bias / res). Each part runs as a matrix of its own on the same activations. */
static void kq_parts(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                     const int64_t *desc, float *y, long ldy, const float *bias, const float *res, long ldr) {
    long off = 0;
    for (int p = 0; p < (int)desc[0]; ++p) {
        const int64_t *d = desc + 1 + 4 * p;
        qmatmul_part(x, ldx, xq, xd, xs, M, K, (const uint8_t *)(intptr_t)d[0], (int)d[1], (long)d[2], (int)d[3], y + off, ldy,
                     bias ? bias + off : 0, res ? res + off : 0, ldr);
        off += d[3];
    }
}

/* y[M, N] = xq @ w^T (+ bias) (+ res) for the formats above (called by qmatmul_part, inside a parallel region). */
void kq_matmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                    const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                    long ldr) {
    if (wtype == KW_PARTS) {
        kq_parts(x, ldx, xq, xd, xs, M, K, (const int64_t *)w, y, ldy, bias, res, ldr);
        return;
    }
    const int sums = wtype != KW_Q4_K && wtype != KW_Q5_K && wtype != KW_Q5_1;
    const int16_t *S = sums ? kq_bsums(xq, M, K) : 0; /* every thread its own */
    const int groups = (N + 7) / 8, tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        const int g0 = t * GROUPS_PER_TASK, g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
        kq_groups(wtype, xq, xd, xs, S, M, K, w, ldg, N, g0, g1, y, ldy, bias, res, ldr);
    }
}

/* ---- dequantization of one packed row (embedding rows, references): GGUF's arithmetic, in fp32 -------------- */

void kq_dequant_row(const uint8_t *group, int wtype, int K, int j, float *out) {
    if (wtype == KW_Q4_K) {
        for (int s = 0; s < K / QK_K; ++s) {
            const uint8_t *r = group + (long)s * REC_Q4K;
            const float d = kq_h2f(((const uint16_t *)r)[j]), dmin = kq_h2f(((const uint16_t *)(r + 16))[j]);
            float *o = out + s * QK_K;
            for (int sub = 0; sub < 8; ++sub) {
                const float dl = d * (float)r[32 + 8 * sub + j], ml = dmin * (float)r[96 + 8 * sub + j];
                const int jj = sub / 2, high = sub % 2;
                for (int l = 0; l < 32; ++l) {
                    const uint8_t byte = r[160 + 32 * (8 * jj + l / 4) + 4 * j + l % 4];
                    o[32 * sub + l] = dl * (float)(high ? byte >> 4 : byte & 0x0F) - ml;
                }
            }
        }
    } else if (wtype == KW_Q6_K) {
        for (int s = 0; s < K / QK_K; ++s) {
            const uint8_t *r = group + (long)s * REC_Q6K;
            const float d = kq_h2f(((const uint16_t *)r)[j]);
            float *o = out + s * QK_K;
            for (int v = 0; v < QK_K; ++v) {
                const int b = v / 32, k = (v % 32) / 16, p = (v % 16) / 4, t = v % 4;
                const uint8_t *rb = r + 16 + 208 * b;
                const uint8_t qlb = rb[16 + 32 * p + 4 * j + t], qhb = rb[144 + 32 * k + 4 * j + t];
                const int q = ((k ? qlb >> 4 : qlb & 0x0F) | (((qhb >> (2 * p)) & 3) << 4)) - 32;
                const float dl = d * (float)((const int8_t *)rb)[2 * j + k];
                o[v] = dl * (float)q;
            }
        }
    } else if (wtype == KW_Q5_K) {
        for (int s = 0; s < K / QK_K; ++s) {
            const uint8_t *r = group + (long)s * REC_Q5K;
            const float d = kq_h2f(((const uint16_t *)r)[j]), dmin = kq_h2f(((const uint16_t *)(r + 16))[j]);
            for (int sub = 0; sub < 8; ++sub) {
                const float dl = d * (float)r[32 + 8 * sub + j], ml = dmin * (float)r[96 + 8 * sub + j];
                const int jj = sub / 2, high = sub % 2;
                for (int l = 0; l < 32; ++l) {
                    const uint8_t byte = r[416 + 32 * (8 * jj + l / 4) + 4 * j + l % 4];
                    const uint8_t fifth = (r[160 + 32 * (l / 4) + 4 * j + l % 4] >> sub) & 1;
                    out[s * QK_K + 32 * sub + l] = dl * (float)((high ? byte >> 4 : byte & 0x0F) | (fifth << 4)) - ml;
                }
            }
        }
    } else if (wtype == KW_IQ4_XS) {
        for (int s = 0; s < K / QK_K; ++s) {
            const uint8_t *r = group + (long)s * REC_IQ4XS;
            const float d = kq_h2f(((const uint16_t *)r)[j]);
            for (int ib = 0; ib < 8; ++ib) {
                const float dl = d * (float)((const int8_t *)r)[16 + 8 * ib + j];
                for (int v = 0; v < QK; ++v) {
                    const int h = v / 16, c = (v % 16) / 4, t = v % 4;
                    const uint8_t byte = r[80 + 32 * (4 * ib + c) + 4 * j + t];
                    out[s * QK_K + 32 * ib + v] = dl * (float)kq_iq4_values[h ? byte >> 4 : byte & 0x0F];
                }
            }
        }
    } else { /* the 32-weight blocks */
        const int rec = wtype == KW_Q5_0 ? REC_Q50 : wtype == KW_Q5_1 ? REC_Q51 : REC_Q40;
        const int qoff = wtype == KW_Q5_0 ? 48 : wtype == KW_Q5_1 ? 64 : 16, foff = wtype == KW_Q5_0 ? 16 : 32;
        for (int b = 0; b < K / QK; ++b) {
            const uint8_t *r = group + (long)b * rec;
            const float d = kq_h2f(((const uint16_t *)r)[j]);
            for (int v = 0; v < QK; ++v) {
                const int h = v / 16, c = (v % 16) / 4, t = v % 4;
                const uint8_t byte = r[qoff + 32 * c + 4 * j + t], nib = h ? byte >> 4 : byte & 0x0F;
                const int fifth = (r[foff + 4 * j + t] >> (2 * c + h)) & 1;
                float w;
                if (wtype == KW_Q5_0)
                    w = d * (float)((nib | (fifth << 4)) - 16);
                else if (wtype == KW_Q5_1)
                    w = d * (float)(nib | (fifth << 4)) + kq_h2f(((const uint16_t *)(r + 16))[j]);
                else if (wtype == KW_Q4_0)
                    w = d * (float)(nib - 8);
                else
                    w = d * (float)kq_iq4_values[nib];
                out[b * QK + v] = w;
            }
        }
    }
}

#else /* ---- the body, once per KQ_LANES ------------------------------------------------------------------ */

#if KQ_LANES == 16
#define KQ(name) name##_16
#define KQ_MB 4 /* activation rows per tile */
#define kvi __m512i
#define kvf __m512
#define VZERO() _mm512_setzero_si512()
#define VZEROF() _mm512_setzero_ps()
#define V8(c) _mm512_set1_epi8((char)(c))
#define VAND _mm512_and_si512
#define VOR _mm512_or_si512
#define VSRL16 _mm512_srli_epi16
#define VSLL16 _mm512_slli_epi16
#define VSLL32 _mm512_slli_epi32
#define VSRA32 _mm512_srai_epi32
#define VADD32 _mm512_add_epi32
#define VSUB32 _mm512_sub_epi32
#define VMULLO32 _mm512_mullo_epi32
#define VMADD16 _mm512_madd_epi16
#define VDOT(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define VSET32(v) _mm512_set1_epi32(v)
#define VSETF _mm512_set1_ps
#define VCVT _mm512_cvtepi32_ps
#define VFMA _mm512_fmadd_ps
#define VFNMA _mm512_fnmadd_ps
#define VMULF _mm512_mul_ps
#define VSHUF _mm512_shuffle_epi8
/* a chunk of two groups: 32 bytes of each side by side */
static inline kvi KQ(ld)(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline kvf KQ(f16)(const uint8_t *a, const uint8_t *b) { /* 8 fp16 of each group */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
static inline kvi KQ(u8x8)(const uint8_t *a, const uint8_t *b) { /* 8 bytes of each group -> int32 lanes */
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
static inline kvi KQ(i8x8)(const uint8_t *a, const uint8_t *b) { /* 8 signed bytes of each group -> int32 lanes */
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
static inline kvi KQ(i8x16)(const uint8_t *a, const uint8_t *b) { /* 16 bytes of each group -> int16 lanes */
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                        _mm_loadu_si128((const __m128i *)b), 1));
}
static inline kvi KQ(bc4)(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
}
#define G1(p) (p) /* the second group's pointer */
#else
#define KQ(name) name##_8
#define KQ_MB 4 /* AVX2's 16 registers spill a few accumulators: still faster than reading the weights twice */
#define kvi __m256i
#define kvf __m256
#define VZERO() _mm256_setzero_si256()
#define VZEROF() _mm256_setzero_ps()
#define V8(c) _mm256_set1_epi8((char)(c))
#define VAND _mm256_and_si256
#define VOR _mm256_or_si256
#define VSRL16 _mm256_srli_epi16
#define VSLL16 _mm256_slli_epi16
#define VSLL32 _mm256_slli_epi32
#define VSRA32 _mm256_srai_epi32
#define VADD32 _mm256_add_epi32
#define VSUB32 _mm256_sub_epi32
#define VMULLO32 _mm256_mullo_epi32
#define VMADD16 _mm256_madd_epi16
#if KQ_VNNI
#define VDOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#endif
#define VSET32(v) _mm256_set1_epi32(v)
#define VSETF _mm256_set1_ps
#define VCVT _mm256_cvtepi32_ps
#define VFMA _mm256_fmadd_ps
#define VFNMA _mm256_fnmadd_ps
#define VMULF _mm256_mul_ps
#define VSHUF _mm256_shuffle_epi8
static inline kvi KQ(ld)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_loadu_si256((const __m256i *)a);
}
static inline kvf KQ(f16)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a));
}
static inline kvi KQ(u8x8)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)a));
}
static inline kvi KQ(i8x8)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)a));
}
static inline kvi KQ(i8x16)(const uint8_t *a, const uint8_t *b) {
    (void)b;
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a));
}
static inline kvi KQ(bc4)(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}
#define G1(p) ((void)(p), (const uint8_t *)0)
#endif

/* ---- Q4_K and Q5_K (W, a constant where inlined): MB activation rows x one group (or pair) -> acc lanes -------- */
static inline __attribute__((always_inline)) void KQ(q45k)(const int MB, const int W, const int8_t *xq,
                                                            const float *xd, const float *xs, int K,
                                                            const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    const int nsb = K / QK_K, nb = K / QK;
    const int rec = W == KW_Q5_K ? REC_Q5K : REC_Q4K, qoff = W == KW_Q5_K ? 416 : 160; /* Q5_K: fifth bits at 160 */
    const kvi low = V8(0x0F), bit4 = V8(0x10);
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < nsb; ++s) {
        const uint8_t *r0 = g0 + (long)s * rec, *r1 = G1(g1 + (long)s * rec);
        kvf T[KQ_MB], U[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = U[i] = VZEROF();
        for (int jj = 0; jj < 4; ++jj) { /* 64 weights: sub-blocks 2jj (low nibbles, Q5_K's bit 2jj) and 2jj + 1 */
            const kvi sc_lo = KQ(u8x8)(r0 + 32 + 8 * (2 * jj), r1 + 32 + 8 * (2 * jj));
            const kvi sc_hi = KQ(u8x8)(r0 + 32 + 8 * (2 * jj + 1), r1 + 32 + 8 * (2 * jj + 1));
            kvi alo[KQ_MB], ahi[KQ_MB];
            for (int i = 0; i < MB; ++i) alo[i] = ahi[i] = VZERO();
#if KQ_VNNI
            kvi blo[KQ_MB], bhi[KQ_MB]; /* few rows: odd chunks on chains of their own (dpbusd's latency) */
            for (int i = 0; i < MB; ++i) blo[i] = bhi[i] = VZERO();
#else /* int16 partial sums over 4 chunks (8 products of at most 31 * 127), then times the scale in int32 */
            const kvi scp_lo = VOR(sc_lo, VSLL32(sc_lo, 16)), scp_hi = VOR(sc_hi, VSLL32(sc_hi, 16));
            kvi plo[KQ_MB], phi[KQ_MB];
            for (int i = 0; i < MB; ++i) plo[i] = phi[i] = VZERO();
#endif
            for (int c = 0; c < 8; ++c) {
                const kvi raw = KQ(ld)(r0 + qoff + 32 * (8 * jj + c), r1 + qoff + 32 * (8 * jj + c));
                kvi lo = VAND(raw, low), hi = VAND(VSRL16(raw, 4), low);
                if (W == KW_Q5_K) { /* bits 2jj and 2jj + 1 of the chunk's qh bytes to bit 4 (16-bit shifts: bit 4 of a
                                       byte comes from its own) */
                    const kvi h = KQ(ld)(r0 + 160 + 32 * c, r1 + 160 + 32 * c);
                    const kvi flo = jj == 0 ? VSLL16(h, 4) : jj == 1 ? VSLL16(h, 2) : jj == 2 ? h : VSRL16(h, 2);
                    const kvi fhi = jj == 0 ? VSLL16(h, 3) : jj == 1 ? VSLL16(h, 1) : jj == 2 ? VSRL16(h, 1)
                                                                                          : VSRL16(h, 3);
                    lo = VOR(lo, VAND(flo, bit4)), hi = VOR(hi, VAND(fhi, bit4));
                }
                for (int i = 0; i < MB; ++i) {
                    const int8_t *xb = xq + (long)i * K + s * QK_K + 64 * jj + 4 * c;
#if KQ_VNNI
                    if (KQ_SPLIT(MB) && (c & 1)) {
                        blo[i] = VDOT(blo[i], lo, KQ(bc4)(xb));
                        bhi[i] = VDOT(bhi[i], hi, KQ(bc4)(xb + 32));
                    } else {
                        alo[i] = VDOT(alo[i], lo, KQ(bc4)(xb));
                        ahi[i] = VDOT(ahi[i], hi, KQ(bc4)(xb + 32));
                    }
#else
                    plo[i] = _mm256_add_epi16(plo[i], _mm256_maddubs_epi16(lo, KQ(bc4)(xb)));
                    phi[i] = _mm256_add_epi16(phi[i], _mm256_maddubs_epi16(hi, KQ(bc4)(xb + 32)));
                    if (c == 3 || c == 7) {
                        alo[i] = VADD32(alo[i], VMADD16(plo[i], scp_lo));
                        ahi[i] = VADD32(ahi[i], VMADD16(phi[i], scp_hi));
                        plo[i] = phi[i] = VZERO();
                    }
#endif
                }
            }
#if KQ_VNNI
            if (KQ_SPLIT(MB))
                for (int i = 0; i < MB; ++i) alo[i] = VADD32(alo[i], blo[i]), ahi[i] = VADD32(ahi[i], bhi[i]);
#endif
            for (int h = 0; h < 2; ++h) {
                const int sub = 2 * jj + h, b = s * 8 + sub;
                const kvf mn = VCVT(KQ(u8x8)(r0 + 96 + 8 * sub, r1 + 96 + 8 * sub));
                for (int i = 0; i < MB; ++i) {
#if KQ_VNNI
                    const kvi isum = VMULLO32(h ? ahi[i] : alo[i], h ? sc_hi : sc_lo);
#else
                    const kvi isum = h ? ahi[i] : alo[i];
#endif
                    T[i] = VFMA(VCVT(isum), VSETF(xd[(long)i * nb + b]), T[i]);
                    U[i] = VFMA(mn, VSETF(xs[(long)i * nb + b]), U[i]);
                }
            }
        }
        const kvf d = KQ(f16)(r0, r1), dm = KQ(f16)(r0 + 16, r1 + 16);
        for (int i = 0; i < MB; ++i) acc[i] = VFNMA(dm, U[i], VFMA(d, T[i], acc[i]));
    }
}

/* ---- Q6_K ------------------------------------------------------------------------------------------------------ */
/* Block b (0..7) of the super-block at r0 (r1): weights 32b + 4c + t (sub-block 2b: c < 4; 2b + 1: c >= 4) of each
   activation row from x (the super-block's first); T[i] = fma(float(i), d_x, T[i]). */
static inline __attribute__((always_inline)) void KQ(q6k_block)(const int MB, const int8_t *xq, const float *xd,
                                                                 const int16_t *S, int K, int bb, const uint8_t *r0,
                                                                 const uint8_t *r1, kvf *T) {
    const int nb = K / QK;
    const kvi low = V8(0x0F), top = V8(0x30);
    const kvi P = KQ(i8x16)(r0, G1(r1)); /* (sc_2b, sc_2b+1) int16 pairs */
    const kvi H0 = KQ(ld)(r0 + 144, G1(r1 + 144)), H1 = KQ(ld)(r0 + 176, G1(r1 + 176));
#if KQ_VNNI
    const kvi sa = VSRA32(VSLL32(P, 16), 16), sb = VSRA32(P, 16);
    kvi aa[KQ_MB], ab[KQ_MB], ca[KQ_MB], cb[KQ_MB]; /* ca, cb: the odd chunks' chains, for few rows */
    for (int i = 0; i < MB; ++i) aa[i] = ab[i] = ca[i] = cb[i] = VZERO();
#else
    const kvi sca = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(P, 0xA0), 0xA0); /* (sc_2b, sc_2b) */
    const kvi scb = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(P, 0xF5), 0xF5); /* (sc_2b+1, sc_2b+1) */
    kvi a32[KQ_MB], pa[KQ_MB], pb[KQ_MB];
    for (int i = 0; i < MB; ++i) a32[i] = pa[i] = pb[i] = VZERO();
#endif
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) { /* weights 4p + t (low nibbles, high bits in H0) and 16 + 4p + t (high, H1) */
        const kvi L = KQ(ld)(r0 + 16 + 32 * p, G1(r1 + 16 + 32 * p));
        const kvi h0 = p == 0 ? VSLL16(H0, 4) : p == 1 ? VSLL16(H0, 2) : p == 2 ? H0 : VSRL16(H0, 2);
        const kvi h1 = p == 0 ? VSLL16(H1, 4) : p == 1 ? VSLL16(H1, 2) : p == 2 ? H1 : VSRL16(H1, 2);
        const kvi qa = VOR(VAND(L, low), VAND(h0, top)), qb = VOR(VAND(VSRL16(L, 4), low), VAND(h1, top));
        for (int i = 0; i < MB; ++i) {
            const int8_t *x = xq + (long)i * K + 32 * bb + 4 * p;
#if KQ_VNNI
            if (KQ_SPLIT(MB) && (p & 1)) {
                ca[i] = VDOT(ca[i], qa, KQ(bc4)(x));
                cb[i] = VDOT(cb[i], qb, KQ(bc4)(x + 16));
            } else {
                aa[i] = VDOT(aa[i], qa, KQ(bc4)(x));
                ab[i] = VDOT(ab[i], qb, KQ(bc4)(x + 16));
            }
#else /* two chunks' pairs in int16 (at most 4 * 63 * 127), then times the scale into int32 */
            const kvi ua = _mm256_maddubs_epi16(qa, KQ(bc4)(x)), ub = _mm256_maddubs_epi16(qb, KQ(bc4)(x + 16));
            if (p & 1) {
                a32[i] = VADD32(a32[i], VMADD16(_mm256_add_epi16(pa[i], ua), sca));
                a32[i] = VADD32(a32[i], VMADD16(_mm256_add_epi16(pb[i], ub), scb));
            } else {
                pa[i] = ua, pb[i] = ub;
            }
#endif
        }
    }
    for (int i = 0; i < MB; ++i) {
        const kvi corr = VMADD16(P, VSET32(kq_pair(S + (long)i * (K / 16) + 2 * bb))); /* sc . S per lane */
#if KQ_VNNI
        const kvi dot = VADD32(VMULLO32(VADD32(aa[i], ca[i]), sa), VMULLO32(VADD32(ab[i], cb[i]), sb));
#else
        const kvi dot = a32[i];
#endif
        T[i] = VFMA(VCVT(VSUB32(dot, VSLL32(corr, 5))), VSETF(xd[(long)i * nb + bb]), T[i]);
    }
}

static inline __attribute__((always_inline)) void KQ(q6k)(const int MB, const int8_t *xq, const float *xd,
                                                           const int16_t *S, int K, const uint8_t *g0,
                                                           const uint8_t *g1, kvf *acc) {
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < K / QK_K; ++s) {
        const uint8_t *r0 = g0 + (long)s * REC_Q6K, *r1 = G1(g1 + (long)s * REC_Q6K);
        kvf T[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = VZEROF();
        for (int b = 0; b < 8; ++b)
            KQ(q6k_block)(MB, xq, xd, S, K, 8 * s + b, r0 + 16 + 208 * b, G1(r1 + 16 + 208 * b), T);
        const kvf d = KQ(f16)(r0, r1);
        for (int i = 0; i < MB; ++i) acc[i] = VFMA(d, T[i], acc[i]);
    }
}

/* ---- the 32-weight blocks: Q5_0, Q4_0, Q5_1, IQ4_NL (W, a constant where inlined) ------------------------------- */
/* The 16 IQ4 values as the byte table the shuffles read (one copy per 128-bit lane): plus 128 where the products run
   on dpbusd (unsigned x signed), as int8 where they run on maddubs with the signs moved onto the activations. */
static inline kvi KQ(iq4_table)(void) {
#if KQ_VNNI
    const __m128i t = _mm_loadu_si128((const __m128i *)kq_iq4_plus128);
#else
    const __m128i t = _mm_loadu_si128((const __m128i *)kq_iq4_values);
#endif
#if KQ_LANES == 16
    return _mm512_broadcast_i32x4(t);
#else
    return _mm256_broadcastsi128_si256(t);
#endif
}

static inline __attribute__((always_inline)) void KQ(q32)(const int MB, const int W, const int8_t *xq,
                                                           const float *xd, const float *xs, const int16_t *S, int K,
                                                           const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    const int nb = K / QK;
    const int rec = W == KW_Q5_0 ? REC_Q50 : W == KW_Q5_1 ? REC_Q51 : REC_Q40;
    const int qoff = W == KW_Q5_0 ? 48 : W == KW_Q5_1 ? 64 : 16, foff = W == KW_Q5_0 ? 16 : 32;
    const int fifth_bits = W == KW_Q5_0 || W == KW_Q5_1;
    const kvi low = V8(0x0F), bit4 = V8(0x10);
    const kvi table = W == KW_IQ4_NL ? KQ(iq4_table)() : VZERO();
#if !KQ_VNNI
    const kvi ones = _mm256_set1_epi16(1);
#endif
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int b = 0; b < nb; ++b) {
        const uint8_t *r0 = g0 + (long)b * rec, *r1 = G1(g1 + (long)b * rec);
        kvi a[KQ_MB], plo[KQ_MB], phi[KQ_MB];
        for (int i = 0; i < MB; ++i) a[i] = plo[i] = phi[i] = VZERO();
        const kvi fifth = fifth_bits ? KQ(ld)(r0 + foff, G1(r1 + foff)) : VZERO(); /* bit 2c + h of byte 4j + t */
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const kvi raw = KQ(ld)(r0 + qoff + 32 * c, G1(r1 + qoff + 32 * c));
            kvi lo = VAND(raw, low), hi = VAND(VSRL16(raw, 4), low);
            if (fifth_bits) { /* bit 2c (low nibbles) and 2c + 1 (high) to bit 4 (16-bit shifts: bit 4 of a byte
                                 comes from its own) */
                const kvi flo = c == 0 ? VSLL16(fifth, 4) : c == 1 ? VSLL16(fifth, 2) : c == 2 ? fifth
                                                                                               : VSRL16(fifth, 2);
                const kvi fhi = c == 0 ? VSLL16(fifth, 3) : c == 1 ? VSLL16(fifth, 1) : c == 2 ? VSRL16(fifth, 1)
                                                                                               : VSRL16(fifth, 3);
                lo = VOR(lo, VAND(flo, bit4)), hi = VOR(hi, VAND(fhi, bit4));
            }
            if (W == KW_IQ4_NL) lo = VSHUF(table, lo), hi = VSHUF(table, hi);
            for (int i = 0; i < MB; ++i) {
                const int8_t *xb = xq + (long)i * K + b * QK + 4 * c;
#if KQ_VNNI
                if (KQ_SPLIT(MB)) /* low and high nibbles on chains of their own */
                    a[i] = VDOT(a[i], lo, KQ(bc4)(xb)), plo[i] = VDOT(plo[i], hi, KQ(bc4)(xb + 16));
                else
                    a[i] = VDOT(VDOT(a[i], lo, KQ(bc4)(xb)), hi, KQ(bc4)(xb + 16));
#else
                if (W == KW_IQ4_NL) { /* signed weights: |w| times x with w's sign; pairs <= 2 * 127 * 127 */
                    const kvi xl = KQ(bc4)(xb), xh = KQ(bc4)(xb + 16);
                    const kvi pl = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo));
                    const kvi ph = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi));
                    a[i] = VADD32(a[i], VADD32(VMADD16(pl, ones), VMADD16(ph, ones)));
                } else { /* int16 lanes: 8 products of at most 31 * 127 each */
                    plo[i] = _mm256_add_epi16(plo[i], _mm256_maddubs_epi16(lo, KQ(bc4)(xb)));
                    phi[i] = _mm256_add_epi16(phi[i], _mm256_maddubs_epi16(hi, KQ(bc4)(xb + 16)));
                }
#endif
            }
        }
        const kvf d = KQ(f16)(r0, r1);
        const kvf mn = W == KW_Q5_1 ? KQ(f16)(r0 + 16, r1 + 16) : VZEROF();
        for (int i = 0; i < MB; ++i) {
#if KQ_VNNI
            if (KQ_SPLIT(MB)) a[i] = VADD32(a[i], plo[i]);
#else
            if (W != KW_IQ4_NL) a[i] = VADD32(VMADD16(plo[i], ones), VMADD16(phi[i], ones));
#endif
            const int16_t *sp = S ? S + (long)i * (K / 16) + 2 * b : 0;
            /* the weights' offset times the activations' sum: Q5_0 16, Q4_0 8; IQ4_NL 128 on dpbusd (the table's) */
            const int offset = W == KW_Q5_0 ? 16 : W == KW_Q4_0 ? 8 : W == KW_IQ4_NL && KQ_VNNI ? 128 : 0;
            const kvi isum = offset ? VSUB32(a[i], VSET32(offset * ((int)sp[0] + (int)sp[1]))) : a[i];
            acc[i] = VFMA(VCVT(isum), VMULF(d, VSETF(xd[(long)i * nb + b])), acc[i]);
            if (W == KW_Q5_1) acc[i] = VFMA(mn, VSETF(xs[(long)i * nb + b]), acc[i]);
        }
    }
}

/* ---- IQ4_XS: 8 sub-blocks of 32 IQ4 values, each with a 6-bit scale (stored minus 32) ------------------------ */
static inline __attribute__((always_inline)) void KQ(iq4xs)(const int MB, const int8_t *xq, const float *xd,
                                                             const int16_t *S, int K, const uint8_t *g0,
                                                             const uint8_t *g1, kvf *acc) {
    const int nsb = K / QK_K, nb = K / QK;
    const kvi low = V8(0x0F), table = KQ(iq4_table)();
#if !KQ_VNNI
    const kvi ones = _mm256_set1_epi16(1);
#endif
    for (int i = 0; i < MB; ++i) acc[i] = VZEROF();
    for (int s = 0; s < nsb; ++s) {
        const uint8_t *r0 = g0 + (long)s * REC_IQ4XS, *r1 = G1(g1 + (long)s * REC_IQ4XS);
        kvf T[KQ_MB];
        for (int i = 0; i < MB; ++i) T[i] = VZEROF();
        for (int ib = 0; ib < 8; ++ib) {
            kvi a[KQ_MB], a2[KQ_MB];
            for (int i = 0; i < MB; ++i) a[i] = a2[i] = VZERO();
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                const kvi raw = KQ(ld)(r0 + 80 + 32 * (4 * ib + c), G1(r1 + 80 + 32 * (4 * ib + c)));
                const kvi lo = VSHUF(table, VAND(raw, low)), hi = VSHUF(table, VAND(VSRL16(raw, 4), low));
                for (int i = 0; i < MB; ++i) {
                    const int8_t *xb = xq + (long)i * K + s * QK_K + 32 * ib + 4 * c;
#if KQ_VNNI
                    if (KQ_SPLIT(MB)) /* low and high nibbles on chains of their own */
                        a[i] = VDOT(a[i], lo, KQ(bc4)(xb)), a2[i] = VDOT(a2[i], hi, KQ(bc4)(xb + 16));
                    else
                        a[i] = VDOT(VDOT(a[i], lo, KQ(bc4)(xb)), hi, KQ(bc4)(xb + 16));
#else
                    const kvi xl = KQ(bc4)(xb), xh = KQ(bc4)(xb + 16);
                    const kvi pl = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo));
                    const kvi ph = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi));
                    a[i] = VADD32(a[i], VADD32(VMADD16(pl, ones), VMADD16(ph, ones)));
#endif
                }
            }
            const kvi sc = KQ(i8x8)(r0 + 16 + 8 * ib, G1(r1 + 16 + 8 * ib));
            const int b = s * 8 + ib;
            for (int i = 0; i < MB; ++i) {
#if KQ_VNNI
                const int16_t *sp = S + (long)i * (K / 16) + 2 * b;
                const kvi dot = VSUB32(VADD32(a[i], a2[i]), VSET32(128 * ((int)sp[0] + (int)sp[1])));
#else
                const kvi dot = a[i];
#endif
                T[i] = VFMA(VCVT(VMULLO32(dot, sc)), VSETF(xd[(long)i * nb + b]), T[i]);
            }
        }
        const kvf d = KQ(f16)(r0, r1);
        for (int i = 0; i < MB; ++i) acc[i] = VFMA(d, T[i], acc[i]);
    }
}

/* ---- a group (8 lanes) or pair of groups (16 lanes) for every activation row --------------------------------- */
static inline __attribute__((always_inline)) void KQ(tile)(const int MB, int wtype, const int8_t *xq,
                                                            const float *xd, const float *xs, const int16_t *S,
                                                            int K, const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    switch (wtype) {
    case KW_Q4_K: KQ(q45k)(MB, KW_Q4_K, xq, xd, xs, K, g0, g1, acc); break;
    case KW_Q5_K: KQ(q45k)(MB, KW_Q5_K, xq, xd, xs, K, g0, g1, acc); break;
    case KW_Q6_K: KQ(q6k)(MB, xq, xd, S, K, g0, g1, acc); break;
    case KW_IQ4_XS: KQ(iq4xs)(MB, xq, xd, S, K, g0, g1, acc); break;
    case KW_Q5_0: KQ(q32)(MB, KW_Q5_0, xq, xd, xs, S, K, g0, g1, acc); break;
    case KW_Q4_0: KQ(q32)(MB, KW_Q4_0, xq, xd, xs, S, K, g0, g1, acc); break;
    case KW_Q5_1: KQ(q32)(MB, KW_Q5_1, xq, xd, xs, S, K, g0, g1, acc); break;
    default: KQ(q32)(MB, KW_IQ4_NL, xq, xd, xs, S, K, g0, g1, acc); break;
    }
}

static void KQ(kq_rows)(int wtype, const int8_t *xq, const float *xd, const float *xs, const int16_t *S, int M, int K,
                        const uint8_t *g0, const uint8_t *g1, int N, int n0, float *y, long ldy, const float *bias,
                        const float *res, long ldr) {
    const int nb = K / QK, valid = N - n0 < KQ_LANES ? N - n0 : KQ_LANES;
    for (int m = 0; m < M; m += KQ_MB) {
        const int mb = M - m < KQ_MB ? M - m : KQ_MB;
        const int8_t *x = xq + (long)m * K;
        const float *d = xd + (long)m * nb, *s = xs + (long)m * nb;
        const int16_t *sm = S ? S + (long)m * (K / 16) : 0;
        kvf acc[KQ_MB];
        switch (mb) {
        case 1: KQ(tile)(1, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 2: KQ(tile)(2, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 3: KQ(tile)(3, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 4: KQ(tile)(4, wtype, x, d, s, sm, K, g0, g1, acc); break;
        }
        for (int i = 0; i < mb; ++i) {
            kvf v = acc[i];
#if KQ_LANES == 16
            const __mmask16 mask = (__mmask16)((1u << valid) - 1);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0));
            if (res) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, res + (long)(m + i) * ldr + n0), v);
            _mm512_mask_storeu_ps(y + (long)(m + i) * ldy + n0, mask, v);
#else
            store_tile8(v, bias ? bias + n0 : 0, res ? res + (long)(m + i) * ldr + n0 : 0, y + (long)(m + i) * ldy + n0,
                        valid);
#endif
        }
    }
}

#undef KQ
#undef KQ_MB
#undef kvi
#undef kvf
#undef VZERO
#undef VZEROF
#undef V8
#undef VAND
#undef VOR
#undef VSRL16
#undef VSLL16
#undef VSLL32
#undef VSRA32
#undef VADD32
#undef VSUB32
#undef VMULLO32
#undef VMADD16
#undef VDOT
#undef VSET32
#undef VSETF
#undef VCVT
#undef VFMA
#undef VFNMA
#undef VMULF
#undef VSHUF
#undef G1
#endif
