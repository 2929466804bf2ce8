/* Vector helpers the kernel files use (AVX2 + FMA). Each is elementwise or a fixed reduction tree, so a
 * value's result never depends on its lane or on the call around it. */
#ifndef RAGSPEC_SIMD_H
#define RAGSPEC_SIMD_H
#include <immintrin.h>
#include <stdint.h>

/* Rows of the next activation tile when `left` rows remain for `tiles` tiles: tiles of even size, so no tile is a row
 * or two that reads a weight group's records again for little work (the tile a row lands in never changes its bits). */
static inline int even_tile(int left, int tiles) { return (left + tiles - 1) / tiles; }

/* An 8-column output tile's epilogue, the same for every weight format: v (+ bias) (+ the residual row), stored to
 * y; at the matrix's edge only the first `valid` columns are read and written. bias / res: this tile's columns, or
 * NULL. */
static inline void store_tile8(__m256 v, const float *bias, const float *res, float *y, int valid) {
    float out[8], extra[8];
    if (bias) {
        for (int j = 0; j < 8; ++j) extra[j] = j < valid ? bias[j] : 0.0f;
        v = _mm256_add_ps(v, _mm256_loadu_ps(extra));
    }
    if (res) {
        for (int j = 0; j < 8; ++j) extra[j] = j < valid ? res[j] : 0.0f;
        v = _mm256_add_ps(_mm256_loadu_ps(extra), v);
    }
    if (valid == 8) {
        _mm256_storeu_ps(y, v);
    } else {
        _mm256_storeu_ps(out, v);
        for (int j = 0; j < valid; ++j) y[j] = out[j];
    }
}

/* Keys per block of the attention on the bf16 tiles (attention.c); a cache keeps those blocks laid out for the
   tiles (its "tiled" blocks) below the first row a forward rewrites (forward.c's layer_batch). The vector bf16
   dot products keep blocks of 64 keys laid out the same way (rs_tile_keys says which a library keeps). */
#define TILE_KEYS 128

/* One sequence's attention in a forward (attention.c's attention_seqs_part): query i's q[h] at q + h*q_sh + i*q_sn,
 * its output at out + i*o_sn + h*o_sh; query i sees cache rows 0..past-1, then path[path_off[i] .. path_off[i+1]).
 * Cache row j of key head g: j < split (a prefix other sequences may share, whole blocks of 64 keys) at element
 * g*sh0 + (j - pre0)*kv_sn of k0 / v0; j >= split at element g*kv_sh + (j - own0)*kv_sn of k / v (the sequence's own
 * rows). pre0 / own0 (whole blocks, own0 >= split): the first row each holds, past the rows a sliding-window layer
 * dropped (its queries never read below them); 0 / split where nothing was dropped. */
typedef struct {
    const float *q;
    float *out;
    int n, past;
    const int32_t *path, *path_off;
    const void *k, *v, *k0, *v0;
    long kv_sh, sh0;
    int split;
    /* Optional, the bf16 dot products: whole blocks already laid out for them (kept in the cache from one forward to
       the next). Own block b (its rows split + 64b ..) at lay + g*lay_sh + b*(2*64*D), the first `laid` of them valid;
       the shared prefix's block b at lay0 + g*lay0_sh + b*(2*64*D), the first `laid0` valid. A block not yet laid out
       is laid out there by the forward reading it. */
    uint16_t *lay, *lay0;
    long lay_sh, lay0_sh;
    int laid, laid0;
    int window; /* a sliding window (0: none): query i sees only its last `window` keys (logical positions) */
    long own0, pre0;
    const float *sinks; /* optional, per query head (gpt-oss): a logit in every row's softmax with no value */
} att_seq;

/* The one horizontal sum: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)). */
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

#endif
