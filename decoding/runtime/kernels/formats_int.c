/* ragspec CPU kernels on GGUF's block formats beyond Q8_0 / Q4_1, read as stored, one file per format: q2_k.h (Q2_K,
 * Q3_K), q4_k.h (Q4_K, Q5_K), q6_k.h (Q6_K), q32.h (the 32-weight blocks Q5_0, Q4_0, Q5_1 and IQ4_NL), iq4_xs.h
 * (IQ4_XS), each holding the format's GGUF block, its packed layout, the order of its arithmetic, its kernel and its
 * scalar dequantization; and a "parts" matrix: rows of several formats, e.g. a fused q/k/v whose v is Q6_K and q, k
 * Q4_K, each part computed in its own format. matmul.c's qmatmul_part and dequant_row hand these formats here
 * (kq_matmul_part, kq_dequant_row).
 *
 * Packed ("x8") as the other formats are: rows in groups of 8 (zero rows pad the last), per group and block one
 * record of the 8 rows' bytes rearranged (decoding/runtime/quant.py's pack_rows; no value changes, the same bytes
 * but for the 6-bit scales Q3_K to Q5_K and IQ4_XS unpack: at most 1.036x), where a "chunk" of 32 bytes holds 4 bytes
 * of each row in turn (bytes 4j..4j+3: row j). One integer instruction on a chunk against 4 activations broadcast to
 * every lane then adds 4 products to each of 8 rows' sums (16 rows on 512-bit vectors: two groups side by side).
 *
 * Activations are the same int8 rows every format reads (rows.c's quantize_row: per row and block of 32,
 * d_x = max|x| / 127, q_x = round(x / d_x), s_x = d_x sum(q_x)); Q6_K, Q5_0, Q4_0 and the IQ4s also read the rows'
 * integer sums per 16 (S, made per thread from q_x). Per output element, each format runs its steps (in its file) in
 * one order whatever the batch, the tile, the lane or the path, every sum of integers exact, then y = acc (+ bias)
 * (+ res), as the other formats. The AVX2 path sums byte products with maddubs (int16 pairs, never more than fit;
 * the IQ4 values signed, so |v| times x with v's sign) and madd; AVX-512 VNNI with dpbusd (one or two chains a row);
 * both reach the same integers and run the same fp32 steps, so every path gives the same bits (the AMX build runs
 * these formats on its AVX-512 vectors). The template body below is compiled once per vector width (kq_lanes.h).
 */
#ifndef KQ_LANES
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#define QK_K 256

/* IQ4_NL's and IQ4_XS's 16 weight values (ggml-common.h's kvalues_iq4nl), as int8 and plus 128 as uint8 (the VNNI
   paths multiply unsigned weights by signed activations, then take 128 times the activations' sum back off). */
static const int8_t kq_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const uint8_t kq_iq4_plus128[16] __attribute__((unused)) = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
/* MXFP4's 16 E2M1 values, doubled to integers (ggml's kvalues_mxfp4), likewise. */
static const int8_t kq_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const uint8_t kq_mxfp4_plus128[16] __attribute__((unused)) = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};
/* An E8M0 scale byte as the float 2^(e - 128), half the scale (the values are doubled): ggml's bits exactly. */
static inline float kq_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#define GROUPS_PER_TASK 4 /* 32 weight rows per task, as formats_q8_0_q4_1.c */
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
#include "formats_int.c"
#undef KQ_LANES
#if KQ_VNNI
#define KQ_LANES 16
#include "formats_int.c"
#undef KQ_LANES
#endif

/* Weight groups [g0, g1) for every activation row. On AVX-512, two groups at a time on 16 lanes (fewer instructions a
   weight) where the pair table says (formats.h: measured per CPU; a pair reads two streams of weights at once,
   which made one row from memory about twice as slow on an EPYC), else one group at a time: the same bits. */
static void kq_groups(int wtype, const int8_t *xq, const float *xd, const float *xs, const int16_t *S, int M, int K,
                      const uint8_t *w, long ldg, int N, int g0, int g1, float *y, long ldy, const float *bias,
                      const float *res, long ldr) {
#if KQ_VNNI
    for (; rs_pairs(M) && g0 + 1 < g1; g0 += 2)
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
    if (wtype == W_PARTS) {
        kq_parts(x, ldx, xq, xd, xs, M, K, (const int64_t *)w, y, ldy, bias, res, ldr);
        return;
    }
    const int sums = wtype != W_Q4_K && wtype != W_Q5_K && wtype != W_Q5_1;
    const int16_t *S = sums ? kq_bsums(xq, M, K) : 0; /* every thread its own */
    const int groups = (N + 7) / 8, tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        const int g0 = t * GROUPS_PER_TASK, g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
        kq_groups(wtype, xq, xd, xs, S, M, K, w, ldg, N, g0, g1, y, ldy, bias, res, ldr);
    }
}

/* ---- dequantization of one packed row (embedding rows, references): each format's own, in fp32 ---------------- */

#include "q2_k.h"
#include "q4_k.h"
#include "q6_k.h"
#include "q32.h"
#include "iq4_xs.h"

void kq_dequant_row(const uint8_t *group, int wtype, int K, int j, float *out) {
    switch ((rs_wtype)wtype) {
    case W_Q4_K: kq_dequant_q45k(group, 0, K, j, out); break;
    case W_Q5_K: kq_dequant_q45k(group, 1, K, j, out); break;
    case W_Q6_K: kq_dequant_q6k(group, K, j, out); break;
    case W_IQ4_XS: kq_dequant_iq4xs(group, K, j, out); break;
    case W_Q5_0: case W_Q4_0: case W_Q5_1: case W_IQ4_NL: case W_MXFP4: kq_dequant_q32(group, wtype, K, j, out); break;
    case W_Q2_K: kq_dequant_q23k(group, 0, K, j, out); break;
    case W_Q3_K: kq_dequant_q23k(group, 1, K, j, out); break;
    default: rs_unknown_format(wtype); /* not one of this file's formats */
    }
}

#else /* ---- the body, once per KQ_LANES: each format's kernel, then a tile and a group's rows ------------------- */

#include "kq_lanes.h"
#include "q2_k.h"
#include "q4_k.h"
#include "q6_k.h"
#include "q32.h"
#include "iq4_xs.h"

/* ---- a group (8 lanes) or pair of groups (16 lanes) for every activation row --------------------------------- */
static inline __attribute__((always_inline)) void KQ(tile)(const int MB, int wtype, const int8_t *xq,
                                                            const float *xd, const float *xs, const int16_t *S,
                                                            int K, const uint8_t *g0, const uint8_t *g1, kvf *acc) {
    switch ((rs_wtype)wtype) {
    case W_Q4_K: KQ(q45k)(MB, W_Q4_K, xq, xd, xs, K, g0, g1, acc); break;
    case W_Q5_K: KQ(q45k)(MB, W_Q5_K, xq, xd, xs, K, g0, g1, acc); break;
    case W_Q6_K: KQ(q6k)(MB, xq, xd, S, K, g0, g1, acc); break;
    case W_IQ4_XS: KQ(iq4xs)(MB, xq, xd, S, K, g0, g1, acc); break;
    case W_Q5_0: KQ(q32)(MB, W_Q5_0, xq, xd, xs, S, K, g0, g1, acc); break;
    case W_Q4_0: KQ(q32)(MB, W_Q4_0, xq, xd, xs, S, K, g0, g1, acc); break;
    case W_Q5_1: KQ(q32)(MB, W_Q5_1, xq, xd, xs, S, K, g0, g1, acc); break;
    case W_IQ4_NL: KQ(q32)(MB, W_IQ4_NL, xq, xd, xs, S, K, g0, g1, acc); break;
    case W_MXFP4: KQ(q32)(MB, W_MXFP4, xq, xd, xs, S, K, g0, g1, acc); break;
    case W_Q2_K: KQ(q23k)(MB, W_Q2_K, xq, xd, S, K, g0, g1, acc); break;
    case W_Q3_K: KQ(q23k)(MB, W_Q3_K, xq, xd, S, K, g0, g1, acc); break;
    default: rs_unknown_format(wtype); /* not one of this file's formats */
    }
}

static void KQ(kq_rows)(int wtype, const int8_t *xq, const float *xd, const float *xs, const int16_t *S, int M, int K,
                        const uint8_t *g0, const uint8_t *g1, int N, int n0, float *y, long ldy, const float *bias,
                        const float *res, long ldr) {
    const int nb = K / QK, valid = N - n0 < KQ_LANES ? N - n0 : KQ_LANES;
    for (int m = 0, tiles = (M + KQ_MB - 1) / KQ_MB, mb; m < M; m += mb, --tiles) {
        mb = even_tile(M - m, tiles);
        const int8_t *x = xq + (long)m * K;
        const float *d = xd + (long)m * nb, *s = xs + (long)m * nb;
        const int16_t *sm = S ? S + (long)m * (K / 16) : 0;
        kvf acc[KQ_MB];
        switch (mb) {
        case 1: KQ(tile)(1, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 2: KQ(tile)(2, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 3: KQ(tile)(3, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 4: KQ(tile)(4, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 5: KQ(tile)(5, wtype, x, d, s, sm, K, g0, g1, acc); break;
        case 6: KQ(tile)(6, wtype, x, d, s, sm, K, g0, g1, acc); break;
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

#include "kq_lanes.h"
#endif
