/* ragspec CPU kernels: the row operations of a forward (rows.h): activation quantization (what every quantized
 * format's kernel reads), RMSNorm, the rotary embedding and the KV store, the gated MLP's activation, Gemma's
 * post-norms and final soft-capping. Each row by the same operations whatever the rows beside it.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "formats.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#include "rows.h"

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

/* Quantize x [M, K] into the scratch (xq: M*K int8, xd / xs: M*K/32 floats each). */
void quantize_part(const float *x, long ldx, int M, int K, int8_t *xq, float *xd, float *xs) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) quantize_row(x + m * ldx, K, xq + (long)m * K, xd + (long)m * (K / QK), xs + (long)m * (K / QK));
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

void rope_store_row(const float *row, int H, int G, int D, int64_t pos, const float *cos_t,
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

/* Each row's queries and keys of qkv [M, (H + 2G) D] (ld floats a row) RMS-normalized across all their heads at once,
   in place (OLMoE: q_norm [H D], k_norm [G D]), before rope_store_row rotates them. */
void qk_norm_all_part(float *qkv, int M, long ld, int H, int G, int D, const float *q_norm, const float *k_norm,
                      float eps) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        float *r = qkv + (long)m * ld;
        rmsnorm_row(r, H * D, q_norm, eps, r);
        rmsnorm_row(r + (long)H * D, G * D, k_norm, eps, r + (long)H * D);
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
   0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3); 2: gpt-oss's clamped SwiGLU,
   x sigmoid(1.702 x) (y + 1), x = min(gate, 7), y = up clamped to [-7, 7] (the constants llama.cpp and transformers
   fix for it). */
void act_mul_quantize_part(const float *gu, int M, int I, int act, float *a, int8_t *xq, float *xd, float *xs) {
    const __m256 k0 = _mm256_set1_ps(2.0f * 0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f);
    const __m256 lim = _mm256_set1_ps(7.0f), neg = _mm256_set1_ps(-7.0f), alpha = _mm256_set1_ps(1.702f);
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        const float *g = gu + (long)m * 2 * I, *u = g + I;
        float *o = a + (long)m * I;
        for (int t = 0; t < I && act == 2; t += 8) {
            const __m256 x = _mm256_min_ps(_mm256_loadu_ps(g + t), lim);
            const __m256 y = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(u + t), lim), neg);
            const __m256 glu = _mm256_mul_ps(x, sigmoid8(_mm256_mul_ps(alpha, x)));
            _mm256_storeu_ps(o + t, _mm256_mul_ps(glu, _mm256_add_ps(y, one)));
        }
        for (int t = 0; t < I && act != 2; t += 8) {
            const __m256 x = _mm256_loadu_ps(g + t);
            const __m256 z = act ? _mm256_mul_ps(k0, _mm256_fmadd_ps(_mm256_mul_ps(k1, x), _mm256_mul_ps(x, x), x)) : x;
            _mm256_storeu_ps(o + t, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(z)), _mm256_loadu_ps(u + t)));
        }
        quantize_row(o, I, xq + (long)m * I, xd + (long)m * (I / QK), xs + (long)m * (I / QK));
    }
}

/* x [M, E] += rmsnorm(y) * weight, per row (y, scratch, is normed in place): Gemma's post-norms. */
void norm_add_part(float *y, int M, int E, const float *weight, float eps, float *x) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) {
        float *yr = y + (long)m * E, *xr = x + (long)m * E;
        rmsnorm_row(yr, E, weight, eps, yr);
        for (int k = 0; k < E; ++k) xr[k] += yr[k];
    }
}

/* y [n] <- cap * tanh(y / cap), tanh(u) = 2 sigmoid(2u) - 1 elementwise (Gemma 2's final logits; n a multiple of 8
   or the tail done alone, every element by the same operations). */
void soft_cap_part(float *y, long n, float cap) {
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
