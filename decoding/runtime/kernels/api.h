/* Every entry point Python calls (ctypes), declared once: each defining file includes this header, so the compiler
 * holds the definitions to these prototypes, and decoding/runtime/kernels/abi.py declares the same functions with
 * the same parameter names and types (tests/decoding/runtime/test_abi.py reads this file and compares). Pointers
 * are addresses on the Python side; the structs are forward.h's, their layout checked at load (abi.c). */
#ifndef RS_API_H
#define RS_API_H
#include <stdint.h>

#include "forward.h"

/* the library */
const char *rs_isa(void);                      /* the ISA path it was built for */
int rs_format_sizes(int wtype, int *out);      /* formats.h's sizes of a format (0), or -1 */
long rs_abi_layout(const char *name);          /* sizeof "struct", offsetof "struct.field", or -1 */
int rs_pair_table(const uint8_t *set, uint8_t *got); /* the pair choice by rows (formats.h): set / read; its size */

/* the quantized runtime's forward (forward.c) */
void rs_forward(const rs_layer_weights *layers, int n_layers, const rs_shape *shape, float *x, int n_seqs,
                const rs_sequence *seqs, int kv_mode, const rs_scratch *scratch, int threads);
void rs_head(const float *x, int M, int keep, int E, const float *norm, float eps, const uint8_t *w, int wtype,
             long ldw, int V, float softcap, float *logits, const rs_scratch *scratch, int threads);

/* one matrix product or dequantization in any format (matmul.c) */
void rs_qlinear(const float *x, int M, int K, const uint8_t *w, int wtype, long ldg, int N, const float *bias,
                const float *res, float *y, int8_t *xq, float *xd, float *xs, int threads);
void rs_dequant_rows(const uint8_t *w, int wtype, long ldg, int K, const int64_t *rows, int R, float *out,
                     int threads);

/* fp32 linear layers for the transformers path (linear_f32.c) */
void rs_linear_f32(const float *x, int M, int K, const float *w, int N, const float *bias, float *y, int threads);

/* attention (attention.c) */
void rs_attention(const float *q, long q_sh, long q_sn, int H, int n, int D, const void *k, const void *v,
                  long kv_sh, long kv_sn, int G, int past, const int32_t *path, const int32_t *path_off, float scale,
                  float *out, long o_sn, long o_sh, float *work, int kvm, int threads);
int rs_tile_keys(void);               /* keys per block a bf16 cache keeps laid out (0: none) */
long rs_tile_block_elems(int D);      /* elements of one laid-out block */
int rs_attention_tiles(void);         /* 1: a bf16 cache's attention runs on the tiles */
int rs_attention_bf16(void);          /* 1: bf16 is this library's preferred KV storage */
int rs_key_block(void);               /* keys per block of the vector attention */

#endif
