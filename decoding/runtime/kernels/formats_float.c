/* ragspec CPU kernels on unquantized GGUF weights, read as stored: F16, BF16 and F32 matrices (an "F16" or "BF16"
 * GGUF, or the odd F16 / F32 tensor of a quantized one). matmul.c's dispatch hands these formats here.
 *
 * Layout: the file's rows as they are (row-major, K weights each), in groups of 8 rows (zero rows pad the last
 * group), so a group is 8 * K * (2 or 4) bytes; nothing is rearranged (decoding/runtime/quant.py's pack_rows).
 *
 * Activations are the fp32 rows themselves (not the int8 ones the quantized formats read). Per output element, in
 * this order whatever the batch, the tile or the path: 8 fp32 partial sums, acc[t] = fma(x[k + t], w[k + t], acc[t])
 * for k = 0, 8, 16, ... in order, then simd.h's hsum8 (one fixed tree), then + bias, + res. Every ISA path runs
 * this same 256-bit code, so every path gives the same bits; the weights are the bandwidth a step costs, and a
 * tile of 4 activation rows x 2 weight rows reads each weight vector once for 4 rows.
 */
#include <immintrin.h>
#include <stdint.h>

#include "formats.h"
#include "simd.h"

#define FL_MB 4              /* activation rows per tile */
#define FL_GROUPS_PER_TASK 4 /* 32 weight rows per task, as the other formats */

static inline __m256 fl_load(const uint8_t *row, const int wtype, long k) {
    switch ((rs_wtype)wtype) {
    case W_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k)));
    case W_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * k))), 16));
    case W_F32: return _mm256_loadu_ps((const float *)row + k);
    default: break; /* not a float format: matmul.c's dispatch never sends one here */
    }
    rs_unknown_format(wtype);
}

/* out[i * 2 + r] = the dot products of MB activation rows and weight rows w0, w1 (w1 may be w0: its sums unused). */
static inline __attribute__((always_inline)) void fl_tile(const int MB, const int wtype, const float *x, long ldx,
                                                          int K, const uint8_t *w0, const uint8_t *w1, float *out) {
    __m256 a0[FL_MB], a1[FL_MB];
    for (int i = 0; i < MB; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8) {
        const __m256 v0 = fl_load(w0, wtype, k), v1 = fl_load(w1, wtype, k);
        for (int i = 0; i < MB; ++i) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            a0[i] = _mm256_fmadd_ps(xv, v0, a0[i]);
            a1[i] = _mm256_fmadd_ps(xv, v1, a1[i]);
        }
    }
    for (int i = 0; i < MB; ++i) out[2 * i] = hsum8(a0[i]), out[2 * i + 1] = hsum8(a1[i]);
}

static void fl_rows(const int wtype, const float *x, long ldx, int M, int K, const uint8_t *w, long row_bytes, int N,
                    int n0, int n1, float *y, long ldy, const float *bias, const float *res, long ldr) {
    for (int n = n0; n < n1; n += 2) {
        const int pair = n + 1 < n1;
        const uint8_t *w0 = w + n * row_bytes, *w1 = pair ? w0 + row_bytes : w0;
        for (int m = 0; m < M; m += FL_MB) {
            const int mb = M - m < FL_MB ? M - m : FL_MB;
            const float *xm = x + (long)m * ldx;
            float out[2 * FL_MB];
            switch (mb) {
            case 1: fl_tile(1, wtype, xm, ldx, K, w0, w1, out); break;
            case 2: fl_tile(2, wtype, xm, ldx, K, w0, w1, out); break;
            case 3: fl_tile(3, wtype, xm, ldx, K, w0, w1, out); break;
            default: fl_tile(4, wtype, xm, ldx, K, w0, w1, out); break;
            }
            for (int i = 0; i < mb; ++i)
                for (int r = 0; r <= pair; ++r) {
                    if (n + r >= N) continue;
                    float v = out[2 * i + r];
                    if (bias) v = v + bias[n + r];
                    if (res) v = res[(long)(m + i) * ldr + n + r] + v;
                    y[(long)(m + i) * ldy + n + r] = v;
                }
        }
    }
}

/* y[M, N] = x[M, K] @ w^T (+ bias) (+ res) for F16 / BF16 / F32 weights, ldg bytes per group of 8 rows (called by
   qmatmul_part, inside a parallel region). */
void fl_matmul_part(const float *x, long ldx, int M, int K, const uint8_t *w, int wtype, long ldg, int N, float *y,
                    long ldy, const float *bias, const float *res, long ldr) {
    const long row_bytes = ldg / 8;
    const int groups = (N + 7) / 8, tasks = (groups + FL_GROUPS_PER_TASK - 1) / FL_GROUPS_PER_TASK;
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        const int n0 = 8 * FL_GROUPS_PER_TASK * t, n1 = n0 + 8 * FL_GROUPS_PER_TASK < N ? n0 + 8 * FL_GROUPS_PER_TASK : N;
        fl_rows(wtype, x, ldx, M, K, w, row_bytes, N, n0, n1, y, ldy, bias, res, ldr);
    }
}

/* Row j of the group at `group` in fp32 (embedding rows, references). */
void fl_dequant_row(const uint8_t *group, int wtype, long ldg, int K, int j, float *out) {
    const uint8_t *row = group + j * (ldg / 8);
    for (int k = 0; k < K; ++k) {
        switch ((rs_wtype)wtype) {
        case W_F16: out[k] = _cvtsh_ss(((const uint16_t *)row)[k]); break;
        case W_BF16: {
            union { uint32_t u; float f; } v = {(uint32_t)((const uint16_t *)row)[k] << 16};
            out[k] = v.f;
            break;
        }
        case W_F32: out[k] = ((const float *)row)[k]; break;
        default: rs_unknown_format(wtype); /* not a float format */
        }
    }
}
