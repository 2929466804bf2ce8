/* ragspec CPU kernels on quantized weights (AVX2 + FMA + F16C): the lean Llama forward's building blocks.
 *
 * Weights stay in the GGUF block formats they were stored in (or that they were quantized to at load):
 *   Q8_0: blocks of 32 weights = fp16 scale d + 32 int8 q            (34 bytes),  w = d * q
 *   Q4_1: blocks of 32 weights = fp16 scale d + fp16 min m + 16 bytes (20 bytes), w = d * q + m, q in 0..15
 *         (byte t holds weight t in its low nibble and weight t + 16 in its high nibble)
 * Activations are quantized per row and per block of 32 to int8 (d_x = max|x| / 127, q_x = round(x / d_x)),
 * so a block's dot product is an exact integer sum (maddubs + madd), scaled once in fp32:
 *   Q8_0: d_w d_x sum(q_w q_x);   Q4_1: d_w d_x sum(q_w q_x) + m_w (d_x sum(q_x)).
 *
 * Batch invariance, as for the fp32 kernels: an output element is computed by the same operations whatever
 * the number of rows, their order, the tile they land in or the thread: the activation row is quantized by
 * itself; integer block sums are exact; the fp32 accumulation runs over blocks in order in fixed lanes and
 * ends with one fixed horizontal sum. The weight block is unpacked once per tile and reused by every row of
 * the tile, so a verify over several rows costs far less than that many decode steps.
 *
 * Every kernel here is a "part": it contains orphaned `omp for` loops and runs inside a parallel region,
 * so the whole forward of a layer shares one region (rs_* entry points open one for a single call).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
enum { W_Q8_0 = 1, W_Q4_1 = 2 };

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8q(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehl_ps(s, s);
    s = _mm_add_ps(s, sh);
    sh = _mm_shuffle_ps(s, s, 0x55);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

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

static inline __m256 block_dot(__m256i w_u8, __m256i x_s8) {
    __m256i p = _mm256_maddubs_epi16(w_u8, x_s8); /* |16-bit pair sums| <= 2 * 255 * 127: no saturation */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

static inline __m256i unpack_q4(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

/* One tile: MB activation rows x NB weight rows over all nb blocks; y = dot (+ bias) (+ residual). */
#define Q41_TILE(MB, NB)                                                                                      \
    static void q41_##MB##x##NB(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *w,  \
                                long ldw, float *y, long ldy, const float *bias, const float *res, long ldr) { \
        const int nb = K / QK;                                                                                \
        __m256 acc[MB][NB];                                                                                   \
        float mins[MB][NB];                                                                                   \
        for (int i = 0; i < MB; ++i)                                                                          \
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps(), mins[i][j] = 0.0f;                  \
        for (int b = 0; b < nb; ++b) {                                                                        \
            __m256i wv[NB];                                                                                   \
            float wd[NB], wm[NB];                                                                             \
            for (int j = 0; j < NB; ++j) {                                                                    \
                const uint8_t *blk = w + j * ldw + b * 20;                                                    \
                wd[j] = h2f(*(const uint16_t *)blk);                                                          \
                wm[j] = h2f(*(const uint16_t *)(blk + 2));                                                    \
                wv[j] = unpack_q4(blk + 4);                                                                   \
            }                                                                                                 \
            for (int i = 0; i < MB; ++i) {                                                                    \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (long)i * K + b * QK));          \
                const float dx = xd[(long)i * nb + b], sx = xs[(long)i * nb + b];                             \
                for (int j = 0; j < NB; ++j) {                                                                \
                    acc[i][j] = _mm256_fmadd_ps(block_dot(wv[j], xv), _mm256_set1_ps(wd[j] * dx), acc[i][j]); \
                    mins[i][j] += wm[j] * sx;                                                                 \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < MB; ++i)                                                                          \
            for (int j = 0; j < NB; ++j) {                                                                    \
                float s = hsum8q(acc[i][j]) + mins[i][j];                                                     \
                if (bias) s += bias[j];                                                                       \
                if (res) s = res[i * ldr + j] + s;                                                            \
                y[i * ldy + j] = s;                                                                           \
            }                                                                                                 \
    }

#define Q80_TILE(MB, NB)                                                                                      \
    static void q80_##MB##x##NB(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *w,  \
                                long ldw, float *y, long ldy, const float *bias, const float *res, long ldr) { \
        (void)xs;                                                                                             \
        const int nb = K / QK;                                                                                \
        __m256 acc[MB][NB];                                                                                   \
        for (int i = 0; i < MB; ++i)                                                                          \
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();                                     \
        for (int b = 0; b < nb; ++b) {                                                                        \
            __m256i wv[NB], wa[NB];                                                                           \
            float wd[NB];                                                                                     \
            for (int j = 0; j < NB; ++j) {                                                                    \
                const uint8_t *blk = w + j * ldw + b * 34;                                                    \
                wd[j] = h2f(*(const uint16_t *)blk);                                                          \
                wv[j] = _mm256_loadu_si256((const __m256i *)(blk + 2));                                       \
                wa[j] = _mm256_sign_epi8(wv[j], wv[j]); /* |q_w| as u8 (-128 -> 128) */                       \
            }                                                                                                 \
            for (int i = 0; i < MB; ++i) {                                                                    \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (long)i * K + b * QK));          \
                const float dx = xd[(long)i * nb + b];                                                        \
                for (int j = 0; j < NB; ++j)                                                                  \
                    acc[i][j] = _mm256_fmadd_ps(block_dot(wa[j], _mm256_sign_epi8(xv, wv[j])),                \
                                                _mm256_set1_ps(wd[j] * dx), acc[i][j]);                       \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < MB; ++i)                                                                          \
            for (int j = 0; j < NB; ++j) {                                                                    \
                float s = hsum8q(acc[i][j]);                                                                  \
                if (bias) s += bias[j];                                                                       \
                if (res) s = res[i * ldr + j] + s;                                                            \
                y[i * ldy + j] = s;                                                                           \
            }                                                                                                 \
    }

Q41_TILE(1, 4)
Q41_TILE(2, 4)
Q41_TILE(3, 2)
Q41_TILE(4, 2)
Q41_TILE(1, 1)
Q41_TILE(2, 1)
Q41_TILE(3, 1)
Q41_TILE(4, 1)
Q80_TILE(1, 4)
Q80_TILE(2, 2)
Q80_TILE(3, 2)
Q80_TILE(4, 2)
Q80_TILE(1, 1)
Q80_TILE(2, 1)
Q80_TILE(3, 1)
Q80_TILE(4, 1)

typedef void (*tile_fn)(const int8_t *, const float *, const float *, int, const uint8_t *, long, float *, long,
                        const float *, const float *, long);

/* tiles by rows (1..4): the wide one (NB of its name) and the one-weight-row tail */
static const tile_fn Q41_WIDE[5] = {0, q41_1x4, q41_2x4, q41_3x2, q41_4x2};
static const tile_fn Q41_ONE[5] = {0, q41_1x1, q41_2x1, q41_3x1, q41_4x1};
static const int Q41_NB[5] = {0, 4, 4, 2, 2};
static const tile_fn Q80_WIDE[5] = {0, q80_1x4, q80_2x2, q80_3x2, q80_4x2};
static const tile_fn Q80_ONE[5] = {0, q80_1x1, q80_2x1, q80_3x1, q80_4x1};
static const int Q80_NB[5] = {0, 4, 2, 2, 2};

/* Weight rows [n0, n1) for every activation row: each weight tile is unpacked once per 4 activation rows. */
static void qrows(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                  long ldw, int n0, int n1, float *y, long ldy, const float *bias, const float *res, long ldr) {
    const int nb = K / QK;
    for (int m = 0; m < M; m += 4) {
        const int mb = M - m < 4 ? M - m : 4;
        const tile_fn wide = wtype == W_Q4_1 ? Q41_WIDE[mb] : Q80_WIDE[mb];
        const tile_fn one = wtype == W_Q4_1 ? Q41_ONE[mb] : Q80_ONE[mb];
        const int NB = wtype == W_Q4_1 ? Q41_NB[mb] : Q80_NB[mb];
        const int8_t *xqm = xq + (long)m * K;
        const float *xdm = xd + (long)m * nb, *xsm = xs + (long)m * nb;
        const float *rm = res ? res + (long)m * ldr : 0;
        int n = n0;
        for (; n + NB <= n1; n += NB)
            wide(xqm, xdm, xsm, K, w + n * ldw, ldw, y + m * ldy + n, ldy, bias ? bias + n : 0, rm ? rm + n : 0, ldr);
        for (; n < n1; ++n)
            one(xqm, xdm, xsm, K, w + n * ldw, ldw, y + m * ldy + n, ldy, bias ? bias + n : 0, rm ? rm + n : 0, ldr);
    }
}

#define ROWS_PER_TASK 32 /* weight rows per task; a multiple of every tile width */

/* Quantize x [M, K] into the scratch (xq: M*K int8, xd / xs: M*K/32 floats each). */
void quantize_part(const float *x, long ldx, int M, int K, int8_t *xq, float *xd, float *xs) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) quantize_row(x + m * ldx, K, xq + (long)m * K, xd + (long)m * (K / QK), xs + (long)m * (K / QK));
}

/* y[M, N] = xq @ w^T (+ bias) (+ res): activations already quantized by quantize_part. */
void qmatmul_part(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *w, int wtype,
                  long ldw, int N, float *y, long ldy, const float *bias, const float *res, long ldr) {
    const int tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp for schedule(static)
    for (int t = 0; t < tasks; ++t) {
        const int n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
        qrows(xq, xd, xs, M, K, w, wtype, ldw, n0, n1, y, ldy, bias, res, ldr);
    }
}

/* y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias) (+ res, which may alias y): one call, its own threads. */
void rs_qlinear(const float *x, int M, int K, const uint8_t *w, int wtype, long ldw, int N, const float *bias,
                const float *res, float *y, int8_t *xq, float *xd, float *xs, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        quantize_part(x, K, M, K, xq, xd, xs);
        qmatmul_part(xq, xd, xs, M, K, w, wtype, ldw, N, y, N, bias, res, N);
    }
}

/* ---- dequantization (embedding rows, prefill tiles, references) ---------------------------------------- */

static void dequant_row(const uint8_t *row, int wtype, int K, float *out) {
    for (int b = 0; b < K / QK; ++b) {
        if (wtype == W_Q4_1) {
            const uint8_t *blk = row + b * 20;
            const float d = h2f(*(const uint16_t *)blk), m = h2f(*(const uint16_t *)(blk + 2));
            for (int t = 0; t < 16; ++t) {
                out[b * QK + t] = d * (float)(blk[4 + t] & 0x0F) + m;
                out[b * QK + t + 16] = d * (float)(blk[4 + t] >> 4) + m;
            }
        } else {
            const uint8_t *blk = row + b * 34;
            const float d = h2f(*(const uint16_t *)blk);
            for (int t = 0; t < QK; ++t) out[b * QK + t] = d * (float)((const int8_t *)(blk + 2))[t];
        }
    }
}

/* out[r, :] = dequant(w[rows[r], :]) for r < R. */
void rs_dequant_rows(const uint8_t *w, int wtype, long ldw, int K, const int64_t *rows, int R, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 64)
    for (int r = 0; r < R; ++r) dequant_row(w + rows[r] * ldw, wtype, K, out + (long)r * K);
}

/* ---- norms, rotary embedding, activation ---------------------------------------------------------------- */

/* y = x * rsqrt(mean(x^2) + eps) * weight, per row (sum of squares in 8 fixed lanes, then hsum). */
void rmsnorm_part(const float *x, long ldx, int M, int K, const float *weight, float eps, float *y, long ldy) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        __m256 acc = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8q(acc);
        for (; k < K; ++k) ss += xr[k] * xr[k];
        const float r = 1.0f / sqrtf(ss / (float)K + eps);
        for (k = 0; k < K; ++k) yr[k] = (xr[k] * r) * weight[k];
    }
}

/* Rotary embedding of the query and key heads of qkv rows [M, (H + 2G) * D] (q heads, k heads, v heads) at
   positions pos[m] (HF's rotate-half layout: pairs (t, t + D/2); tables cos / sin [positions, D/2]). Queries
   go to q [M, H * D]; keys and values are stored at cache row start + m (as fp16 when kv_half). */
void rope_store_part(const float *qkv, int M, int H, int G, int D, const int64_t *pos, const float *cos_t,
                     const float *sin_t, float *q, void *kbuf, void *vbuf, long kv_sh, long kv_sn, long start,
                     int kv_half) {
    const int half = D / 2;
    const long width = (long)(H + 2 * G) * D;
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        const float *row = qkv + m * width;
        const float *c = cos_t + pos[m] * half, *s = sin_t + pos[m] * half;
        float kr[256];
        for (int h = 0; h < H + G; ++h) {
            const float *src = row + (long)h * D;
            float *dst = h < H ? q + (long)m * H * D + (long)h * D : kr;
            for (int t = 0; t < half; ++t) {
                const float a = src[t], b = src[t + half];
                dst[t] = a * c[t] - b * s[t];
                dst[t + half] = b * c[t] + a * s[t];
            }
            if (h >= H) {
                const long off = (long)(h - H) * kv_sh + (start + m) * kv_sn;
                const float *vsrc = row + (long)(H + G) * D + (long)(h - H) * D;
                if (kv_half) {
                    uint16_t *kd = (uint16_t *)kbuf + off, *vd = (uint16_t *)vbuf + off;
                    for (int t = 0; t < D; t += 8) {
                        _mm_storeu_si128((__m128i *)(kd + t), _mm256_cvtps_ph(_mm256_loadu_ps(kr + t), _MM_FROUND_TO_NEAREST_INT));
                        _mm_storeu_si128((__m128i *)(vd + t), _mm256_cvtps_ph(_mm256_loadu_ps(vsrc + t), _MM_FROUND_TO_NEAREST_INT));
                    }
                } else {
                    memcpy((float *)kbuf + off, kr, sizeof(float) * D);
                    memcpy((float *)vbuf + off, vsrc, sizeof(float) * D);
                }
            }
        }
    }
}

/* exp(x) for x <= 0, elementwise (x below -87 gives 0): the softmax kernel's polynomial. */
static inline __m256 exp_neg(__m256 x) {
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

/* a[m, t] = silu(gu[m, t]) * gu[m, I + t] for gate / up rows gu [M, 2I] (I a multiple of 8). */
void silu_mul_part(const float *gu, int M, int I, float *a) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        const float *g = gu + (long)m * 2 * I, *u = g + I;
        float *o = a + (long)m * I;
        for (int t = 0; t < I; t += 8) {
            __m256 x = _mm256_loadu_ps(g + t);
            __m256 e = exp_neg(_mm256_or_ps(x, sign)); /* exp(-|x|) */
            __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
            __m256 num = _mm256_blendv_ps(e, one, pos); /* sigmoid = 1/(1+e) if x >= 0 else e/(1+e) */
            __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + t, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + t)));
        }
    }
}

/* ---- one decoder layer of a Llama-family model, in one parallel region ----------------------------------- */

typedef struct {
    const float *attn_norm, *ffn_norm;          /* [E] */
    const uint8_t *wqkv, *wo, *wgu, *wdown;     /* rows: (H+2G)*D, E, 2I, E */
    int t_qkv, t_o, t_gu, t_down;               /* W_Q8_0 / W_Q4_1 */
    long ld_qkv, ld_o, ld_gu, ld_down;          /* bytes per weight row */
    const float *b_qkv;                         /* optional q/k/v biases [(H+2G)*D] (Qwen2) */
} rs_layer_weights;

typedef struct {
    int E, H, G, D, I;
    float eps, scale;
} rs_shape;

void attention_f32_part(const float *, long, long, int, int, int, const void *, const void *, long, long, int, int,
                        const int32_t *, const int32_t *, float, float *, long, long, float *);
void attention_f16_part(const float *, long, long, int, int, int, const void *, const void *, long, long, int, int,
                        const int32_t *, const int32_t *, float, float *, long, long, float *);

/* Scratch (floats unless noted), per forward of M rows: h [M*E], qkv [M*(H+2G)*D], q [M*H*D], att [M*H*D],
   gu [M*2I], act [M*I], xq (int8) [M*max(E,I)], xd / xs [M*max(E,I)/32], work (attention). */
typedef struct {
    float *h, *qkv, *q, *att, *gu, *act, *xd, *xs, *work;
    int8_t *xq;
} rs_scratch;

/* x [M, E] <- layer(x); keys / values of the M rows written at cache rows start..start+M-1 (the visible
   rows of query i are 0..past-1 then path[path_off[i]..path_off[i+1]), past = start for a tree pass). */
void rs_layer(const rs_layer_weights *L, const rs_shape *S, float *x, int M, const int64_t *pos,
              const float *cos_t, const float *sin_t, void *kbuf, void *vbuf, long kv_sh, long kv_sn, long start,
              int kv_half, int past, const int32_t *path, const int32_t *path_off, const rs_scratch *T,
              int threads) {
    const int E = S->E, H = S->H, G = S->G, D = S->D, I = S->I;
    const int QKV = (H + 2 * G) * D;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        rmsnorm_part(x, E, M, E, L->attn_norm, S->eps, T->h, E);
        quantize_part(T->h, E, M, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->xq, T->xd, T->xs, M, E, L->wqkv, L->t_qkv, L->ld_qkv, QKV, T->qkv, QKV, L->b_qkv, 0, 0);
        rope_store_part(T->qkv, M, H, G, D, pos, cos_t, sin_t, T->q, kbuf, vbuf, kv_sh, kv_sn, start, kv_half);
#pragma omp barrier
        if (kv_half)
            attention_f16_part(T->q, D, (long)H * D, H, M, D, kbuf, vbuf, kv_sh, kv_sn, G, past, path, path_off,
                               S->scale, T->att, (long)H * D, D, T->work);
        else
            attention_f32_part(T->q, D, (long)H * D, H, M, D, kbuf, vbuf, kv_sh, kv_sn, G, past, path, path_off,
                               S->scale, T->att, (long)H * D, D, T->work);
        quantize_part(T->att, (long)H * D, M, H * D, T->xq, T->xd, T->xs);
        qmatmul_part(T->xq, T->xd, T->xs, M, H * D, L->wo, L->t_o, L->ld_o, E, x, E, 0, x, E);
        rmsnorm_part(x, E, M, E, L->ffn_norm, S->eps, T->h, E);
        quantize_part(T->h, E, M, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->xq, T->xd, T->xs, M, E, L->wgu, L->t_gu, L->ld_gu, 2 * I, T->gu, 2 * I, 0, 0, 0);
        silu_mul_part(T->gu, M, I, T->act);
        quantize_part(T->act, I, M, I, T->xq, T->xd, T->xs);
        qmatmul_part(T->xq, T->xd, T->xs, M, I, L->wdown, L->t_down, L->ld_down, E, x, E, 0, x, E);
    }
}

/* Final norm + LM head over the last `keep` rows of x [M, E]: logits [keep, V]. */
void rs_head(const float *x, int M, int keep, int E, const float *norm, float eps, const uint8_t *w, int wtype,
             long ldw, int V, float *logits, const rs_scratch *T, int threads) {
    const float *xs = x + (long)(M - keep) * E;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        rmsnorm_part(xs, E, keep, E, norm, eps, T->h, E);
        quantize_part(T->h, E, keep, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->xq, T->xd, T->xs, keep, E, w, wtype, ldw, V, logits, V, 0, 0, 0);
    }
}

int rs_quant_kernels_version(void) { return 1; }
