/* ragspec CPU kernels: the quantized runtime's forward (decoding/runtime/quantized.py), one call for every layer:
 *
 *   per layer, in one OpenMP parallel region: norm + quantize, fused qkv (+ biases), rope (q / k norms) + KV store,
 *   attention (attention.c), o (+ post-norm), norm + quantize, fused gate / up, act * up + quantize, down
 *   (+ post-norm), or a mixture of experts in its place (moe_part); then the LM head (rs_head): final norm, the
 *   vocabulary's matrix product, soft-capping.
 *
 * A family's options (biases, q / k norms, post-norms, GELU, soft-capping, sliding windows) are fields of
 * rs_layer_weights / rs_shape (forward.h), set by its plan in decoding/runtime/families. The matrix products go
 * through matmul.c's dispatch in each weight's own format. A row's result never depends on the rows beside it.
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
#include "api.h"
#include "forward.h"
#include "rows.h"

void attention_kv_part(const float *, long, long, int, int, int, const void *, const void *, long, long, int, int,
                       const int32_t *, const int32_t *, float, float *, long, long, float *, int, uint16_t *, long, int);
void attention_seqs_part(const att_seq *, int, int, int, int, long, long, long, float, float, long, long, float *,
                         int);


/* A row's router logits -> its K experts and their weights: the largest softmax probabilities (ties to the lower
   index, in that order), renormalized to sum 1 where norm (Qwen3-MoE's and Mixtral's routing, as llama.cpp and
   transformers choose on the probabilities); or, where after (gpt-oss's), the largest logits, weighted by a softmax
   over the K chosen logits alone. */
static void route_row(const float *logits, int N, int K, int norm, int after, int32_t *sel, float *w) {
    float p[N];
    float mx = logits[0], sum = 0.0f, kept = 0.0f;
    for (int e = 1; e < N; ++e) mx = logits[e] > mx ? logits[e] : mx;
    for (int e = 0; e < N; ++e) sum += (p[e] = after ? logits[e] : expf(logits[e] - mx));
    for (int k = 0; k < K; ++k) {
        int best = 0;
        for (int e = 1; e < N; ++e) best = p[e] > p[best] ? e : best;
        sel[k] = best, w[k] = p[best], p[best] = -INFINITY;
    }
    if (after) { /* the first chosen is the largest */
        const float top = w[0];
        sum = 0.0f;
        for (int k = 0; k < K; ++k) sum += (w[k] = expf(w[k] - top));
    }
    for (int k = 0; k < K; ++k) w[k] = w[k] / sum, kept += w[k];
    for (int k = 0; k < K && norm && !after; ++k) w[k] = w[k] / kept;
}

/* x [M, E] += the mixture of experts of h (the normed rows, T->h / xq / xd / xs): the router, each row's K experts,
   then expert by expert the rows routed to it gathered into one matrix product (an expert's weights are read once
   for all of them; an expert no row chose is not read), and each row's K outputs summed in its own top-K order, so
   a row's result does not depend on the rows beside it. Inside the layer's parallel region. */
static void moe_part(const rs_layer_weights *L, const rs_shape *S, float *x, int M, const rs_scratch *T) {
    const int E = S->E, N = S->n_expert, K = S->n_expert_used, J = S->I_expert, nbE = E / QK;
    qmatmul_part(T->h, E, T->xq, T->xd, T->xs, M, E, L->wrouter, L->t_router, L->ld_router, N, T->router, N, L->b_router,
                 0, 0);
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m)
        route_row(T->router + (long)m * N, N, K, S->norm_topk, S->softmax_topk, T->moe_sel + (long)m * K, T->moe_w + (long)m * K);
#pragma omp single
    { /* the (row, slot) entries by expert, each expert's in row order */
        int32_t *start = T->moe_start, fill[N];
        for (int e = 0; e <= N; ++e) start[e] = 0;
        for (int i = 0; i < M * K; ++i) ++start[T->moe_sel[i] + 1];
        for (int e = 0; e < N; ++e) fill[e] = start[e], start[e + 1] += start[e];
        for (int i = 0; i < M * K; ++i) T->moe_rows[fill[T->moe_sel[i]]++] = i;
    }
    for (int e = 0; e < N; ++e) {
        const int n = T->moe_start[e + 1] - T->moe_start[e];
        if (!n) continue;
        const int32_t *at = T->moe_rows + T->moe_start[e];
#pragma omp for schedule(static)
        for (int r = 0; r < n; ++r) { /* the routed rows' normed activations, fp32 and quantized */
            const long m = at[r] / K;
            memcpy(T->moe_h + (long)r * E, T->h + m * E, sizeof(float) * E);
            memcpy(T->moe_xq + (long)r * E, T->xq + m * E, (size_t)E);
            memcpy(T->moe_xd + (long)r * nbE, T->xd + m * nbE, sizeof(float) * nbE);
            memcpy(T->moe_xs + (long)r * nbE, T->xs + m * nbE, sizeof(float) * nbE);
        }
        const uint8_t *wg = L->wexp_gate + (long)e * (J / 8) * L->ld_exp_gate;
        const uint8_t *wu = L->wexp_up + (long)e * (J / 8) * L->ld_exp_up;
        const uint8_t *wd = L->wexp_down + (long)e * (E / 8) * L->ld_exp_down;
        const float *bg = L->b_exp_gate ? L->b_exp_gate + (long)e * J : 0; /* the expert's biases (gpt-oss) */
        const float *bu = L->b_exp_up ? L->b_exp_up + (long)e * J : 0;
        const float *bd = L->b_exp_down ? L->b_exp_down + (long)e * E : 0;
        qmatmul_part(T->moe_h, E, T->moe_xq, T->moe_xd, T->moe_xs, n, E, wg, L->t_exp_gate, L->ld_exp_gate, J,
                     T->moe_gu, 2 * J, bg, 0, 0);
        qmatmul_part(T->moe_h, E, T->moe_xq, T->moe_xd, T->moe_xs, n, E, wu, L->t_exp_up, L->ld_exp_up, J,
                     T->moe_gu + J, 2 * J, bu, 0, 0);
        act_mul_quantize_part(T->moe_gu, n, J, S->act, T->moe_act, T->moe_xq, T->moe_xd, T->moe_xs);
        qmatmul_part(T->moe_act, J, T->moe_xq, T->moe_xd, T->moe_xs, n, J, wd, L->t_exp_down, L->ld_exp_down, E,
                     T->moe_y, E, bd, 0, 0);
#pragma omp for schedule(static)
        for (int r = 0; r < n; ++r) memcpy(T->moe_out + (long)at[r] * E, T->moe_y + (long)r * E, sizeof(float) * E);
    }
#pragma omp for schedule(static)
    for (int m = 0; m < M; ++m) { /* x += sum over the row's experts, in its top-K order, of weight x output */
        float *xr = x + (long)m * E;
        const float *w = T->moe_w + (long)m * K, *o = T->moe_out + (long)m * K * E;
        for (int t = 0; t < E; ++t) {
            float acc = w[0] * o[t];
            for (int k = 1; k < K; ++k) acc += w[k] * o[(long)k * E + t];
            xr[t] += acc;
        }
    }
}

/* x [M, E] <- layer l (weights L) of x for the rows of n sequences one after the other (M: their rows in all): the
   linear layers run once over every row (a weight is read once for all of them), rope and the KV store per
   sequence into its own cache, attention of every sequence at once (a prefix several sequences read in place is
   read once for all of them; on the tiles, per sequence). A row's result does not depend on the rows beside it. */
static void layer_batch(const rs_layer_weights *L, int l, const rs_shape *S, float *x, int n, const rs_sequence *seq,
                        int kv_mode, const rs_scratch *T, int threads) {
    const int E = S->E, H = S->H, G = S->G, D = S->D, I = S->I;
    const int QKV = (H + 2 * G) * D;
    int M = 0, valid[n > 0 ? n : 1], row0[n > 0 ? n : 1]; /* rows in all; each sequence's first row */
    for (int i = 0; i < n; ++i) row0[i] = M, M += seq[i].rows;
    int row_seq[M > 0 ? M : 1]; /* the sequence of each row */
    for (int i = 0; i < n; ++i)
        for (int m = 0; m < seq[i].rows; ++m) row_seq[row0[i] + m] = i;
    const int tk = kv_mode == 3 && D % 32 == 0 ? rs_tile_keys() : 0; /* keys per block kept laid out (0: none) */
    const int tiles_path = tk && rs_attention_tiles() && S->tiles;
    att_seq att[n > 0 ? n : 1]; /* the attention's view of each sequence (on the tiles: per sequence, below) */
    for (int i = 0; i < n; ++i) {
        const rs_sequence *s = seq + i;
        const rs_kv_layer *c = s->kv + l;
        const long own = s->start - c->own0; /* the sequence's own rows from here on are rewritten: stale blocks */
        if (tk && c->tiles && *c->tiled > own / tk) *c->tiled = (int32_t)(own / tk);
        valid[i] = tk && c->tiles ? *c->tiled : 0;
        const att_seq a = {T->q + (long)row0[i] * H * D, T->att + (long)row0[i] * H * D, s->rows, s->past, s->path, s->path_off,
                           c->kbuf, c->vbuf, c->k0, c->v0, c->kv_sh, c->sh0, (int)c->split,
                           tk ? c->tiles : 0, tk ? c->tiles0 : 0, c->tiles_sh, c->tiles0_sh, valid[i],
                           tk && c->tiles0 ? *c->tiled0 : 0, L->window, c->own0, c->pre0, L->sinks};
        att[i] = a;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        norm_quantize_part(x, E, M, E, L->attn_norm, S->eps, T->h, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->h, E, T->xq, T->xd, T->xs, M, E, L->wqkv, L->t_qkv, L->ld_qkv, QKV, T->qkv, QKV, L->b_qkv, 0, 0);
        if (S->qk_norm_all) qk_norm_all_part(T->qkv, M, QKV, H, G, D, L->q_norm, L->k_norm, S->eps);
        const float *qn = S->qk_norm_all ? 0 : L->q_norm, *kn = S->qk_norm_all ? 0 : L->k_norm; /* per head */
#pragma omp for schedule(static) /* rotary embedding, keys and values stored: every row of every sequence */
        for (int r = 0; r < M; ++r) {
            const int i = row_seq[r], m = r - row0[i];
            const rs_kv_layer *c = seq[i].kv + l;
            rope_store_row(T->qkv + (long)r * QKV, H, G, D, seq[i].pos[m], L->cos_t, L->sin_t, qn, kn,
                           S->eps, T->q + (long)r * H * D, c->kbuf, c->vbuf, c->kv_sh, c->kv_sn,
                           seq[i].start - c->own0 + m, kv_mode);
        }
        if (tiles_path) {
            for (int i = 0, r = 0; i < n; r += seq[i++].rows) {
                const rs_sequence *s = seq + i;
                const rs_kv_layer *c = s->kv + l;
                attention_kv_part(T->q + (long)r * H * D, D, (long)H * D, H, s->rows, D, c->kbuf, c->vbuf, c->kv_sh,
                                  c->kv_sn, G, s->past, s->path, s->path_off, S->scale, T->att + (long)r * H * D,
                                  (long)H * D, D, T->work, kv_mode, c->tiles, c->tiles_sh, valid[i]);
            }
        } else {
            attention_seqs_part(att, n, H, D, G, D, (long)H * D, seq[0].kv[l].kv_sn, S->scale, S->softcap, (long)H * D,
                                D, T->work, kv_mode);
        }
        quantize_part(T->att, (long)H * D, M, H * D, T->xq, T->xd, T->xs);
        if (L->post_attn_norm) { /* x += norm(o(att)) */
            qmatmul_part(T->att, (long)H * D, T->xq, T->xd, T->xs, M, H * D, L->wo, L->t_o, L->ld_o, E, T->h, E, L->b_o,
                         0, 0);
            norm_add_part(T->h, M, E, L->post_attn_norm, S->eps, x);
        } else { /* x += o(att) (+ its bias), the sum in the matmul */
            qmatmul_part(T->att, (long)H * D, T->xq, T->xd, T->xs, M, H * D, L->wo, L->t_o, L->ld_o, E, x, E, L->b_o, x,
                         E);
        }
        norm_quantize_part(x, E, M, E, L->ffn_norm, S->eps, T->h, E, T->xq, T->xd, T->xs);
        if (S->n_expert) {
            moe_part(L, S, x, M, T);
        } else {
            qmatmul_part(T->h, E, T->xq, T->xd, T->xs, M, E, L->wgu, L->t_gu, L->ld_gu, 2 * I, T->gu, 2 * I, 0, 0, 0);
            act_mul_quantize_part(T->gu, M, I, S->act, T->act, T->xq, T->xd, T->xs);
            if (L->post_ffn_norm) {
                qmatmul_part(T->act, I, T->xq, T->xd, T->xs, M, I, L->wdown, L->t_down, L->ld_down, E, T->h, E, 0, 0, 0);
                norm_add_part(T->h, M, E, L->post_ffn_norm, S->eps, x);
            } else {
                qmatmul_part(T->act, I, T->xq, T->xd, T->xs, M, I, L->wdown, L->t_down, L->ld_down, E, x, E, 0, x, E);
            }
        }
    }
    for (int i = 0; i < n && tk; ++i) { /* the attention laid out every whole block below past */
        const rs_kv_layer *c = seq[i].kv + l;
        const long past = seq[i].past, own = (past - c->own0) / tk, pre = (past < c->split ? past : c->split) / tk;
        if (c->tiles && own > valid[i]) *c->tiled = (int32_t)own;
        if (c->tiles0 && pre > *c->tiled0) *c->tiled0 = (int32_t)pre;
    }
}

/* x [M, E] <- every layer of x in turn (layer_batch), in one call: the whole forward runs without its caller. */
void rs_forward(const rs_layer_weights *layers, int n_layers, const rs_shape *shape, float *x, int n_seqs,
                const rs_sequence *seqs, int kv_mode, const rs_scratch *scratch, int threads) {
    for (int l = 0; l < n_layers; ++l) layer_batch(layers + l, l, shape, x, n_seqs, seqs, kv_mode, scratch, threads);
}

/* Final norm + LM head over the last `keep` rows of x [M, E]: logits [keep, V], soft-capped at softcap if > 0. */
void rs_head(const float *x, int M, int keep, int E, const float *norm, float eps, const uint8_t *w, int wtype,
             long ldw, int V, float softcap, float *logits, const rs_scratch *scratch, int threads) {
    const rs_scratch *T = scratch;
    const float *xs = x + (long)(M - keep) * E;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        norm_quantize_part(xs, E, keep, E, norm, eps, T->h, E, T->xq, T->xd, T->xs);
        qmatmul_part(T->h, E, T->xq, T->xd, T->xs, keep, E, w, wtype, ldw, V, logits, V, 0, 0, 0);
        if (softcap > 0.0f) soft_cap_part(logits, (long)keep * V, softcap);
    }
}
