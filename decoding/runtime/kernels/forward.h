/* The structs the forward reads (forward.c), as Python's ctypes mirrors them (decoding/runtime/kernels/abi.py):
 * every struct's size and every field's offset are compared with these when a library loads (abi.c). */
#ifndef RS_FORWARD_H
#define RS_FORWARD_H
#include <stdint.h>

typedef struct {
    const float *attn_norm, *ffn_norm;          /* [E] */
    const uint8_t *wqkv, *wo, *wgu, *wdown;     /* rows: (H+2G)*D, E, 2I, E */
    int t_qkv, t_o, t_gu, t_down;               /* their formats (rs_wtype) */
    long ld_qkv, ld_o, ld_gu, ld_down;          /* bytes per weight row */
    const float *b_qkv;                         /* optional q/k/v biases [(H+2G)*D] (Qwen2) */
    const float *q_norm, *k_norm;               /* optional per-head RMSNorm weights [D] (Qwen3, Gemma 3) */
    const float *post_attn_norm, *post_ffn_norm; /* optional [E] (Gemma 2 / 3): the block's output normed before
                                                    the residual add */
    const float *cos_t, *sin_t;                 /* the layer's rotary tables [positions, D/2] */
    int window;                                 /* sliding-window attention: keys a query sees (0: all) */
} rs_layer_weights;

typedef struct {
    int E, H, G, D, I;
    float eps, scale;  /* RMSNorm epsilon; the queries' scale */
    int act;           /* the gated MLP's activation: 0 SiLU, 1 GELU (tanh) */
    float softcap;     /* attention scores soft-capped at this (Gemma 2; 0: none) */
    int tiles;         /* a bf16 cache's attention may run on the tiles (0: a model with windows or soft-capping) */
} rs_shape;

/* Scratch (floats unless noted), per forward of M rows: h [M*E], qkv [M*(H+2G)*D], q [M*H*D], att [M*H*D],
   gu [M*2I], act [M*I], xq (int8) [M*max(E,I)], xd / xs [M*max(E,I)/32], work (attention). */
typedef struct {
    float *h, *qkv, *q, *att, *gu, *act, *xd, *xs, *work;
    int8_t *xq;
} rs_scratch;

/* One layer of a sequence's cache: rows below split (whole blocks of 64) are a prefix read in place (k0 / v0, sh0
   elements per key head), perhaps by other sequences of the forward too; row j >= split lies at row j - own0 of
   kbuf / vbuf (kv_sh elements per key head, kv_sn per row), row j < split at row j - pre0 of k0 / v0 (own0 > split,
   pre0 > 0: a sliding-window layer dropped the rows below, in whole blocks). tiles / tiled (own0 == split) (optional, a bf16 cache where the library
   lays out blocks, rs_tile_keys): the cache's own whole blocks (from row split on) laid out for the bf16 products,
   tiles_sh elements per key head, and how many are valid; tiles0 / tiled0 (optional, not on the tiles): the shared
   prefix's blocks laid out once for every cache reading it. */
typedef struct {
    void *kbuf, *vbuf;
    long kv_sh, kv_sn;
    uint16_t *tiles;
    long tiles_sh;
    int32_t *tiled;
    const void *k0, *v0;
    long sh0, split;
    uint16_t *tiles0;
    long tiles0_sh;
    int32_t *tiled0;
    long own0, pre0; /* the first cache row kbuf / k0 hold (split / 0, or past the rows a sliding window dropped) */
} rs_kv_layer;

/* One sequence's rows of a forward: its positions and its cache (kv: one entry per layer). Keys / values of its rows
   are written at cache rows start..start+rows-1; query i sees rows 0..past-1, then path[path_off[i]..path_off[i+1])
   (past = start for a tree pass). */
typedef struct {
    int rows;
    const int64_t *pos;
    long start;
    int past;
    const int32_t *path, *path_off;
    const rs_kv_layer *kv;
} rs_sequence;

#endif
