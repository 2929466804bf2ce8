/* ragspec CPU kernels: fp32 small-batch linear layers, for the transformers path's nn.Linear (cpu_quant "none",
 * decoding/runtime/kernels/patching.py). On a CPU a verify pass's GEMMs have M = 1..65 rows, where BLAS runs far
 * below the FMA rate: these stream each weight row once per call and reuse it for every input row. Batch
 * invariant: y[m, n] is an fma chain over k in 8-lane vectors, one fixed horizontal sum, a scalar tail, + bias,
 * whatever the rows beside it.
 */
#include <immintrin.h>
#include <stdint.h>

#include "api.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* the one reduction every dot product ends with */
static inline float finish_dot(__m256 acc, const float *x, const float *w, int k8, int K) {
    float s = hsum8(acc);
    for (int k = k8; k < K; ++k) s += x[k] * w[k];
    return s;
}

/* Block of MB input rows x NB weight rows: y[i * ldy + j] = dot(x_i, w_j) * scale (+ bias[j]).
   pf (optional): the next block's weight rows, prefetched while this block computes, so streaming the
   weights from memory overlaps the FMAs. */
#define DOT_BLOCK(MB, NB)                                                                                  \
    static void dot_##MB##x##NB(const float *x, long ldx, const float *w, long ldw, int K, float *y,       \
                                long ldy, const float *bias, float scale, const float *pf) {               \
        __m256 acc[MB][NB];                                                                                \
        for (int i = 0; i < MB; ++i)                                                                       \
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();                                   \
        const int k8 = K & ~7;                                                                             \
        for (int k = 0; k < k8; k += 8) {                                                                  \
            if (pf && (k & 15) == 0)                                                                       \
                for (int j = 0; j < NB; ++j) _mm_prefetch((const char *)(pf + j * ldw + k), _MM_HINT_T0);  \
            __m256 xv[MB];                                                                                 \
            for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);                        \
            for (int j = 0; j < NB; ++j) {                                                                 \
                __m256 wv = _mm256_loadu_ps(w + j * ldw + k);                                              \
                for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);            \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MB; ++i)                                                                       \
            for (int j = 0; j < NB; ++j) {                                                                 \
                float s = finish_dot(acc[i][j], x + i * ldx, w + j * ldw, k8, K) * scale;                  \
                y[i * ldy + j] = bias ? s + bias[j] : s;                                                   \
            }                                                                                              \
    }

DOT_BLOCK(1, 1)
DOT_BLOCK(2, 1)
DOT_BLOCK(3, 1)
DOT_BLOCK(1, 4)
DOT_BLOCK(2, 4)
DOT_BLOCK(3, 4)

typedef void (*dot_fn)(const float *, long, const float *, long, int, float *, long, const float *, float,
                       const float *);

static const dot_fn DOT4[4] = {0, dot_1x4, dot_2x4, dot_3x4};
static const dot_fn DOT1[4] = {0, dot_1x1, dot_2x1, dot_3x1};

/* y[m, n] for m in [0, M), n in [n0, n1): weight rows stream once, each block of 4 reused by all rows. */
static void dot_rows(const float *x, long ldx, int M, const float *w, long ldw, int n0, int n1, int K, float *y,
                     long ldy, const float *bias, float scale) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
        for (int m = 0; m < M; m += 3) {
            int mb = M - m < 3 ? M - m : 3;
            const float *pf = (m == 0 && n + 8 <= n1) ? w + (n + 4) * ldw : 0;
            DOT4[mb](x + m * ldx, ldx, w + n * ldw, ldw, K, y + m * ldy + n, ldy, bias ? bias + n : 0, scale, pf);
        }
    }
    for (; n < n1; ++n) {
        for (int m = 0; m < M; m += 3) {
            int mb = M - m < 3 ? M - m : 3;
            DOT1[mb](x + m * ldx, ldx, w + n * ldw, ldw, K, y + m * ldy + n, ldy, bias ? bias + n : 0, scale, 0);
        }
    }
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]); rows of x and y contiguous with leading dims K and N. */
void rs_linear_f32(const float *x, int M, int K, const float *w, int N, const float *bias, float *y, int threads) {
    const int chunk = 64; /* weight rows per task: a multiple of 4, so blocking is the same in every task */
    const int tasks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < tasks; ++t) {
        int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        dot_rows(x, K, M, w, K, n0, n1, K, y, N, bias, 1.0f);
    }
}
