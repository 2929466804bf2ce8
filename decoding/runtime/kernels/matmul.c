/* ragspec CPU kernels: the one dispatch by weight format (formats.h), for a matrix product and for dequantizing rows:
 * a switch naming every format, each to its kernel file (formats_q8_0_q4_1.c, formats_int.c, formats_float.c).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "api.h"
#include "formats.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#include "rows.h"

/* y[M, N] = x @ w^T (+ bias) (+ res): the activations x [M, K] (ldx floats a row) already quantized by quantize_part
   into xq / xd / xs, which the quantized formats read (the float formats read x); w packed, ldg bytes per group of 8
   rows; each format to its kernel file. */
void qmatmul_part(const float *x, long ldx, const int8_t *xq, const float *xd, const float *xs, int M, int K,
                  const uint8_t *w, int wtype, long ldg, int N, float *y, long ldy, const float *bias, const float *res,
                  long ldr) {
    switch ((rs_wtype)wtype) {
    case W_Q8_0: case W_Q4_1: q8_q41_matmul_part(xq, xd, xs, M, K, w, wtype, ldg, N, y, ldy, bias, res, ldr); return;
    case W_F16: case W_BF16: case W_F32: fl_matmul_part(x, ldx, M, K, w, wtype, ldg, N, y, ldy, bias, res, ldr); return;
    case W_Q4_K: case W_Q5_K: case W_Q6_K: case W_IQ4_XS: case W_Q5_0: case W_Q4_0: case W_Q5_1: case W_IQ4_NL:
    case W_Q2_K: case W_Q3_K: case W_MXFP4:
    case W_PARTS: kq_matmul_part(x, ldx, xq, xd, xs, M, K, w, wtype, ldg, N, y, ldy, bias, res, ldr); return;
    }
    rs_unknown_format(wtype);
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

/* ---- dequantization (embedding rows, references) ---- */

static void dequant_row(const uint8_t *group, int wtype, long ldg, int K, int j, float *out) {
    switch ((rs_wtype)wtype) {
    case W_Q8_0: case W_Q4_1: q8_q41_dequant_row(group, wtype, K, j, out); return;
    case W_F16: case W_BF16: case W_F32: fl_dequant_row(group, wtype, ldg, K, j, out); return;
    case W_Q4_K: case W_Q5_K: case W_Q6_K: case W_IQ4_XS: case W_Q5_0: case W_Q4_0: case W_Q5_1: case W_IQ4_NL:
    case W_Q2_K: case W_Q3_K: case W_MXFP4:
        kq_dequant_row(group, wtype, K, j, out);
        return;
    case W_PARTS: break; /* a parts matrix is dequantized part by part (Python) */
    }
    rs_unknown_format(wtype);
}

/* out[r, :] = dequant(w[rows[r], :]) for r < R (w packed, ldg bytes per group of 8 rows). */
void rs_dequant_rows(const uint8_t *w, int wtype, long ldg, int K, const int64_t *rows, int R, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 64)
    for (int r = 0; r < R; ++r) dequant_row(w + (rows[r] / 8) * ldg, wtype, ldg, K, (int)(rows[r] % 8), out + (long)r * K);
}
