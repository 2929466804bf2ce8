/* The layout of every struct Python hands the kernels (forward.h), for the check when a library loads: Python's
 * ctypes mirrors (decoding/runtime/kernels/abi.py) must have the same size and every field at the same offset, or the
 * library is refused (a field added on one side only would shift every field after it). */
#include <stddef.h>
#include <string.h>

#include "api.h"

typedef struct {
    const char *name; /* "struct" or "struct.field" */
    long value;       /* sizeof or offsetof */
} abi_entry;

#define SIZE(T) {#T, (long)sizeof(T)}
#define AT(T, f) {#T "." #f, (long)offsetof(T, f)}

static const abi_entry LAYOUT[] = {
    SIZE(rs_layer_weights), AT(rs_layer_weights, attn_norm), AT(rs_layer_weights, ffn_norm),
    AT(rs_layer_weights, wqkv), AT(rs_layer_weights, wo), AT(rs_layer_weights, wgu), AT(rs_layer_weights, wdown),
    AT(rs_layer_weights, t_qkv), AT(rs_layer_weights, t_o), AT(rs_layer_weights, t_gu), AT(rs_layer_weights, t_down),
    AT(rs_layer_weights, ld_qkv), AT(rs_layer_weights, ld_o), AT(rs_layer_weights, ld_gu),
    AT(rs_layer_weights, ld_down), AT(rs_layer_weights, b_qkv), AT(rs_layer_weights, q_norm),
    AT(rs_layer_weights, k_norm), AT(rs_layer_weights, post_attn_norm), AT(rs_layer_weights, post_ffn_norm),
    AT(rs_layer_weights, cos_t), AT(rs_layer_weights, sin_t), AT(rs_layer_weights, window),
    AT(rs_layer_weights, wrouter), AT(rs_layer_weights, wexp_gate), AT(rs_layer_weights, wexp_up),
    AT(rs_layer_weights, wexp_down), AT(rs_layer_weights, t_router), AT(rs_layer_weights, t_exp_gate),
    AT(rs_layer_weights, t_exp_up), AT(rs_layer_weights, t_exp_down), AT(rs_layer_weights, ld_router),
    AT(rs_layer_weights, ld_exp_gate), AT(rs_layer_weights, ld_exp_up), AT(rs_layer_weights, ld_exp_down),
    AT(rs_layer_weights, b_o), AT(rs_layer_weights, sinks), AT(rs_layer_weights, b_router),
    AT(rs_layer_weights, b_exp_gate), AT(rs_layer_weights, b_exp_up), AT(rs_layer_weights, b_exp_down),

    SIZE(rs_shape), AT(rs_shape, E), AT(rs_shape, H), AT(rs_shape, G), AT(rs_shape, D), AT(rs_shape, I),
    AT(rs_shape, eps), AT(rs_shape, scale), AT(rs_shape, act), AT(rs_shape, softcap), AT(rs_shape, tiles),
    AT(rs_shape, n_expert), AT(rs_shape, n_expert_used), AT(rs_shape, I_expert), AT(rs_shape, norm_topk),
    AT(rs_shape, softmax_topk), AT(rs_shape, qk_norm_all),

    SIZE(rs_scratch), AT(rs_scratch, h), AT(rs_scratch, qkv), AT(rs_scratch, q), AT(rs_scratch, att),
    AT(rs_scratch, gu), AT(rs_scratch, act), AT(rs_scratch, xd), AT(rs_scratch, xs), AT(rs_scratch, work),
    AT(rs_scratch, xq), AT(rs_scratch, router), AT(rs_scratch, moe_h), AT(rs_scratch, moe_xd), AT(rs_scratch, moe_xs),
    AT(rs_scratch, moe_gu), AT(rs_scratch, moe_act), AT(rs_scratch, moe_y), AT(rs_scratch, moe_out),
    AT(rs_scratch, moe_w), AT(rs_scratch, moe_xq), AT(rs_scratch, moe_sel), AT(rs_scratch, moe_rows),
    AT(rs_scratch, moe_start),

    SIZE(rs_kv_layer), AT(rs_kv_layer, kbuf), AT(rs_kv_layer, vbuf), AT(rs_kv_layer, kv_sh), AT(rs_kv_layer, kv_sn),
    AT(rs_kv_layer, tiles), AT(rs_kv_layer, tiles_sh), AT(rs_kv_layer, tiled), AT(rs_kv_layer, k0),
    AT(rs_kv_layer, v0), AT(rs_kv_layer, sh0), AT(rs_kv_layer, split), AT(rs_kv_layer, tiles0),
    AT(rs_kv_layer, tiles0_sh), AT(rs_kv_layer, tiled0), AT(rs_kv_layer, own0), AT(rs_kv_layer, pre0),

    SIZE(rs_sequence), AT(rs_sequence, rows), AT(rs_sequence, pos), AT(rs_sequence, start), AT(rs_sequence, past),
    AT(rs_sequence, path), AT(rs_sequence, path_off), AT(rs_sequence, kv),
};

long rs_abi_layout(const char *name) {
    for (size_t i = 0; i < sizeof(LAYOUT) / sizeof(LAYOUT[0]); ++i)
        if (!strcmp(LAYOUT[i].name, name)) return LAYOUT[i].value;
    return -1;
}
