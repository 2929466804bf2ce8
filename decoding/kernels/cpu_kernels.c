/* ragspec CPU kernels (AVX2 + FMA, fp32): small-batch linear layers and decode / tree-verify attention.
 *
 * Why: on a CPU the target's forward over a handful of tokens (a verify pass) is dominated by GEMMs with
 * M = 1..65 rows, where the BLAS kernels run far below the machine's FMA rate, and by attention over the
 * cached document, where the generic SDPA kernel reads the cache at a fraction of memory bandwidth. These
 * kernels stream each weight row / cached key row once per call and reuse it for every query row.
 *
 * Batch invariance (the property the lossless tests rely on): every output element is computed by the same
 * sequence of floating-point operations whatever the number of rows computed together, the row's position in
 * the batch, or the thread that runs it. A token verified inside a draft tree therefore gets bit-for-bit the
 * logits it gets when decoded alone, and speculative greedy output equals plain greedy output exactly.
 *   - linear: y[m, n] = fma-chain over k in 8-lane vectors, one fixed horizontal sum, scalar tail, + bias.
 *   - attention: a query attends to an explicit list of visible cache rows (the fully visible prefix, then
 *     its own path). Scores use the same dot routine; the softmax max, exp, sum and the weighted sum of values
 *     run over the visible keys in position order with lanes fixed by position.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehl_ps(s, s);
    s = _mm_add_ps(s, sh);
    sh = _mm_shuffle_ps(s, s, 0x55);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* the one reduction every dot product ends with */
static inline float finish_dot(__m256 acc, const float *x, const float *w, int k8, int K) {
    float s = hsum8(acc);
    for (int k = k8; k < K; ++k) s += x[k] * w[k];
    return s;
}

/* Block of MB input rows x NB weight rows: y[i * ldy + j] = dot(x_i, w_j) * scale (+ bias[j]).
   pf (optional): the next block's weight rows, prefetched while this block computes, so streaming the
   weights from memory overlaps the FMAs (measured: all GEMMs of a SmolLM2 forward, 5 rows, 57 -> 50 ms). */
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

/* exp for x <= 0 (softmax after subtracting the max); x below -87 gives 0. Elementwise, so a value's result
   never depends on its lane. */
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, p);
}

/* In place: s[0..P) <- exp(s - max); returns the sum (lanes fixed by index, padded tail). */
static float softmax_numerators(float *s, int P) {
    __m256 mx = _mm256_set1_ps(-INFINITY); /* max is exact: any order gives the same value */
    int j = 0;
    for (; j + 8 <= P; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float m = -INFINITY;
    for (int t = 0; t < 8; ++t) m = lanes[t] > m ? lanes[t] : m;
    for (; j < P; ++j) m = s[j] > m ? s[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= P; j += 8) {
        __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (j < P) {
        float tail[8];
        for (int t = 0; t < 8; ++t) tail[t] = j + t < P ? s[j + t] : m;
        __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(tail), mv));
        _mm256_storeu_ps(tail, e);
        for (int t = 0; t < 8; ++t) {
            if (j + t < P) s[j + t] = tail[t];
            else tail[t] = 0.0f;
        }
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(tail));
    }
    return hsum8(acc);
}

#define MAX_D 256

/* Eight scores at once: r[t] = hsum8(a[t]) for t = 0..7, each by exactly hsum8's addition tree
   ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), so a key scored in a block of eight gets the bits it gets
   scored alone. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 b01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    __m256 b23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    __m256 b45 = _mm256_add_ps(_mm256_permute2f128_ps(a[4], a[5], 0x20), _mm256_permute2f128_ps(a[4], a[5], 0x31));
    __m256 b67 = _mm256_add_ps(_mm256_permute2f128_ps(a[6], a[7], 0x20), _mm256_permute2f128_ps(a[6], a[7], 0x31));
    /* per 128-bit half: [x0 + x2, x1 + x3] of two keys */
    __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b01, b23, 0x44), _mm256_shuffle_ps(b01, b23, 0xEE));
    __m256 d = _mm256_add_ps(_mm256_shuffle_ps(b45, b67, 0x44), _mm256_shuffle_ps(b45, b67, 0xEE));
    /* half 0 holds keys 0, 2, 4, 6; half 1 keys 1, 3, 5, 7 */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c, d, 0x88), _mm256_shuffle_ps(c, d, 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* s[t] = dot(q, k_row(j0 + t)) * scale for t = 0..7: lane sums over d in 8-lane chunks, then hsum8x8. */
static inline void score8(const float *q, int dv, const float *k, long ldk, float scale, float *s) {
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    for (int c = 0; c < dv; ++c) {
        __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + t * ldk + 8 * c), acc[t]);
    }
    _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
}

/* One score by the same operations as a lane of score8. */
static inline float score1(const float *q, int dv, const float *k, float scale) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < dv; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), acc);
    return hsum8(acc) * scale;
}

#define KEY_BLOCK 64 /* cached key rows per scoring task: stay in L1 while every query row of the group reads them */
#define VCHUNK 4     /* 8-float vectors of the head dim per value task */

/* Attention of n new tokens (H query heads, G key/value heads, head dim D).
 *   q[h, i, d] at q + h*q_sh + i*q_sn;  k/v[g, j, d] at k + g*kv_sh + j*kv_sn;  out[i, h, d] at out + i*o_sn + h*o_sh
 *   query i sees cache rows 0..past-1, then rows path[path_off[i] .. path_off[i+1]) (ascending positions).
 *   work: H * n * (past + max path length) + H * n floats, shared by the threads.
 * Three phases over all heads at once, each split into tasks whose results do not depend on who runs them:
 *   1. scores of the prefix, by (key head, block of KEY_BLOCK keys): the block is read once for the group's
 *      query heads and all n queries;
 *   2. per query row: its path scores, then max, exp and the sum (lanes fixed by position);
 *   3. weighted values, by (key head, chunk of VCHUNK vectors of the head dim): blocks of KEY_BLOCK value
 *      rows stay in L1 while the group's rows, three at a time, add them in; every output element sums its
 *      visible keys in position order (prefix, then its path).
 * D must be a multiple of 8 and at most MAX_D. */
void rs_attention_f32(const float *q, long q_sh, long q_sn, int H, int n, int D, const float *k, const float *v,
                      long kv_sh, long kv_sn, int G, int past, const int32_t *path, const int32_t *path_off,
                      float scale, float *out, long o_sn, long o_sh, float *work, int threads) {
    int maxpath = 0;
    for (int i = 0; i < n; ++i) {
        int len = path_off[i + 1] - path_off[i];
        maxpath = len > maxpath ? len : maxpath;
    }
    const long lds = (long)past + maxpath;
    const int group = H / G;
    const int dv = D / 8;
    const int rows = H * n; /* row r = h * n + i */
    float *S = work;
    float *denom = work + (long)rows * lds;
    const int kblocks = (past + KEY_BLOCK - 1) / KEY_BLOCK;
    const int gr = group * n;            /* rows per key head */
    const int vchunks = (dv + VCHUNK - 1) / VCHUNK;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < G * kblocks; ++task) {
            const int g = task / kblocks;
            const int j0 = (task % kblocks) * KEY_BLOCK;
            const int j1 = j0 + KEY_BLOCK < past ? j0 + KEY_BLOCK : past;
            const float *kg = k + g * kv_sh;
            for (int h = g * group; h < (g + 1) * group; ++h)
                for (int i = 0; i < n; ++i) {
                    const float *qi = q + h * q_sh + i * q_sn;
                    float *s = S + (long)(h * n + i) * lds;
                    int j = j0;
                    for (; j + 8 <= j1; j += 8) score8(qi, dv, kg + (long)j * kv_sn, kv_sn, scale, s + j);
                    for (; j < j1; ++j) s[j] = score1(qi, dv, kg + (long)j * kv_sn, scale);
                }
        }
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; ++r) {
            const int h = r / n, i = r % n;
            const float *qi = q + h * q_sh + i * q_sn;
            const float *kg = k + (h / group) * kv_sh;
            float *s = S + (long)r * lds;
            for (int t = path_off[i]; t < path_off[i + 1]; ++t)
                s[past + t - path_off[i]] = score1(qi, dv, kg + (long)path[t] * kv_sn, scale);
            denom[r] = softmax_numerators(s, past + path_off[i + 1] - path_off[i]);
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < G * vchunks; ++task) {
            const int g = task / vchunks;
            const int c0 = (task % vchunks) * VCHUNK;
            const int nc = dv - c0 < VCHUNK ? dv - c0 : VCHUNK;
            const float *vg = v + g * kv_sh + 8 * c0;
            __m256 acc[3][VCHUNK];
            /* running sums live in `out` between key blocks; a block of value rows stays in L1 for all rows */
            for (int r = g * gr; r < (g + 1) * gr; ++r) {
                float *o = out + (r % n) * o_sn + (r / n) * o_sh + 8 * c0;
                for (int c = 0; c < nc; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_setzero_ps());
            }
            for (int j0 = 0; j0 < past; j0 += KEY_BLOCK) {
                const int j1 = j0 + KEY_BLOCK < past ? j0 + KEY_BLOCK : past;
                for (int ra = g * gr; ra < (g + 1) * gr; ra += 3) {
                    const int nr = (g + 1) * gr - ra < 3 ? (g + 1) * gr - ra : 3;
                    float *o[3];
                    const float *pr[3];
                    for (int a = 0; a < nr; ++a) {
                        o[a] = out + ((ra + a) % n) * o_sn + ((ra + a) / n) * o_sh + 8 * c0;
                        pr[a] = S + (long)(ra + a) * lds;
                    }
                    if (nc == VCHUNK && nr == 3) {
                        /* 12 independent sums: enough in flight to hide the FMA latency of the j-ordered chains */
                        for (int a = 0; a < 3; ++a)
                            for (int c = 0; c < VCHUNK; ++c) acc[a][c] = _mm256_loadu_ps(o[a] + 8 * c);
                        for (int j = j0; j < j1; ++j) {
                            const float *vr = vg + (long)j * kv_sn;
                            __m256 w0 = _mm256_set1_ps(pr[0][j]), w1 = _mm256_set1_ps(pr[1][j]);
                            __m256 w2 = _mm256_set1_ps(pr[2][j]);
                            for (int c = 0; c < VCHUNK; ++c) {
                                __m256 vv = _mm256_loadu_ps(vr + 8 * c);
                                acc[0][c] = _mm256_fmadd_ps(w0, vv, acc[0][c]);
                                acc[1][c] = _mm256_fmadd_ps(w1, vv, acc[1][c]);
                                acc[2][c] = _mm256_fmadd_ps(w2, vv, acc[2][c]);
                            }
                        }
                        for (int a = 0; a < 3; ++a)
                            for (int c = 0; c < VCHUNK; ++c) _mm256_storeu_ps(o[a] + 8 * c, acc[a][c]);
                    } else {
                        for (int a = 0; a < nr; ++a) {
                            for (int c = 0; c < nc; ++c) acc[0][c] = _mm256_loadu_ps(o[a] + 8 * c);
                            for (int j = j0; j < j1; ++j) {
                                const float *vr = vg + (long)j * kv_sn;
                                __m256 w = _mm256_set1_ps(pr[a][j]);
                                for (int c = 0; c < nc; ++c) acc[0][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[0][c]);
                            }
                            for (int c = 0; c < nc; ++c) _mm256_storeu_ps(o[a] + 8 * c, acc[0][c]);
                        }
                    }
                }
            }
            for (int r = g * gr; r < (g + 1) * gr; ++r) {
                const int h = r / n, i = r % n;
                float *o = out + i * o_sn + h * o_sh + 8 * c0;
                const float *pi = S + (long)r * lds + past;
                for (int c = 0; c < nc; ++c) acc[0][c] = _mm256_loadu_ps(o + 8 * c);
                for (int t = path_off[i]; t < path_off[i + 1]; ++t) {
                    __m256 w = _mm256_set1_ps(pi[t - path_off[i]]);
                    const float *vr = vg + (long)path[t] * kv_sn;
                    for (int c = 0; c < nc; ++c) acc[0][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[0][c]);
                }
                __m256 inv = _mm256_set1_ps(1.0f / denom[r]);
                for (int c = 0; c < nc; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[0][c], inv));
            }
        }
    }
}

int rs_kernels_version(void) { return 2; }
