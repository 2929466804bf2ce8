/* The row operations a forward runs between its matrix products (rows.c), each a "part" (orphaned `omp for`
 * loops, run inside a parallel region) computing a row by the same operations whatever the rows beside it. */
#ifndef RS_ROWS_H
#define RS_ROWS_H
#include <stdint.h>

#define QK 32 /* activations are quantized per block of 32 */

/* x [M, K] -> int8 xq [M*K], scales xd and scaled sums xs [M*K/32] (what the quantized formats read) */
void quantize_part(const float *x, long ldx, int M, int K, int8_t *xq, float *xd, float *xs);
/* y = rmsnorm(x) * weight per row, then quantized as quantize_part does */
void norm_quantize_part(const float *x, long ldx, int M, int K, const float *weight, float eps, float *y, long ldy,
                        int8_t *xq, float *xd, float *xs);
/* one row's rotary embedding (q / k norms first where given), queries to q, keys / values into the cache */
void rope_store_row(const float *row, int H, int G, int D, int64_t pos, const float *cos_t, const float *sin_t,
                    const float *q_norm, const float *k_norm, float eps, float *q, void *kbuf, void *vbuf, long kv_sh,
                    long kv_sn, long at, int kv_mode);
/* queries and keys of each qkv row RMS-normalized across all their heads at once, in place (OLMoE) */
void qk_norm_all_part(float *qkv, int M, long ld, int H, int G, int D, const float *q_norm, const float *k_norm,
                      float eps);
/* a = act(gate) * up per row (0 SiLU, 1 GELU tanh; 2 gpt-oss's: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, +-7) + 1)),
   then quantized */
void act_mul_quantize_part(const float *gu, int M, int I, int act, float *a, int8_t *xq, float *xd, float *xs);
/* x += rmsnorm(y) * weight per row (Gemma's post-norms; y is normed in place) */
void norm_add_part(float *y, int M, int E, const float *weight, float eps, float *x);
/* y <- cap * tanh(y / cap) elementwise (Gemma 2's final logits) */
void soft_cap_part(float *y, long n, float cap);
#endif
