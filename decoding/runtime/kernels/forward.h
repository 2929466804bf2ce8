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
    const float *q_norm, *k_norm;               /* optional per-head RMSNorm weights [D] (Qwen3, Gemma 3), or
                                                   across all heads [H*D], [G*D] (rs_shape.qk_norm_all: OLMoE) */
    const float *post_attn_norm, *post_ffn_norm; /* optional [E] (Gemma 2 / 3): the block's output normed before
                                                    the residual add */
    const float *cos_t, *sin_t;                 /* the layer's rotary tables [positions, D/2] */
    int window;                                 /* sliding-window attention: keys a query sees (0: all) */
    /* a mixture of experts in place of the MLP (rs_shape.n_expert > 0; wgu / wdown unused): the router [n_expert, E]
       and every expert's gate and up rows [n_expert * I_expert, E] and down rows [n_expert * E, I_expert], stacked
       by expert (expert e's rows start at row e * I_expert, e * E: whole groups of 8) */
    const uint8_t *wrouter, *wexp_gate, *wexp_up, *wexp_down;
    int t_router, t_exp_gate, t_exp_up, t_exp_down;
    long ld_router, ld_exp_gate, ld_exp_up, ld_exp_down;
    /* optional (gpt-oss): the output projection's bias [E], every query head's attention sink [H] (a logit in each
       row's softmax with no value), the router's bias [n_expert] and the experts' biases, stacked by expert as their
       rows: gate / up [n_expert * I_expert], down [n_expert * E] */
    const float *b_o, *sinks, *b_router, *b_exp_gate, *b_exp_up, *b_exp_down;
} rs_layer_weights;

typedef struct {
    int E, H, G, D, I;
    float eps, scale;  /* RMSNorm epsilon; the queries' scale */
    int act;           /* the gated MLP's activation: 0 SiLU, 1 GELU (tanh), 2 gpt-oss's clamped SwiGLU */
    float softcap;     /* attention scores soft-capped at this (Gemma 2; 0: none) */
    int tiles;         /* a bf16 cache's attention may run on the tiles (0: a model with windows or soft-capping) */
    int n_expert, n_expert_used, I_expert; /* a mixture of experts: experts, experts per row, an expert's MLP size */
    int norm_topk;     /* the chosen experts' weights renormalized to sum 1 (Qwen3-MoE) */
    int softmax_topk;  /* the weights a softmax over the chosen experts' logits alone (gpt-oss) */
    int qk_norm_all;   /* q_norm / k_norm span all heads at once ([H*D], [G*D]; OLMoE), not each head ([D]) */
} rs_shape;

/* Scratch (floats unless noted), per forward of M rows: h [M*E], qkv [M*(H+2G)*D], q [M*H*D], att [M*H*D],
   gu [M*2I], act [M*I], xq (int8) [M*max(E,I)], xd / xs [M*max(E,I)/32], work (attention); with experts (N of them,
   K a row, size J): router [M*N], an expert's rows gathered: moe_h [M*E], moe_xq (int8) [M*max(E,J)], moe_xd /
   moe_xs [M*max(E,J)/32], moe_gu [M*2J], moe_act [M*J], moe_y [M*E]; every (row, slot)'s output moe_out [M*K*E],
   moe_w [M*K]; int32: moe_sel [M*K] (the experts chosen), moe_rows [M*K] (the (row, slot)s by expert), moe_start
   [N+1]. */
typedef struct {
    float *h, *qkv, *q, *att, *gu, *act, *xd, *xs, *work;
    int8_t *xq;
    float *router, *moe_h, *moe_xd, *moe_xs, *moe_gu, *moe_act, *moe_y, *moe_out, *moe_w;
    int8_t *moe_xq;
    int32_t *moe_sel, *moe_rows, *moe_start;
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
