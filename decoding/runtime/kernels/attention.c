/* ragspec CPU kernels (AVX2 + FMA + F16C; on 16 lanes where built with AVX-512, on the bf16 tiles where built with
 * AMX and the cache is bf16): the decode / tree-verify attention both CPU runtimes use (fp32, fp16, bf16 or int8 KV
 * cache).
 *
 * Why: on a CPU a verify pass over a long document is dominated by attention over the cached document, where the
 * generic SDPA kernel reads the cache at a fraction of memory bandwidth. These kernels stream each cached key row
 * once per call and reuse it for every query row.
 *
 * Batch invariance (the property the lossless tests rely on): every output element is computed by the same
 * sequence of floating-point operations whatever the number of rows computed together, the row's position in
 * the batch, or the thread that runs it. A token verified inside a draft tree therefore gets bit-for-bit the
 * logits it gets when decoded alone, and speculative greedy output equals plain greedy output exactly.
 * A query attends to an explicit list of visible cache rows (the fully visible prefix, then
 * its own path), taken in blocks of 64 logical positions; each block gives a partial (its max, sum of exp,
 * weighted values, all in key order with lanes fixed by position) and the partials combine in block order,
 * so the result depends only on the query's visible keys, never on where they are stored or who else is in
 * the forward.
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


/* s <- cap * tanh(s / cap) (Gemma 2's attention soft-capping), elementwise: tanh(y) = sign(y) (1 - e) / (1 + e),
   e = exp(-2|y|), so a score's value does not depend on its neighbours. */
static void soft_cap(float *s, int P, float cap) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), inv = _mm256_set1_ps(1.0f / cap);
    const __m256 two = _mm256_set1_ps(-2.0f), c = _mm256_set1_ps(cap);
    for (int j = 0; j < P; j += 8) {
        float tail[8];
        const int k = P - j < 8 ? P - j : 8;
        for (int t = 0; t < 8; ++t) tail[t] = t < k ? s[j + t] : 0.0f;
        const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(tail), inv);
        const __m256 e = exp_nonpos(_mm256_mul_ps(_mm256_andnot_ps(sign, y), two));
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(tail, _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(y, sign)), c));
        for (int t2 = 0; t2 < k; ++t2) s[j + t2] = tail[t2];
    }
}

/* In place: s[0..P) <- exp(s - max) (after soft_cap when cap > 0); returns the sum (lanes fixed by index, padded
   tail), the max in *mx_out. */
static float softmax_numerators(float *s, int P, float *mx_out, float cap) {
    if (cap > 0.0f) soft_cap(s, P, cap);
    __m256 mx = _mm256_set1_ps(-INFINITY); /* max is exact: any order gives the same value */
    int j = 0;
    for (; j + 8 <= P; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float m = -INFINITY;
    for (int t = 0; t < 8; ++t) m = lanes[t] > m ? lanes[t] : m;
    for (; j < P; ++j) m = s[j] > m ? s[j] : m;
    *mx_out = m;
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

/* Four scores at once: r[t] = hsum8(a[t]) for t = 0..3, each by exactly hsum8's addition tree
   ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), so a key scored in a group of four gets the bits it gets
   scored alone. */
static inline __m128 hsum4x8(const __m256 *a) {
    __m256 b01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    __m256 b23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    /* half 0: [x0 + x2, x1 + x3] of keys 0 and 2; half 1: of keys 1 and 3 */
    __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b01, b23, 0x44), _mm256_shuffle_ps(b01, b23, 0xEE));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c, c, 0x88), _mm256_shuffle_ps(c, c, 0xDD));
    return _mm256_castps256_ps128(_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* Cached keys / values are fp32, fp16, int8 or bf16 (`kvm` 0 / 1 / 2 / 3): each is widened to fp32 on load, so
   the arithmetic after the load is the same for every storage type. fp16 and bf16 widen exactly; an int8 row holds
   its D values then one fp32 scale per 32 (q * d, one rounding: the same value wherever it is loaded). Rows
   are addressed by their first element (`row`, in elements of the storage type: bytes for int8) and a chunk
   of 8 values `c` (dv chunks a row). */
static inline float kv_scale(const void *base, long row, int c, int dv) {
    float d;
    memcpy(&d, (const char *)base + row + 8 * dv + 4 * (c / 4), sizeof d);
    return d;
}
#define LOADKV(base, row, c, dv)                                                                                \
    (kvm == 2 ? _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                                          \
                                  _mm_loadl_epi64((const __m128i *)((const int8_t *)(base) + (row) + 8 * (c))))), \
                              _mm256_set1_ps(kv_scale((base), (row), (c), (dv))))                                \
     : kvm == 1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(base) + (row) + 8 * (c))))  \
     : kvm == 3 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(                                   \
                      _mm_loadu_si128((const __m128i *)((const uint16_t *)(base) + (row) + 8 * (c)))), 16))      \
                : _mm256_loadu_ps((const float *)(base) + (row) + 8 * (c)))

#ifdef __AVX512F__
static inline __m512 join256(__m256 lo, __m256 hi) { /* AVX-512F only (insertf32x8 needs DQ) */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m256 high256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

#endif

/* One score: lane sums of q * k over d in 8-lane chunks (in chunk order), hsum8, times scale. Every score in
   the kernel is computed by exactly these operations, alone or four keys at a time. */
static inline __attribute__((always_inline)) float score1(const float *q, int dv, const void *k, long off,
                                                          float scale, const int kvm) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < dv; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), LOADKV(k, off, c, dv), acc);
    return hsum8(acc) * scale;
}

/* Phase 1's tasks ahead whose block a verify's rows prefetch into L2. With the next block alone prefetched (into L1,
   which holds this block and the next, no more) a core had one block's misses in flight, and a verify's products
   and the cache's reads ran one after the other: at 7.5K a 1-node verify cost 1.4 plain steps, 1.13 with this
   (min of 15 rounds, interleaved). Plain decoding (one tile of rows a block) measured no gain and skips it. */
#define L2_AHEAD 3
#define KEY_BLOCK 64 /* keys per block, by logical position (the row's visible keys in order: prefix, then path) */
#define ROW_TILE 3   /* query rows that share each loaded key / value vector (a GQA group of 3 heads fits) */

/* RB <= ROW_TILE query rows q[r] against one block of cnt <= KEY_BLOCK keys / values (rows ldk / ldv apart):
 *   scores s = q . k * scale; per row the block max m[r], l[r] = sum_j exp(s_j - m), and
 *   part[r][0..D) = sum_j exp(s_j - m) v_j, summed over j in key order.
 * Each key / value vector is loaded (and widened) once for all RB rows; per element the operations are those
 * of one row alone (score1's chain and tree, the value sum in key order), so the result depends only on the
 * row and its keys. pf_k / pf_v (optional): the next block's keys / values, prefetched while this one computes
 * (pf_lines cache lines each), so streaming the cache overlaps the arithmetic. */
static inline __attribute__((always_inline)) void rows_block(
    const int RB, const float *const *q, int dv, const void *kb, long ldk, const void *vb, long ldv, int cnt,
    float scale, float cap, float *const *part, float *const *m, float *const *l, const int kvm, const char *pf_k,
    const char *pf_v, int pf_lines) {
    float p[ROW_TILE][KEY_BLOCK] __attribute__((aligned(32)));
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        if (pf_k)
            for (int t = (j / 4) * pf_lines / (KEY_BLOCK / 4); t < (j / 4 + 1) * pf_lines / (KEY_BLOCK / 4); ++t)
                _mm_prefetch(pf_k + 64 * t, _MM_HINT_T0);
        __m256 acc[ROW_TILE][4];
        for (int r = 0; r < RB; ++r)
            for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_setzero_ps();
        for (int c = 0; c < dv; ++c)
            for (int t = 0; t < 4; ++t) {
                const __m256 kv = LOADKV(kb, (long)(j + t) * ldk, c, dv);
                for (int r = 0; r < RB; ++r) acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + 8 * c), kv, acc[r][t]);
            }
        for (int r = 0; r < RB; ++r) _mm_store_ps(p[r] + j, _mm_mul_ps(hsum4x8(acc[r]), _mm_set1_ps(scale)));
    }
    for (; j < cnt; ++j)
        for (int r = 0; r < RB; ++r) p[r][j] = score1(q[r], dv, kb, (long)j * ldk, scale, kvm);
    for (int r = 0; r < RB; ++r) *l[r] = softmax_numerators(p[r], cnt, m[r], cap);
    /* 4 dims chunks x RB rows of sums in registers per pass; each element still sums over j in key order */
    int c0 = 0;
    for (; c0 + 4 <= dv; c0 += 4) {
        __m256 acc[ROW_TILE][4];
        for (int r = 0; r < RB; ++r)
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
        for (j = 0; j < cnt; ++j) {
            if (pf_v && c0 == 0 && j % 2 == 0)
                for (int t = (j / 2) * pf_lines / (KEY_BLOCK / 2); t < (j / 2 + 1) * pf_lines / (KEY_BLOCK / 2); ++t)
                    _mm_prefetch(pf_v + 64 * t, _MM_HINT_T0);
            __m256 w[ROW_TILE];
            for (int r = 0; r < RB; ++r) w[r] = _mm256_broadcast_ss(p[r] + j);
            for (int c = 0; c < 4; ++c) {
                const __m256 vv = LOADKV(vb, (long)j * ldv, c0 + c, dv);
                for (int r = 0; r < RB; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], vv, acc[r][c]);
            }
        }
        for (int r = 0; r < RB; ++r)
            for (int c = 0; c < 4; ++c) _mm256_storeu_ps(part[r] + 8 * (c0 + c), acc[r][c]);
    }
    for (; c0 < dv; ++c0) {
        __m256 acc[ROW_TILE];
        for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
        for (j = 0; j < cnt; ++j) {
            const __m256 vv = LOADKV(vb, (long)j * ldv, c0, dv);
            for (int r = 0; r < RB; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + j), vv, acc[r]);
        }
        for (int r = 0; r < RB; ++r) _mm256_storeu_ps(part[r] + 8 * c0, acc[r]);
    }
}

/* rows_block over any number of rows, ROW_TILE at a time (the tile a row lands in changes nothing). The next
 * block's pf_lines lines are prefetched once, spread evenly over the tiles: with many rows a steady stream that
 * the arithmetic hides, not a burst in the first tile that stalls on the memory system's queues (prefetching
 * changes no arithmetic). */
static inline __attribute__((always_inline)) void rows_blocks_direct(
    int R, const float *const *q, int dv, const void *kb, long ldk, const void *vb, long ldv, int cnt, float scale,
    float cap, float *const *part, float *const *m, float *const *l, const int kvm, const char *pf_k,
    const char *pf_v, int pf_lines) {
    const int tiles = (R + ROW_TILE - 1) / ROW_TILE;
    for (int r = 0, ti = 0; r < R; r += ROW_TILE, ++ti) {
        const int l0 = ti * pf_lines / tiles, lines = (ti + 1) * pf_lines / tiles - l0;
        const char *fk = pf_k && lines ? pf_k + 64 * l0 : 0, *fv = pf_v && lines ? pf_v + 64 * l0 : 0;
        switch (R - r < ROW_TILE ? R - r : ROW_TILE) {
        case 1: rows_block(1, q + r, dv, kb, ldk, vb, ldv, cnt, scale, cap, part + r, m + r, l + r, kvm, fk, fv, lines); break;
        case 2: rows_block(2, q + r, dv, kb, ldk, vb, ldv, cnt, scale, cap, part + r, m + r, l + r, kvm, fk, fv, lines); break;
        default: rows_block(3, q + r, dv, kb, ldk, vb, ldv, cnt, scale, cap, part + r, m + r, l + r, kvm, fk, fv, lines);
        }
    }
}
#ifndef __AVX512F__
#define rows_blocks rows_blocks_direct
#else
/* The AVX-512 version: the same operations per element, on 512-bit registers. The block's keys are widened once
 * for every tile of rows into pairs (chunk c of keys j and j + 1 side by side: 8 + 8 lanes, so each lane runs the
 * 8-lane chain of the AVX2 code and the two halves take hsum4x8's tree), its values into fp32 rows of 16-lane
 * chunks (each element still sums over j in key order). So every path gives the AVX2 path's bits. */
#define ROW_TILE_Z 6 /* query rows per tile: 2 accumulators each, 6 tiles' worth of registers */

/* score of key j from the pair layout: score1's chain and tree exactly */
static inline float score_pair(const float *qd, int dv, const float *kp, int j, float scale) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < dv; ++c)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qd + 16 * c), _mm256_loadu_ps(kp + ((long)(j / 2) * dv + c) * 16 + (j & 1) * 8), acc);
    return hsum8(acc) * scale;
}

static inline __attribute__((always_inline)) void rows_block_z(
    const int RB, const float *const *q, int dv, const float *kp, const float *vf, int cnt, float scale, float cap,
    float *const *part, float *const *m, float *const *l) {
    float p[ROW_TILE_Z][KEY_BLOCK] __attribute__((aligned(64)));
    float qd[ROW_TILE_Z][2 * MAX_D] __attribute__((aligned(64))); /* each 8-chunk of q twice */
    const int D = 8 * dv;
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < dv; ++c) {
            const __m256 q8 = _mm256_loadu_ps(q[r] + 8 * c);
            _mm512_store_ps(qd[r] + 16 * c, join256(q8, q8));
        }
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        __m512 acc[ROW_TILE_Z][2];
        for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const float *k01 = kp + (long)(j / 2) * dv * 16, *k23 = k01 + (long)dv * 16;
        for (int c = 0; c < dv; ++c) {
            const __m512 ka = _mm512_load_ps(k01 + 16 * c), kb = _mm512_load_ps(k23 + 16 * c);
            for (int r = 0; r < RB; ++r) {
                const __m512 qv = _mm512_load_ps(qd[r] + 16 * c);
                acc[r][0] = _mm512_fmadd_ps(qv, ka, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(qv, kb, acc[r][1]);
            }
        }
        for (int r = 0; r < RB; ++r) {
            const __m256 a[4] = {_mm512_castps512_ps256(acc[r][0]), high256(acc[r][0]),
                                 _mm512_castps512_ps256(acc[r][1]), high256(acc[r][1])};
            _mm_store_ps(p[r] + j, _mm_mul_ps(hsum4x8(a), _mm_set1_ps(scale)));
        }
    }
    for (; j < cnt; ++j)
        for (int r = 0; r < RB; ++r) p[r][j] = score_pair(qd[r], dv, kp, j, scale);
    for (int r = 0; r < RB; ++r) *l[r] = softmax_numerators(p[r], cnt, m[r], cap);
    int c0 = 0;
    for (; c0 + 4 <= dv; c0 += 4) { /* 32 dims per pass: two 16-lane sums per row */
        __m512 acc[ROW_TILE_Z][2];
        for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (j = 0; j < cnt; ++j) {
            const __m512 v0 = _mm512_load_ps(vf + (long)j * D + 8 * c0), v1 = _mm512_load_ps(vf + (long)j * D + 8 * c0 + 16);
            for (int r = 0; r < RB; ++r) {
                const __m512 w = _mm512_set1_ps(p[r][j]);
                acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);
            }
        }
        for (int r = 0; r < RB; ++r) {
            _mm512_storeu_ps(part[r] + 8 * c0, acc[r][0]);
            _mm512_storeu_ps(part[r] + 8 * c0 + 16, acc[r][1]);
        }
    }
    for (; c0 < dv; ++c0) {
        __m256 acc[ROW_TILE_Z];
        for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
        for (j = 0; j < cnt; ++j) {
            const __m256 vv = _mm256_load_ps(vf + (long)j * D + 8 * c0);
            for (int r = 0; r < RB; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + j), vv, acc[r]);
        }
        for (int r = 0; r < RB; ++r) _mm256_storeu_ps(part[r] + 8 * c0, acc[r]);
    }
}

static inline __attribute__((always_inline)) void rows_blocks(
    int R, const float *const *q, int dv, const void *kb, long ldk, const void *vb, long ldv, int cnt, float scale,
    float cap, float *const *part, float *const *m, float *const *l, const int kvm, const char *pf_k,
    const char *pf_v, int pf_lines) {
    if (R <= ROW_TILE) { /* a tile or less: widening the block first does not pay */
        rows_blocks_direct(R, q, dv, kb, ldk, vb, ldv, cnt, scale, cap, part, m, l, kvm, pf_k, pf_v, pf_lines);
        return;
    }
    const int D = 8 * dv;
    float kp[KEY_BLOCK * MAX_D] __attribute__((aligned(64)));
    float vf[KEY_BLOCK * MAX_D] __attribute__((aligned(64)));
    for (int j = 0; j < cnt; ++j)
        for (int c = 0; c < dv; ++c) {
            _mm256_store_ps(kp + ((long)(j / 2) * dv + c) * 16 + (j & 1) * 8, LOADKV(kb, (long)j * ldk, c, dv));
            _mm256_store_ps(vf + (long)j * D + 8 * c, LOADKV(vb, (long)j * ldv, c, dv));
        }
    const int tiles = (R + ROW_TILE_Z - 1) / ROW_TILE_Z;
    for (int r = 0, ti = 0; r < R; r += ROW_TILE_Z, ++ti) {
        const int l0 = ti * pf_lines / tiles, lines = (ti + 1) * pf_lines / tiles - l0;
        for (int t = 0; pf_k && t < lines; ++t) {
            _mm_prefetch(pf_k + 64 * (l0 + t), _MM_HINT_T0);
            _mm_prefetch(pf_v + 64 * (l0 + t), _MM_HINT_T0);
        }
        switch (R - r < ROW_TILE_Z ? R - r : ROW_TILE_Z) {
        case 1: rows_block_z(1, q + r, dv, kp, vf, cnt, scale, cap, part + r, m + r, l + r); break;
        case 2: rows_block_z(2, q + r, dv, kp, vf, cnt, scale, cap, part + r, m + r, l + r); break;
        case 3: rows_block_z(3, q + r, dv, kp, vf, cnt, scale, cap, part + r, m + r, l + r); break;
        case 4: rows_block_z(4, q + r, dv, kp, vf, cnt, scale, cap, part + r, m + r, l + r); break;
        case 5: rows_block_z(5, q + r, dv, kp, vf, cnt, scale, cap, part + r, m + r, l + r); break;
        default: rows_block_z(6, q + r, dv, kp, vf, cnt, scale, cap, part + r, m + r, l + r);
        }
    }
}
#endif

/* rows_blocks as attention_part calls it: one function per KV storage (kvm a constant in each), for a whole block
 * (cnt = KEY_BLOCK, known when compiled; the next block prefetched) or any count (no prefetch). Inlined at each of
 * attention_part's four call sites, in each of its four storages, it made the compiler take three times as long for
 * the same arithmetic (a call per block of keys and rows tile costs nothing next to it). */
#define ROWS_ARGS                                                                                                  \
    int R, const float *const *q, int dv, const void *kb, long ldk, const void *vb, long ldv, float scale,        \
        float cap, float *const *part, float *const *m, float *const *l
#define ROWS_BLOCKS_OF(MODE)                                                                                       \
    static __attribute__((noinline)) void rows_full_##MODE(ROWS_ARGS, const char *pf_k, const char *pf_v,         \
                                                           int pf_lines) {                                        \
        rows_blocks(R, q, dv, kb, ldk, vb, ldv, KEY_BLOCK, scale, cap, part, m, l, MODE, pf_k, pf_v, pf_lines);        \
    }                                                                                                              \
    static __attribute__((noinline)) void rows_any_##MODE(ROWS_ARGS, int cnt) {                                    \
        rows_blocks(R, q, dv, kb, ldk, vb, ldv, cnt, scale, cap, part, m, l, MODE, 0, 0, 0);                           \
    }
ROWS_BLOCKS_OF(0)
ROWS_BLOCKS_OF(1)
ROWS_BLOCKS_OF(2)
ROWS_BLOCKS_OF(3)
#undef ROWS_BLOCKS_OF
#undef ROWS_ARGS
/* kvm: a constant where these are used (attention_part_0 .. _3), so each picks its function when compiled */
#define ROWS_FULL(kvm, ...)                                                                                        \
    ((kvm) == 0   ? rows_full_0(__VA_ARGS__)                                                                       \
     : (kvm) == 1 ? rows_full_1(__VA_ARGS__)                                                                       \
     : (kvm) == 2 ? rows_full_2(__VA_ARGS__)                                                                       \
                  : rows_full_3(__VA_ARGS__))
#define ROWS_ANY(kvm, ...)                                                                                         \
    ((kvm) == 0   ? rows_any_0(__VA_ARGS__)                                                                        \
     : (kvm) == 1 ? rows_any_1(__VA_ARGS__)                                                                        \
     : (kvm) == 2 ? rows_any_2(__VA_ARGS__)                                                                        \
                  : rows_any_3(__VA_ARGS__))

#ifdef __AVX512F__
/* ---- bf16 blocks: the layout the tiles and the vector bf16 dot products read, the numerators' exp ------------ */
/* r[i] <- column i of the 16 x 16 dwords r (rows i) */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + e], 128-bit lane L: column 4L + e of rows 4i .. 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
        t[e] = _mm512_shuffle_i32x4(a, c, 0x88), t[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
        t[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88), t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

#define TILE_U16 512 /* bf16 values in one 1 KB tile */

/* Keys 16s .. 16s + 15 of a block of cnt (rows >= cnt read as 0; bf16 rows ldk elements apart) transposed to dim
   pairs x 16 keys: kt[(s * D/32 + c) * TILE_U16 + 32 p] holds dims 32c + 2p, 32c + 2p + 1 of each of the 16 keys. */
static inline void key_group(const uint16_t *kb, long ldk, int cnt, int D, int s, uint16_t *kt) {
    const int nc = D / 32;
    for (int c = 0; c < nc; ++c) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
            r[j] = s * 16 + j < cnt ? _mm512_loadu_si512(kb + (long)(s * 16 + j) * ldk + 32 * c) : _mm512_setzero_si512();
        transpose16_epi32(r);
        uint16_t *dst = kt + (long)(s * nc + c) * TILE_U16;
        for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + 32 * p, r[p]);
    }
}

/* The tiles of one block of cnt <= TILE_KEYS keys / values (bf16 rows ldk / ldv elements apart; rows >= cnt read
 * as 0; pf_k / pf_v, optional: the next block's, prefetched): kt[(s * D/32 + c) * TILE_U16]: keys 16s.. and dims 32c.. as tdpbf16ps's B (16 dim pairs x 16 keys);
 * vp[(h * D/16 + c) * TILE_U16]: keys 32h.. and dims 16c.. as B (16 key pairs x 16 dims). */
static void block_tiles(const uint16_t *kb, long ldk, const uint16_t *vb, long ldv, int cnt, int D, uint16_t *kt,
                        uint16_t *vp, const uint16_t *pf_k, const uint16_t *pf_v) {
    const int nc = D / 32;
    for (int s = 0; s * 16 < cnt; ++s) {
        if (pf_k) /* the next block's rows 16s .. 16s + 15 (its keys and values), while this one is laid out */
            for (int j = 16 * s; j < 16 * s + 16; ++j)
                for (int e = 0; e < 2 * D; e += 64) {
                    _mm_prefetch((const char *)(pf_k + j * ldk) + e, _MM_HINT_T0);
                    _mm_prefetch((const char *)(pf_v + j * ldv) + e, _MM_HINT_T0);
                }
        key_group(kb, ldk, cnt, D, s, kt);
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; 2 * p < cnt; ++p) { /* key pair p: keys 2p, 2p + 1 interleaved per dim */
        const int h = p / 16, row = p % 16;
        const uint16_t *a = vb + (long)(2 * p) * ldv, *b = vb + (long)(2 * p + 1) * ldv;
        for (int c = 0; c < nc; ++c) {
            const __m512i va = _mm512_loadu_si512(a + 32 * c);
            const __m512i vv = 2 * p + 1 < cnt ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(vp + (long)(h * 2 * nc + 2 * c) * TILE_U16 + 32 * row, _mm512_permutex2var_epi16(va, lo, vv));
            _mm512_store_si512(vp + (long)(h * 2 * nc + 2 * c + 1) * TILE_U16 + 32 * row, _mm512_permutex2var_epi16(va, hi, vv));
        }
    }
    if (cnt % 32) /* the last key half's pairs past the block: zero (0 x 0 adds nothing) */
        for (int p = (cnt + 1) / 2; p % 16; ++p)
            for (int c = 0; c < 2 * nc; ++c)
                _mm512_store_si512(vp + (long)((p / 16) * 2 * nc + c) * TILE_U16 + 32 * (p % 16), _mm512_setzero_si512());
}

/* exp(x) for the numerators, zero in lanes not in `keep`: 2^n 2^f (n = round(x log2 e), |f| <= 1/2, 2^f by a
   degree-4 polynomial, relative error ~4e-5: far below the bf16 rounding that follows). */
static inline __m512 exp_bf16(__mmask16 keep, __m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

static inline __m512 bf16_lo(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 bf16_hi(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

#endif

#if defined(__AVX512F__) && !(defined(__AMX_BF16__) && defined(__AVX512BF16__))
/* ---- bf16 dot products on vectors (AVX-512 BF16, a bf16 KV cache, D a multiple of 32) ----------------------------
 * Where the CPU has vdpbf16ps, a bf16 cache's attention multiplies bf16 operands with fp32 sums, two products per
 * lane and instruction: twice the fp32 FMA's work per instruction, and no horizontal sums. A block is laid out once
 * for every row reading it (block_tiles: keys transposed to 16 keys x dim pairs, values to key pairs x 16 dims), so
 *   score(key) = sum over dim pairs, in order, of q16 . k16 (one lane per key; q16 = bf16(q * scale), as the tiles'),
 *   numerators exp(s - max) rounded to bf16 and summed as they are multiplied (the tiles' softmax, units_softmax),
 *   part(dim) = sum over key pairs, in key order, of p16 . v16 (one lane per dim).
 * Each lane's chain depends only on its row and its keys, never on the rows beside it: the same invariance as the
 * fp32 code, with other rounding (the bf16 operands), so this path's bits are its own. */
#define DOT16 1
#pragma GCC push_options
#pragma GCC target("avx512bf16")

#define DOT16_ROWS 4 /* rows per register tile: 4 x 4 accumulators */

/* A block laid out for the dot products: its keys as the tiles' (key_group), its values by key pair p and 16-dim
 * chunk: vp[((p / 16) * D/16 + cc) * TILE_U16 + 32 (p % 16)], dword i = (v_2p, v_2p+1) of one dim, interleaved by
 * unpacklo / unpackhi (one cheap shuffle each): chunk 2c + e, lane 4L + i holds dim 32c + 8L + 4e + i (undone once
 * per row at the end, dot16_dims). Pairs past cnt are not read. */
static void dot16_layout(const uint16_t *kb, long ldk, const uint16_t *vb, long ldv, int cnt, int D, uint16_t *kt,
                         uint16_t *vp) {
    const int nc = D / 32;
    for (int s = 0; s * 16 < cnt; ++s) key_group(kb, ldk, cnt, D, s, kt);
    for (int p = 0; 2 * p < cnt; ++p) {
        const uint16_t *a = vb + (long)(2 * p) * ldv, *b = vb + (long)(2 * p + 1) * ldv;
        uint16_t *dst = vp + (long)(p / 16) * 2 * nc * TILE_U16 + 32 * (p % 16);
        for (int c = 0; c < nc; ++c) {
            const __m512i va = _mm512_loadu_si512(a + 32 * c);
            const __m512i vb2 = 2 * p + 1 < cnt ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(dst + (long)(2 * c) * TILE_U16, _mm512_unpacklo_epi16(va, vb2));
            _mm512_store_si512(dst + (long)(2 * c + 1) * TILE_U16, _mm512_unpackhi_epi16(va, vb2));
        }
    }
}

/* RB rows against one laid-out block of cnt keys: part[r][0..D), m[r], l[r] as rows_block gives them. pf_k / pf_v
   (optional): `lines` cache lines of the next block's keys / values, prefetched a few at a time as the products run
   (a burst would stall on the memory system's queues; prefetching changes no arithmetic). */
static inline __attribute__((always_inline)) void rows_dot16(const int RB, const float *const *q, int D, int cnt,
                                                              float scale, const uint16_t *kt, const uint16_t *vp,
                                                              float *const *part, float *const *m, float *const *l,
                                                              const char *pf_k, const char *pf_v, int lines) {
    const int nc = D / 32, ns = (cnt + 15) / 16, nv = (cnt + 31) / 32 * 2, np = (cnt + 1) / 2;
    uint32_t qa[DOT16_ROWS][MAX_D / 2] __attribute__((aligned(64)));
    uint32_t pa[DOT16_ROWS][KEY_BLOCK / 2] __attribute__((aligned(64)));
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < nc; ++c)
            _mm512_store_si512(qa[r] + 16 * c,
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q[r] + 32 * c + 16), sv),
                                                            _mm512_mul_ps(_mm512_loadu_ps(q[r] + 32 * c), sv)));
    __m512 s[DOT16_ROWS][4];
    for (int r = 0; r < RB; ++r)
        for (int g = 0; g < 4; ++g) s[r][g] = _mm512_setzero_ps();
    const int pf_qk = (lines + 16 * nc - 1) / (16 * nc), pf_pv = (lines + np - 1) / np; /* lines a step */
    int pf_next = 0;
    for (int c = 0; c < nc; ++c)
        for (int p = 0; p < 16; ++p) {
            if (pf_k)
                for (const int e1 = pf_next + pf_qk < lines ? pf_next + pf_qk : lines; pf_next < e1; ++pf_next)
                    _mm_prefetch(pf_k + 64 * pf_next, _MM_HINT_T0);
            __m512bh qb[DOT16_ROWS];
            for (int r = 0; r < RB; ++r) qb[r] = (__m512bh)_mm512_set1_epi32((int)qa[r][16 * c + p]);
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)
                if (g < ns) {
                    const __m512bh kv = (__m512bh)_mm512_load_si512(kt + ((long)(g * nc + c) * TILE_U16 + 32 * p));
                    for (int r = 0; r < RB; ++r) s[r][g] = _mm512_dpbf16_ps(s[r][g], qb[r], kv);
                }
        }
    __mmask16 keep[4];
    for (int g = 0; g < 4; ++g) {
        const int left = cnt - 16 * g;
        keep[g] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    }
    for (int r = 0; r < RB; ++r) { /* the tiles' softmax (units_softmax) on this row's four vectors */
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int g = 0; g < 4; ++g) mx = _mm512_mask_max_ps(mx, keep[g], mx, s[r][g]);
        const float mr = _mm512_reduce_max_ps(mx);
        const __m512 mv = _mm512_set1_ps(mr);
        __m512 sum = _mm512_setzero_ps();
        for (int g = 0; g < nv; g += 2) {
            const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(exp_bf16(keep[g + 1], _mm512_sub_ps(s[r][g + 1], mv)),
                                                            exp_bf16(keep[g], _mm512_sub_ps(s[r][g], mv)));
            _mm512_store_si512(pa[r] + 8 * g, pb);
            sum = _mm512_add_ps(sum, _mm512_add_ps(bf16_lo(pb), bf16_hi(pb)));
        }
        *m[r] = mr;
        *l[r] = _mm512_reduce_add_ps(sum);
    }
    for (int c0 = 0; c0 < D / 16; c0 += 4) { /* 64 dims a pass: four 16-lane sums per row */
        const int nd = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
        __m512 acc[DOT16_ROWS][4];
        for (int r = 0; r < RB; ++r)
            for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_setzero_ps();
        pf_next = 0;
        for (int t = 0; t < np; ++t) {
            if (pf_v && c0 == 0)
                for (const int e1 = pf_next + pf_pv < lines ? pf_next + pf_pv : lines; pf_next < e1; ++pf_next)
                    _mm_prefetch(pf_v + 64 * pf_next, _MM_HINT_T0);
            const uint16_t *vt = vp + ((long)((t / 16) * (D / 16) + c0) * TILE_U16 + 32 * (t % 16));
            __m512bh vv[4];
#pragma GCC unroll 4
            for (int d = 0; d < 4; ++d)
                if (d < nd) vv[d] = (__m512bh)_mm512_load_si512(vt + (long)d * TILE_U16);
            for (int r = 0; r < RB; ++r) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pa[r][t]);
#pragma GCC unroll 4
                for (int d = 0; d < 4; ++d)
                    if (d < nd) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], pb, vv[d]);
            }
        }
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int r = 0; r < RB; ++r) /* chunks 2c, 2c + 1 (dot16_layout's lanes) back to dims 32c .. 32c + 31 */
            for (int d = 0; d < nd; d += 2) {
                _mm512_storeu_ps(part[r] + 16 * (c0 + d), _mm512_permutex2var_ps(acc[r][d], first, acc[r][d + 1]));
                _mm512_storeu_ps(part[r] + 16 * (c0 + d) + 16, _mm512_permutex2var_ps(acc[r][d], second, acc[r][d + 1]));
            }
    }
}

/* Lines [a, b) of the laid-out keys / values k, v (none where k is 0) into L2 only (Zen 4 and later honour the
   hint). */
static inline void prefetch_l2(const char *k, const char *v, int a, int b) {
    for (int t = a; k && t < b; ++t) {
        _mm_prefetch(k + 64 * t, _MM_HINT_T1);
        _mm_prefetch(v + 64 * t, _MM_HINT_T1);
    }
}

/* R rows against one block laid out in kt / vp (block_tiles), in tiles of up to DOT16_ROWS rows of even size (the
   tile a row lands in changes nothing); the next block's pf_lines lines (pf_k / pf_v, optional) prefetched evenly
   over the tiles, and as many of the block L2_AHEAD tasks ahead (l2_k / l2_v, optional) into L2. A whole block of
   a verify's rows (more than one tile) runs loops unrolled for its tile size; a single tile (plain decoding's GQA
   group) keeps the rolled loops, between whose steps the prefetches stream the cache better (unrolled, plain
   decoding at 7.5K measured ~12% slower). */
static void rows_blocks_dot16(int R, const float *const *q, int D, int cnt, float scale, const uint16_t *kt,
                              const uint16_t *vp, float *const *part, float *const *m, float *const *l,
                              const char *pf_k, const char *pf_v, int pf_lines, const char *l2_k, const char *l2_v) {
    const int tiles = (R + DOT16_ROWS - 1) / DOT16_ROWS;
    const int whole = D == 64 && cnt == KEY_BLOCK, unrolled = whole && R > DOT16_ROWS; /* the latter: a verify's */
    for (int r = 0, ti = 0, rb; r < R; r += rb, ++ti) {
        const int l0 = ti * pf_lines / tiles, n = (ti + 1) * pf_lines / tiles - l0;
        prefetch_l2(l2_k, l2_v, l0, l0 + n);
        const char *fk = pf_k && n ? pf_k + 64 * l0 : 0, *fv = pf_v && n ? pf_v + 64 * l0 : 0;
        rb = even_tile(R - r, tiles - ti);
#define ROWS_DOT16(RB, DD, CNT) rows_dot16(RB, q + r, DD, CNT, scale, kt, vp, part + r, m + r, l + r, fk, fv, n)
        if (whole && rb == DOT16_ROWS)
            ROWS_DOT16(DOT16_ROWS, 64, KEY_BLOCK);
        else if (unrolled && rb == 3)
            ROWS_DOT16(3, 64, KEY_BLOCK);
        else if (unrolled) /* more than DOT16_ROWS rows in tiles of even size: 2 at least */
            ROWS_DOT16(2, 64, KEY_BLOCK);
        else if (rb == 1)
            ROWS_DOT16(1, D, cnt);
        else if (rb == 2)
            ROWS_DOT16(2, D, cnt);
        else if (rb == 3)
            ROWS_DOT16(3, D, cnt);
        else
            ROWS_DOT16(4, D, cnt);
#undef ROWS_DOT16
    }
}
#pragma GCC pop_options

/* Whether this CPU has the bf16 dot products (asked once). */
static int cpu_bf16(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    return known;
}
#define DOT16_BLOCK_U16(D) ((long)KEY_BLOCK * (D)) /* a block's keys (or values) laid out: KEY_BLOCK x D bf16 */
#endif
#ifndef DOT16 /* no bf16 dot products on this path: never called */
static inline int cpu_bf16(void) { return 0; }
static inline void rows_blocks_dot16(int R, const float *const *q, int D, int cnt, float scale, const uint16_t *kt,
                                     const uint16_t *vp, float *const *part, float *const *m, float *const *l,
                                     const char *pf_k, const char *pf_v, int pf_lines, const char *l2_k,
                                     const char *l2_v) {
    (void)R, (void)q, (void)D, (void)cnt, (void)scale, (void)kt, (void)vp, (void)part, (void)m, (void)l;
    (void)pf_k, (void)pf_v, (void)pf_lines, (void)l2_k, (void)l2_v;
}
#define dot16_layout(kb, ldk, vb, ldv, cnt, D, kt, vp) ((void)0)
#define DOT16_BLOCK_U16(D) 32L
#endif

static int longest_path(const int32_t *path_off, int n) {
    int longest = 0;
    for (int i = 0; i < n; ++i) {
        const int len = path_off[i + 1] - path_off[i];
        longest = len > longest ? len : longest;
    }
    return longest;
}

/* Whether query i's path continues the prefix row by row (a causal chunk: a prefill), so it is read in place. */
static int continues_prefix(const int32_t *path, const int32_t *path_off, int i, int past) {
    for (int u = 0; u < path_off[i + 1] - path_off[i]; ++u)
        if (path[path_off[i] + u] != past + u) return 0;
    return 1;
}

/* A row's output from its nb block partials (part b at pb + b * D, its max and sum at mlr[2b], mlr[2b + 1]), in
   block order: out = sum_b part_b e_b / sum_b l_b e_b, e_b = exp(m_b - max_b m_b) (elementwise, so computed for
   eight blocks at a time with the bits of one at a time). sink (gpt-oss; -INFINITY: none): one more logit in the
   softmax, with no value: the max is taken with it and exp(sink - max) added to the denominator last. */
static void combine_blocks(const float *pb, const float *mlr, int nb, int D, float sink, float *o) {
    const int dv = D / 8;
    float mx = sink;
    for (int b = 0; b < nb; ++b) mx = mlr[2 * b] > mx ? mlr[2 * b] : mx;
    float e[8];
    __m256 acc[MAX_D / 8];
    for (int c = 0; c < dv; ++c) acc[c] = _mm256_setzero_ps();
    float den = 0.0f;
    for (int b = 0; b < nb; ++b) {
        if (b % 8 == 0) {
            float m8[8];
            for (int t = 0; t < 8; ++t) m8[t] = b + t < nb ? mlr[2 * (b + t)] - mx : 0.0f;
            _mm256_storeu_ps(e, exp_nonpos(_mm256_loadu_ps(m8)));
        }
        const __m256 ev = _mm256_set1_ps(e[b % 8]);
        for (int c = 0; c < dv; ++c) acc[c] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(pb + (long)b * D + 8 * c), acc[c]);
        den += mlr[2 * b + 1] * e[b % 8];
    }
    if (sink > -INFINITY) {
        float t[8] = {sink - mx};
        _mm256_storeu_ps(t, exp_nonpos(_mm256_loadu_ps(t)));
        den += t[0];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / den);
    for (int c = 0; c < dv; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
}

/* Attention of the new tokens of ns sequences in one forward (H query heads, G key/value heads, head dim D),
 * flash-decoding style. Each sequence (att_seq, simd.h) has its queries, visibility and cache rows; a query's
 * visible keys, in logical order (prefix, then path), are split into blocks of KEY_BLOCK logical positions.
 *   work: sum over s of H * n * nb * (D + 2) floats (nb = blocks of its longest row), shared by the threads.
 * Two phases over all heads and sequences at once:
 *   1. the prefix blocks every row of a sequence sees in full, by (key head, block): the block's keys / values
 *      are read once for every query row of the key head (all H/G heads x rows, ROW_TILE at a time), and a
 *      shared prefix's block once for the rows of every sequence reading it (cascade attention: the document's
 *      KV read once per forward, not once per sequence); per row a partial (block max, sum of exp, weighted values);
 *   2. by (sequence, key head, query): the blocks that reach into the query's own path (gathered by logical
 *      position, once for the key head's H/G query heads), then each row's partials combined in block order:
 *      out = sum_b part_b e_b / sum_b l_b e_b, e_b = exp(m_b - max_b m_b).
 * Every row's result is a function of its visible keys alone (not of n, the tree, the other sequences, where a
 * block is stored, the task split or the thread), so a tree node's attention equals its attention decoded alone,
 * and a sequence's equals its attention in a forward of its own, bit for bit.
 * D must be a multiple of 8 and at most MAX_D. Called inside a parallel region (orphaned worksharing). */
#define MAX_GROUP 64 /* query rows per call of rows_blocks */

typedef struct {
    int nbmax, full, shared, lead; /* blocks: of the longest row, seen whole, read from the shared prefix */
    int first;                     /* the first block any row sees (a sliding window hides the ones below) */
    long pstride;                  /* partials of row r = h * n + i: parts + r * pstride + b * D */
    float *parts, *ml;             /* (max, sum) of row r, block b at ml + 2 * (r * nbmax + b) */
} att_meta;

/* Element offset of cache row j's key / value for key head g, and the buffer it lies in. */
static inline const char *kv_row(const att_seq *s, const void *own, const void *pre, int g, long j, long kv_sn,
                                 long esz) {
    return j < s->split ? (const char *)pre + esz * (g * s->sh0 + (j - s->pre0) * kv_sn)
                        : (const char *)own + esz * (g * s->kv_sh + (j - s->own0) * kv_sn);
}

/* Where block b (key head g) of sequence s is laid out for the dot products (DOT16_BLOCK_U16 keys, then values):
   the cache's own laid-out blocks or the shared prefix's where it keeps them (*ready: already there), else the
   forward's scratch (*ready = 0). */
static inline uint16_t *laid_block(const att_seq *s, int g, int b, int D, uint16_t *scratch, int *ready) {
    const int sb = s->split / KEY_BLOCK;
    const long bsz = 2 * DOT16_BLOCK_U16(D);
    if (b < sb && s->lay0) {
        *ready = b < s->laid0;
        return s->lay0 + g * s->lay0_sh + b * bsz;
    }
    if (b >= sb && s->lay) {
        *ready = b - sb < s->laid;
        return s->lay + g * s->lay_sh + (b - sb) * bsz;
    }
    *ready = 0;
    return scratch;
}

/* Phase 1's tasks come in segments: the blocks of one shared prefix (for the rows of every sequence reading it), or
   one sequence's own blocks seen whole. Segment t: sequence seg_s[t], blocks [seg_b0[t], seg_b1[t]). */
static inline void att_segments(const att_seq *s, const att_meta *m, int ns, int *seg_s, int *seg_b0, int *seg_b1,
                                int *seg_shared, int *count) {
    int c = 0;
    for (int i = 0; i < ns; ++i) {
        if (m[i].lead != i || !s[i].split) continue;
        int b0 = m[i].shared, b1 = 0;
        for (int j = i; j < ns; ++j)
            if (m[j].lead == i && m[j].shared > m[j].first) {
                b0 = m[j].first < b0 ? m[j].first : b0;
                b1 = m[j].shared > b1 ? m[j].shared : b1;
            }
        if (b1 > b0) seg_s[c] = i, seg_b0[c] = b0, seg_b1[c] = b1, seg_shared[c++] = 1;
    }
    for (int i = 0; i < ns; ++i) {
        const int b0 = m[i].shared > m[i].first ? m[i].shared : m[i].first;
        if (m[i].full > b0) seg_s[c] = i, seg_b0[c] = b0, seg_b1[c] = m[i].full, seg_shared[c++] = 0;
    }
    *count = c;
}

/* Where phase 1's task `task` (segment t or later) reads its keys / values, for prefetching: its laid-out block
   (dot16, where kept), else its rows where contiguous; *k = *v = 0 otherwise. */
static inline void task_block(const att_seq *seqs, const int *seg_s, const int *seg_b0, const int *seg_b1,
                              const int *seg_first, int t, int task, int D, long kv_sn, long row_len, long esz,
                              int dot16, const char **k, const char **v) {
    while (seg_first[t + 1] <= task) ++t;
    const int nb = seg_b1[t] - seg_b0[t];
    const int g = (task - seg_first[t]) / nb, b = seg_b0[t] + (task - seg_first[t]) % nb;
    const att_seq *s = seqs + seg_s[t];
    int laid = 0;
    const uint16_t *lay = dot16 ? laid_block(s, g, b, D, 0, &laid) : 0;
    if (laid) {
        *k = (const char *)lay, *v = (const char *)(lay + DOT16_BLOCK_U16(D));
    } else if (kv_sn == row_len) {
        *k = kv_row(s, s->k, s->k0, g, (long)b * KEY_BLOCK, kv_sn, esz);
        *v = kv_row(s, s->v, s->v0, g, (long)b * KEY_BLOCK, kv_sn, esz);
    }
}

static inline __attribute__((always_inline)) void attention_part(
    const att_seq *seqs, int ns, int H, int D, int G, long q_sh, long q_sn, long kv_sn, float scale, float cap,
    long o_sn, long o_sh, float *work, const int kvm) {
    const int group = H / G;
    const int dv = D / 8;
    const long esz = kvm == 2 ? 1 : kvm == 0 ? 4 : 2;
    const long row_len = kvm == 2 ? D + D / 8 : D; /* elements a cached row takes */
    const int lines = (int)((KEY_BLOCK * row_len * esz + 63) / 64);
    const int dot16 = kvm == 3 && D % 32 == 0 && !(cap > 0.0f) && cpu_bf16(); /* a bf16 cache on the bf16 dot products */
    uint16_t lay[2 * DOT16_BLOCK_U16(MAX_D)] __attribute__((aligned(64))); /* a block laid out for them */
    uint16_t *const kt = lay, *const vp = lay + DOT16_BLOCK_U16(MAX_D);
    att_meta meta[ns];
    int phase2[ns + 1];
    float *w = work;
    phase2[0] = 0;
    for (int i = 0; i < ns; ++i) {
        const att_seq *s = seqs + i;
        att_meta *m = meta + i;
        m->nbmax = (s->past + longest_path(s->path_off, s->n) + KEY_BLOCK - 1) / KEY_BLOCK;
        m->full = s->past / KEY_BLOCK;
        m->shared = s->split / KEY_BLOCK < m->full ? s->split / KEY_BLOCK : m->full;
        m->first = 0;
        if (s->window) { /* query i sees its last `window` keys: logical [past + len_i - window, past + len_i) */
            int lo = s->past + (s->path_off[1] - s->path_off[0]) - s->window;
            for (int r = 1; r < s->n; ++r) {
                const int l = s->past + (s->path_off[r + 1] - s->path_off[r]) - s->window;
                lo = l < lo ? l : lo;
            }
            m->first = lo > 0 ? lo / KEY_BLOCK : 0;
        }
        m->lead = i;
        for (int j = 0; j < i && s->split; ++j)
            if (seqs[j].split == s->split && seqs[j].k0 == s->k0 && seqs[j].v0 == s->v0 && seqs[j].sh0 == s->sh0) {
                m->lead = meta[j].lead;
                break;
            }
        m->pstride = (long)m->nbmax * D;
        m->parts = w;
        m->ml = w + (long)H * s->n * m->pstride;
        w = m->ml + 2L * H * s->n * m->nbmax;
        phase2[i + 1] = phase2[i] + G * s->n;
    }
    int seg_s[2 * ns], seg_b0[2 * ns], seg_b1[2 * ns], seg_shared[2 * ns], nseg, tasks = 0;
    att_segments(seqs, meta, ns, seg_s, seg_b0, seg_b1, seg_shared, &nseg);
    int seg_first[2 * ns + 1];
    for (int t = 0; t < nseg; ++t) seg_first[t] = tasks, tasks += G * (seg_b1[t] - seg_b0[t]);
    seg_first[nseg] = tasks;
#pragma omp for schedule(static) /* contiguous runs of blocks: each thread streams its part of the cache */
    for (int task = 0; task < tasks; ++task) {
        int t = 0;
        while (seg_first[t + 1] <= task) ++t;
        const int nb = seg_b1[t] - seg_b0[t], g = (task - seg_first[t]) / nb, b = seg_b0[t] + (task - seg_first[t]) % nb;
        const att_seq *s0 = seqs + seg_s[t];
        const char *kb = kv_row(s0, s0->k, s0->k0, g, (long)b * KEY_BLOCK, kv_sn, esz);
        const char *vb = kv_row(s0, s0->v, s0->v0, g, (long)b * KEY_BLOCK, kv_sn, esz);
        /* The next task's block, prefetched as this one computes: one block ahead (16 KB of bf16 keys and values
           at D = 64) is in L1 when it is read; four ahead overflowed it (plain decoding at 7.5K 5-9% slower). A
           verify's rows also take the block L2_AHEAD ahead into L2. */
        const char *pf_k = 0, *pf_v = 0, *l2_k = 0, *l2_v = 0;
        if (task + 1 < tasks)
            task_block(seqs, seg_s, seg_b0, seg_b1, seg_first, t, task + 1, D, kv_sn, row_len, esz, dot16, &pf_k, &pf_v);
        if (dot16 && task + L2_AHEAD < tasks && (seg_shared[t] || s0->n > 1)) /* more rows than a decode step's */
            task_block(seqs, seg_s, seg_b0, seg_b1, seg_first, t, task + L2_AHEAD, D, kv_sn, row_len, esz, dot16, &l2_k,
                       &l2_v);
        const uint16_t *bk = kt, *bv = vp;
        if (dot16) { /* laid out once for every row reading the block (and kept, where the cache keeps layouts) */
            int laid;
            uint16_t *const lk = laid_block(s0, g, b, D, kt, &laid), *const lv = lk + DOT16_BLOCK_U16(D);
            if (!laid) dot16_layout((const uint16_t *)kb, kv_sn, (const uint16_t *)vb, kv_sn, KEY_BLOCK, D, lk, lv);
            bk = lk, bv = lv;
        }
        const float *qs[MAX_GROUP];
        float *ps[MAX_GROUP], *ms[MAX_GROUP], *ls[MAX_GROUP];
        int R = 0, calls = 0;
        for (int j = seg_s[t]; j < (seg_shared[t] ? ns : seg_s[t] + 1); ++j) {
            if (seg_shared[t] && (meta[j].lead != seg_s[t] || b >= meta[j].shared || b < meta[j].first)) continue;
            const att_seq *s = seqs + j;
            const att_meta *m = meta + j;
            for (int h = g * group; h < (g + 1) * group; ++h)
                for (int i = 0; i < s->n; ++i) {
                    const long r = (long)h * s->n + i;
                    qs[R] = s->q + h * q_sh + i * q_sn;
                    ps[R] = m->parts + r * m->pstride + (long)b * D;
                    ms[R] = m->ml + 2 * (r * m->nbmax + b), ls[R] = ms[R] + 1;
                    if (++R == MAX_GROUP) {
                        if (dot16)
                            rows_blocks_dot16(R, qs, D, KEY_BLOCK, scale, bk, bv, ps, ms, ls, calls ? 0 : pf_k,
                                              calls ? 0 : pf_v, lines, calls ? 0 : l2_k, l2_v);
                        else
                            ROWS_FULL(kvm, R, qs, dv, kb, kv_sn, vb, kv_sn, scale, cap, ps, ms, ls, calls ? 0 : pf_k,
                                      calls ? 0 : pf_v, lines);
                        R = 0, ++calls;
                    }
                }
        }
        if (R && dot16)
            rows_blocks_dot16(R, qs, D, KEY_BLOCK, scale, bk, bv, ps, ms, ls, calls ? 0 : pf_k, calls ? 0 : pf_v,
                              lines, calls ? 0 : l2_k, l2_v);
        else if (R)
            ROWS_FULL(kvm, R, qs, dv, kb, kv_sn, vb, kv_sn, scale, cap, ps, ms, ls, calls ? 0 : pf_k, calls ? 0 : pf_v,
                      lines);
    }
    float kbuf[KEY_BLOCK * MAX_D] __attribute__((aligned(32)));
    float vbuf[KEY_BLOCK * MAX_D] __attribute__((aligned(32)));
    /* Static, in phase 1's order (sequence, key head): a thread combines more of the partials it wrote itself.
       Where the two threads sit on different dies (this box, some of the time: a cache line's round trip 370 ns
       instead of 100), a dynamic schedule reading the other's partials made a 4-node verify at 7.5K 12% slower. */
#pragma omp for schedule(static)
    for (int task = 0; task < phase2[ns]; ++task) {
        int si = 0;
        while (phase2[si + 1] <= task) ++si;
        const att_seq *s = seqs + si;
        const att_meta *m = meta + si;
        const int g = (task - phase2[si]) / s->n, i = (task - phase2[si]) % s->n;
        const int past = s->past;
        const int32_t *path = s->path, *path_off = s->path_off;
        const int plen = path_off[i + 1] - path_off[i];
        const int total = past + plen, nb = (total + KEY_BLOCK - 1) / KEY_BLOCK;
        const int in_place = continues_prefix(path, path_off, i, past);
        const int lo = s->window && total > s->window ? total - s->window : 0, blo = lo / KEY_BLOCK; /* first key */
        for (int b = blo; b < nb; ++b) { /* blocks not seen whole (or cut by the window), by logical position */
            const int t0 = b == blo ? lo : b * KEY_BLOCK;
            if (b < m->full && t0 == b * KEY_BLOCK) continue; /* phase 1's */
            const int cnt = (total < (b + 1) * KEY_BLOCK ? total : (b + 1) * KEY_BLOCK) - t0;
            uint16_t *const k16 = (uint16_t *)kbuf, *const v16 = (uint16_t *)vbuf; /* bf16 rows gathered as stored */
            for (int t = 0; t < cnt && !in_place; ++t) {
                const long row = t0 + t < past ? t0 + t : path[path_off[i] + (t0 + t - past)];
                const char *kr = kv_row(s, s->k, s->k0, g, row, kv_sn, esz);
                const char *vr = kv_row(s, s->v, s->v0, g, row, kv_sn, esz);
                if (dot16) {
                    memcpy(k16 + (long)t * D, kr, 2L * D);
                    memcpy(v16 + (long)t * D, vr, 2L * D);
                    continue;
                }
                for (int c = 0; c < dv; ++c) {
                    _mm256_storeu_ps(kbuf + (long)t * D + 8 * c, LOADKV(kr, 0, c, dv));
                    _mm256_storeu_ps(vbuf + (long)t * D + 8 * c, LOADKV(vr, 0, c, dv));
                }
            }
            const char *kd = in_place ? kv_row(s, s->k, s->k0, g, t0, kv_sn, esz) : 0;
            const char *vd = in_place ? kv_row(s, s->v, s->v0, g, t0, kv_sn, esz) : 0;
            if (dot16 && in_place)
                dot16_layout((const uint16_t *)kd, kv_sn, (const uint16_t *)vd, kv_sn, cnt, D, kt, vp);
            else if (dot16)
                dot16_layout(k16, D, v16, D, cnt, D, kt, vp);
            for (int h0 = g * group; h0 < (g + 1) * group; h0 += MAX_GROUP) {
                const int R = (g + 1) * group - h0 < MAX_GROUP ? (g + 1) * group - h0 : MAX_GROUP;
                const float *qs[MAX_GROUP];
                float *ps[MAX_GROUP], *ms[MAX_GROUP], *ls[MAX_GROUP];
                for (int t = 0; t < R; ++t) {
                    const long r = (long)(h0 + t) * s->n + i;
                    qs[t] = s->q + (h0 + t) * q_sh + i * q_sn;
                    ps[t] = m->parts + r * m->pstride + (long)b * D;
                    ms[t] = m->ml + 2 * (r * m->nbmax + b), ls[t] = ms[t] + 1;
                }
                if (dot16)
                    rows_blocks_dot16(R, qs, D, cnt, scale, kt, vp, ps, ms, ls, 0, 0, 0, 0, 0);
                else if (in_place) /* the same values as gathered: loading widens them the same way */
                    ROWS_ANY(kvm, R, qs, dv, kd, kv_sn, vd, kv_sn, scale, cap, ps, ms, ls, cnt);
                else
                    rows_any_0(R, qs, dv, kbuf, D, vbuf, D, scale, cap, ps, ms, ls, cnt);
            }
        }
        for (int h = g * group; h < (g + 1) * group; ++h) {
            const long r = (long)h * s->n + i;
            combine_blocks(m->parts + r * m->pstride + (long)blo * D, m->ml + 2 * (r * m->nbmax + blo), nb - blo, D,
                           s->sinks ? s->sinks[h] : -INFINITY, s->out + i * o_sn + h * o_sh);
        }
    }
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* Attention on the bf16 tiles (the amx path with a bf16 KV cache). Per block of TKB keys and tile of up to
 * 16 queries: scores S = Q K^T by tdpbf16ps (queries rounded to bf16 after the scale, keys as cached), the block's
 * softmax numerators on 16 lanes (one query's 64 keys in four registers: max, exp, rounded to bf16, their sum), then
 * P V by tdpbf16ps. Each tile element is one query's dot product with one key (or value column), computed by the
 * same instructions whichever other queries share the tile, so a row's result depends only on its visible keys:
 * the invariance the vector code has, with other rounding (bf16 operands, fp32 sums in the tiles' order). The keys
 * and values of a block are laid out for the tiles once for every query reading it. */
#define TILE_ATTENTION 1
#define TKB TILE_KEYS /* keys per block on the tiles: a multiple of 64 */
#define TQ 16 /* queries per tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} att_tile_config;

static void att_tiles_configure(void) { /* all eight tiles 16 rows x 64 bytes */
    att_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    __asm__ __volatile__("" : : "r"(&c) : "memory"); /* gcc 12: keep the stores before ldtilecfg */
    _tile_loadconfig(&c);
}

/* The A tiles of up to 16 queries (rows past R zero): qa[c * TILE_U16 + 32 t] = bf16(q[t][32c ..] * scale). */
static void query_tiles(const float *const *q, int R, int D, float scale, uint16_t *qa) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int c = 0; c < D / 32; ++c)
        for (int t = 0; t < TQ; ++t) {
            __m512i v = _mm512_setzero_si512();
            if (t < R)
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q[t] + 32 * c + 16), sv),
                                                 _mm512_mul_ps(_mm512_loadu_ps(q[t] + 32 * c), sv));
            _mm512_store_si512(qa + (long)c * TILE_U16 + 32 * t, v);
        }
}

/* One tile of work: up to 16 queries (their A tiles qa) against one block's tiles (cnt keys). Query t's block max
 * and sum go to ml + t * ml_ld (then + 1), its weighted values to part + t * part_ld. */
typedef struct {
    const uint16_t *qa, *kt, *vp;
    int R, cnt;
    float *part, *ml;
    long part_ld, ml_ld;
} tile_unit;

#define MAX_UNITS 8 /* units run stage by stage: the tiles and the vector code hand over once per stage */
#define MAX_CHUNK 4  /* blocks whose tiles are laid out at once */
#define BLOCK_U16(D) ((long)TKB * (D) / 256 * TILE_U16) /* a block's K tiles (per 16 keys and 32 dims), V tiles */

typedef struct { /* per-thread scratch of the tiles' attention */
    uint16_t *blocks; /* MAX_CHUNK blocks' tiles */
    float *s;         /* per unit its 16 x TKB scores */
    uint16_t *p;      /* per unit its 16 x TKB numerators */
    float *o;         /* per unit its 16 x D weighted values (units of fewer than 16 queries) */
    uint16_t *kbuf, *vbuf, *qa;
} tile_scratch;

static tile_scratch *tile_scratch_get(void) {
    static __thread tile_scratch ts;
    if (!ts.blocks) {
        ts.blocks = aligned_alloc(64, 2 * MAX_CHUNK * BLOCK_U16(MAX_D));
        ts.s = aligned_alloc(64, 4 * MAX_UNITS * TQ * TKB);
        ts.p = aligned_alloc(64, 2 * MAX_UNITS * TQ * TKB);
        ts.o = aligned_alloc(64, 4 * MAX_UNITS * TQ * MAX_D);
        ts.kbuf = aligned_alloc(64, 2 * MAX_CHUNK * TKB * MAX_D);
        ts.vbuf = aligned_alloc(64, 2 * MAX_CHUNK * TKB * MAX_D);
        ts.qa = aligned_alloc(64, 2 * (MAX_D / 32) * TILE_U16 * (MAX_GROUP / TQ));
    }
    return &ts;
}

/* Stage 1 (tiles): the units' scores S = Q K^T, four accumulators of 16 keys, B tiles alternating in 6 / 7. */
static void units_scores(const tile_unit *u, int U, int D, float *s) {
    const int nc = D / 32;
    for (int i = 0; i < U; ++i)
        for (int q0 = 0; q0 < u[i].cnt; q0 += 64) { /* 64 keys a round */
            const int ns = (u[i].cnt - q0 + 15) / 16;
            const uint16_t *kt = u[i].kt + (long)q0 / 16 * nc * TILE_U16;
            if (i + 1 < U && u[i + 1].kt != u[i].kt) /* the next block's key tiles of this round, on their way */
                for (long e = 0; e < 4L * nc * TILE_U16; e += 32)
                    _mm_prefetch((const char *)(u[i + 1].kt + (long)q0 / 16 * nc * TILE_U16 + e), _MM_HINT_T0);
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            for (int c = 0; c < nc; ++c) {
                _tile_loadd(0, u[i].qa + (long)c * TILE_U16, 64);
                _tile_loadd(6, kt + (long)c * TILE_U16, 64);
                _tile_dpbf16ps(2, 0, 6);
                if (ns > 1) {
                    _tile_loadd(7, kt + (long)(nc + c) * TILE_U16, 64);
                    _tile_dpbf16ps(3, 0, 7);
                }
                if (ns > 2) {
                    _tile_loadd(6, kt + (long)(2 * nc + c) * TILE_U16, 64);
                    _tile_dpbf16ps(4, 0, 6);
                }
                if (ns > 3) {
                    _tile_loadd(7, kt + (long)(3 * nc + c) * TILE_U16, 64);
                    _tile_dpbf16ps(5, 0, 7);
                }
            }
            float *si = s + (long)i * TQ * TKB + q0;
            _tile_stored(2, si, 4 * TKB);
            _tile_stored(3, si + 16, 4 * TKB);
            _tile_stored(4, si + 32, 4 * TKB);
            _tile_stored(5, si + 48, 4 * TKB);
        }
}

/* Stage 2 (vector): per query its block max, the numerators exp(s - max) rounded to bf16 (zero past cnt and for
 * rows no query reads, so the products stay finite) and their sum as the tiles multiply them (each dword's pair,
 * then a fixed tree). */
static void units_softmax(const tile_unit *u, int U, const float *s, uint16_t *p) {
    for (int i = 0; i < U; ++i) {
        const int cnt = u[i].cnt, nv = (cnt + 31) / 32 * 2; /* 16-key vectors, in whole pairs */
        for (int t = 0; t < TQ; ++t) {
            uint16_t *pt = p + ((long)i * TQ + t) * TKB;
            if (t >= u[i].R) {
                for (int v = 0; v < nv; v += 2) _mm512_store_si512(pt + 16 * v, _mm512_setzero_si512());
                continue;
            }
            const float *st = s + ((long)i * TQ + t) * TKB;
            __m512 x[TKB / 16];
            __mmask16 k[TKB / 16];
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int v = 0; v < nv; ++v) {
                const int left = cnt - 16 * v;
                k[v] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                x[v] = _mm512_maskz_load_ps(k[v], st + 16 * v);
                mx = _mm512_mask_max_ps(mx, k[v], mx, x[v]);
            }
            const float m = _mm512_reduce_max_ps(mx);
            const __m512 mv = _mm512_set1_ps(m);
            __m512 sum = _mm512_setzero_ps();
            for (int v = 0; v < nv; v += 2) {
                const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(exp_bf16(k[v + 1], _mm512_sub_ps(x[v + 1], mv)),
                                                                exp_bf16(k[v], _mm512_sub_ps(x[v], mv)));
                _mm512_store_si512(pt + 16 * v, pb);
                sum = _mm512_add_ps(sum, _mm512_add_ps(bf16_lo(pb), bf16_hi(pb)));
            }
            float *ml = u[i].ml + t * u[i].ml_ld;
            ml[0] = m;
            ml[1] = _mm512_reduce_add_ps(sum);
        }
    }
}

/* Stage 3 (tiles): the units' P V, four 16-dim accumulators at a time, stored straight into the partials when a
 * unit has 16 queries (o otherwise). */
static void units_values(const tile_unit *u, int U, int D, const uint16_t *p, float *o) {
    for (int i = 0; i < U; ++i) {
        const int nh = (u[i].cnt + 31) / 32;
        const uint16_t *pi = p + (long)i * TQ * TKB;
        const int direct = u[i].R == TQ;
        float *dst = direct ? u[i].part : o + (long)i * TQ * D;
        const long ld = 4 * (direct ? u[i].part_ld : D);
        if (i + 1 < U && u[i + 1].vp != u[i].vp) /* the next block's value tiles, on their way */
            for (long e = 0; e < (long)(u[i + 1].cnt + 31) / 32 * D / 16 * TILE_U16; e += 32)
                _mm_prefetch((const char *)(u[i + 1].vp + e), _MM_HINT_T0);
        for (int c0 = 0; c0 < D / 16; c0 += 4) {
            const int nd = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            for (int h = 0; h < nh; ++h) { /* 32 keys a step: their numerators in tile 0 or 1 */
                const uint16_t *vh = u[i].vp + (long)(h * D / 16 + c0) * TILE_U16;
#define PV_STEP(A, ACC, B, OFF)                                \
    do {                                                       \
        _tile_loadd(B, vh + (long)(OFF) * TILE_U16, 64);       \
        _tile_dpbf16ps(ACC, A, B);                             \
    } while (0)
#define PV_HALF(A)                                             \
    do {                                                       \
        _tile_loadd(A, pi + 32 * h, 2 * TKB);                  \
        PV_STEP(A, 2, 6, 0);                                   \
        PV_STEP(A, 3, 7, 1);                                   \
        if (nd > 2) {                                          \
            PV_STEP(A, 4, 6, 2);                               \
            PV_STEP(A, 5, 7, 3);                               \
        }                                                      \
    } while (0)
                if (h % 2 == 0)
                    PV_HALF(0);
                else
                    PV_HALF(1);
#undef PV_HALF
#undef PV_STEP
            }
            _tile_stored(2, dst + 16 * c0, ld);
            _tile_stored(3, dst + 16 * c0 + 16, ld);
            if (nd > 2) {
                _tile_stored(4, dst + 16 * c0 + 32, ld);
                _tile_stored(5, dst + 16 * c0 + 48, ld);
            }
        }
    }
}

/* The units, stage by stage, then (vector) the partials of units of fewer than 16 queries copied out. */
static void run_units(const tile_unit *u, int U, int D, tile_scratch *ts) {
    units_scores(u, U, D, ts->s);
    units_softmax(u, U, ts->s, ts->p);
    units_values(u, U, D, ts->p, ts->o);
    for (int i = 0; i < U; ++i)
        if (u[i].R < TQ)
            for (int t = 0; t < u[i].R; ++t)
                memcpy(u[i].part + t * u[i].part_ld, ts->o + ((long)i * TQ + t) * D, sizeof(float) * D);
}

/* attention_part on the tiles, for bf16 keys / values: the same phases, work and visibility; the work buffer also
 * holds every key head's query tiles (attention_work_floats counts them). Phase 1 runs by key head and chunk of
 * prefix blocks (all query tiles of the key head against each), phase 2 by key head and query as before. */
static void attention_tiles_part(const float *q, long q_sh, long q_sn, int H, int n, int D, const uint16_t *k,
                                 const uint16_t *v, long kv_sh, long kv_sn, int G, int past, const int32_t *path,
                                 const int32_t *path_off, float scale, float *out, long o_sn, long o_sh, float *work,
                                 uint16_t *tiles, long tiles_sh, int valid) {
    const int maxpath = longest_path(path_off, n);
    const int nbmax = (past + maxpath + TKB - 1) / TKB;
    const int group = H / G, full = past / TKB, nc = D / 32;
    const long pstride = (long)nbmax * D;
    float *parts = work;
    float *ml = work + (long)H * n * pstride;
    const int rows = group * n, cts = (rows + TQ - 1) / TQ; /* query tiles per key head */
    const long qtile = (long)nc * TILE_U16;
    uint16_t *qall = (uint16_t *)(((uintptr_t)(ml + 2L * H * n * nbmax) + 63) & ~(uintptr_t)63);
    tile_scratch *ts = tile_scratch_get();
    const long bsz = BLOCK_U16(D), vofs = (long)TKB / 16 * nc * TILE_U16; /* a block's tiles; its V tiles' offset */
    att_tiles_configure();
#pragma omp for schedule(static)
    for (int task = 0; task < G * cts; ++task) { /* query rows t of key head g: head g * group + t / n, row t % n */
        const int g = task / cts, t0 = task % cts * TQ, R = rows - t0 < TQ ? rows - t0 : TQ;
        const float *qs[TQ];
        for (int t = 0; t < R; ++t) {
            const int h = g * group + (t0 + t) / n, i = (t0 + t) % n;
            qs[t] = q + h * q_sh + i * q_sn;
        }
        query_tiles(qs, R, D, scale, qall + task * qtile);
    }
    int chunk = MAX_UNITS / cts; /* prefix blocks per task: whole query tiles of the key head for each */
    chunk = chunk < 1 ? 1 : chunk > MAX_CHUNK ? MAX_CHUNK : chunk;
    const int chunks = (full + chunk - 1) / chunk;
#pragma omp for schedule(static)
    for (int task = 0; task < G * chunks; ++task) {
        const int g = task / chunks, b0 = task % chunks * chunk, nb = full - b0 < chunk ? full - b0 : chunk;
        tile_unit u[MAX_UNITS];
        int U = 0;
        for (int bi = 0; bi < nb; ++bi) {
            const int b = b0 + bi;
            const long off = g * kv_sh + (long)b * TKB * kv_sn;
            uint16_t *bt = tiles ? tiles + g * tiles_sh + (long)b * bsz : ts->blocks + bi * bsz;
            if (!tiles || b >= valid) { /* not laid out yet (kept in the cache's tiles from now on, if it has them) */
                const int last = task + 1 == G * chunks && bi + 1 == nb;
                const long noff = bi + 1 < nb ? off + (long)TKB * kv_sn /* same chunk */
                                              : (task + 1) / chunks * kv_sh + (long)((task + 1) % chunks) * chunk * TKB * kv_sn;
                block_tiles(k + off, kv_sn, v + off, kv_sn, TKB, D, bt, bt + vofs, last ? 0 : k + noff,
                            last ? 0 : v + noff);
            }
            for (int ct = 0; ct < cts; ++ct, ++U) {
                const int t0 = ct * TQ;
                const long r0 = (long)g * rows + t0; /* row (g * group + (t0 + t) / n) * n + (t0 + t) % n */
                u[U] = (tile_unit){qall + (g * cts + ct) * qtile, bt, bt + vofs, rows - t0 < TQ ? rows - t0 : TQ,
                                   TKB, parts + r0 * pstride + (long)b * D, ml + 2 * (r0 * nbmax + b),
                                   pstride, 2L * nbmax};
                if (U + 1 == MAX_UNITS) {
                    run_units(u, U + 1, D, ts);
                    U = -1;
                }
            }
        }
        if (U) run_units(u, U, D, ts);
    }
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < G * n; ++task) {
        const int g = task / n, i = task % n;
        const int plen = path_off[i + 1] - path_off[i];
        const int total = past + plen, nb = (total + TKB - 1) / TKB;
        const int in_place = continues_prefix(path, path_off, i, past);
        for (int h0 = g * group; h0 < (g + 1) * group; h0 += TQ) {
            const int R = (g + 1) * group - h0 < TQ ? (g + 1) * group - h0 : TQ;
            const float *qs[TQ];
            for (int t = 0; t < R; ++t) qs[t] = q + (h0 + t) * q_sh + i * q_sn;
            uint16_t *qa = ts->qa + (long)(h0 - g * group) / TQ * qtile;
            query_tiles(qs, R, D, scale, qa);
        }
        for (int b1 = full; b1 < nb; b1 += MAX_CHUNK) {
            tile_unit u[MAX_UNITS];
            int U = 0;
            for (int b = b1; b < nb && b < b1 + MAX_CHUNK; ++b) {
                const int t0 = b * TKB, cnt = total - t0 < TKB ? total - t0 : TKB;
                uint16_t *bt = ts->blocks + (b - b1) * bsz;
                if (in_place && cnt == TKB) {
                    const long off = g * kv_sh + (long)t0 * kv_sn;
                    block_tiles(k + off, kv_sn, v + off, kv_sn, cnt, D, bt, bt + vofs, 0, 0);
                } else {
                    uint16_t *kb = ts->kbuf + (long)(b - b1) * TKB * D, *vb = ts->vbuf + (long)(b - b1) * TKB * D;
                    for (int t = 0; t < cnt; ++t) {
                        const long row = t0 + t < past || in_place ? t0 + t : path[path_off[i] + (t0 + t - past)];
                        memcpy(kb + (long)t * D, k + g * kv_sh + row * kv_sn, 2 * D);
                        memcpy(vb + (long)t * D, v + g * kv_sh + row * kv_sn, 2 * D);
                    }
                    block_tiles(kb, D, vb, D, cnt, D, bt, bt + vofs, 0, 0);
                }
                for (int h0 = g * group; h0 < (g + 1) * group; h0 += TQ, ++U) {
                    const long r0 = (long)h0 * n + i;
                    u[U] = (tile_unit){ts->qa + (long)(h0 - g * group) / TQ * qtile, bt, bt + vofs,
                                       (g + 1) * group - h0 < TQ ? (g + 1) * group - h0 : TQ, cnt,
                                       parts + r0 * pstride + (long)b * D, ml + 2 * (r0 * nbmax + b),
                                       (long)n * pstride, 2L * n * nbmax};
                    if (U + 1 == MAX_UNITS) {
                        run_units(u, U + 1, D, ts);
                        U = -1;
                    }
                }
            }
            if (U) run_units(u, U, D, ts);
        }
        for (int h = g * group; h < (g + 1) * group; ++h) {
            const long r = (long)h * n + i;
            combine_blocks(parts + r * pstride, ml + 2 * r * nbmax, nb, D, -INFINITY, out + i * o_sn + h * o_sh);
        }
    }
    _tile_release();
}
#endif

/* attention_part for keys / values stored as kvm (0 fp32, 1 fp16, 2 int8 rows with their scales, 3 bf16): the
   attention of every sequence of a forward at once (no tiles). Each storage gets a function of its own (the same
   code, kvm a constant in each): inlined all four into one function they took the compiler twice as long (its
   passes grow faster than the function), for the same instructions. */
#define ATTENTION_OF(MODE)                                                                                         \
    static __attribute__((noinline)) void attention_part_##MODE(const att_seq *seqs, int ns, int H, int D, int G, \
                                                                long q_sh, long q_sn, long kv_sn, float scale,    \
                                                                float cap, long o_sn, long o_sh, float *work) {   \
        attention_part(seqs, ns, H, D, G, q_sh, q_sn, kv_sn, scale, cap, o_sn, o_sh, work, MODE);                \
    }
ATTENTION_OF(0)
ATTENTION_OF(1)
ATTENTION_OF(2)
ATTENTION_OF(3)
#undef ATTENTION_OF

void attention_seqs_part(const att_seq *seqs, int ns, int H, int D, int G, long q_sh, long q_sn, long kv_sn,
                         float scale, float cap, long o_sn, long o_sh, float *work, int kvm) {
#define ATTENTION(MODE) attention_part_##MODE(seqs, ns, H, D, G, q_sh, q_sn, kv_sn, scale, cap, o_sn, o_sh, work)
    if (kvm == 3)
        ATTENTION(3);
    else if (kvm == 2)
        ATTENTION(2);
    else if (kvm == 1)
        ATTENTION(1);
    else
        ATTENTION(0);
#undef ATTENTION
}

/* One sequence's attention on its own cache (rows at element g*kv_sh + j*kv_sn), kvm as above; on the amx path bf16
   runs on the tiles. tiles (optional, the tiles' path only): the cache's blocks of TILE_KEYS keys laid out for the
   tiles, tiles_sh elements per key head, the first `valid` already there; the prefix's other whole blocks are laid
   out into it (rs_tile_keys says whether a library does). */
void attention_kv_part(const float *q, long q_sh, long q_sn, int H, int n, int D, const void *k, const void *v,
                       long kv_sh, long kv_sn, int G, int past, const int32_t *path, const int32_t *path_off,
                       float scale, float *out, long o_sn, long o_sh, float *work, int kvm, uint16_t *tiles,
                       long tiles_sh, int valid) {
#ifdef TILE_ATTENTION
    if (kvm == 3 && D % 32 == 0) {
        attention_tiles_part(q, q_sh, q_sn, H, n, D, (const uint16_t *)k, (const uint16_t *)v, kv_sh, kv_sn, G, past,
                             path, path_off, scale, out, o_sn, o_sh, work, tiles, tiles_sh, valid);
        return;
    }
#endif
    const att_seq one = {.q = q, .out = out, .n = n, .past = past, .path = path, .path_off = path_off, .k = k, .v = v,
                         .kv_sh = kv_sh};
    attention_seqs_part(&one, 1, H, D, G, q_sh, q_sn, kv_sn, scale, 0.0f, o_sn, o_sh, work, kvm);
}

/* The attention kernel as one call (kvm as for attention_kv_part). */
void rs_attention(const float *q, long q_sh, long q_sn, int H, int n, int D, const void *k, const void *v,
                  long kv_sh, long kv_sn, int G, int past, const int32_t *path, const int32_t *path_off, float scale,
                  float *out, long o_sn, long o_sh, float *work, int kvm, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    attention_kv_part(q, q_sh, q_sn, H, n, D, k, v, kv_sh, kv_sn, G, past, path, path_off, scale, out, o_sn, o_sh,
                      work, kvm, 0, 0, 0);
}

/* Keys per block the attention keeps laid out in a bf16 cache (D a multiple of 32): the tiles' blocks, or the vector
   dot products' where the CPU has them (0: this library lays out no blocks), and the elements one such block takes
   per key head (its keys, then its values). */
int rs_tile_keys(void) {
#ifdef TILE_ATTENTION
    return TKB;
#elif defined(DOT16)
    return cpu_bf16() ? KEY_BLOCK : 0;
#else
    return 0;
#endif
}
long rs_tile_block_elems(int D) { return 2L * rs_tile_keys() * D; }

/* Whether a bf16 cache's attention runs on the tiles: per sequence, on caches of their own (prefixes are copied, each
   cache keeping its own layout); elsewhere a shared prefix is read in place, its layout kept once for every cache. */
int rs_attention_tiles(void) {
#ifdef TILE_ATTENTION
    return 1;
#else
    return 0;
#endif
}

/* Whether a bf16 cache's attention multiplies bf16 operands here (the tiles, or the vector dot products where the CPU
   has them): its own rounding, so a bf16 cache is this library's natural KV storage. */
int rs_attention_bf16(void) {
#ifdef TILE_ATTENTION
    return 1;
#else
    return cpu_bf16();
#endif
}

/* Keys per block of the vector attention: a prefix shared by several caches comes in whole blocks. */
int rs_key_block(void) { return KEY_BLOCK; }

