"""The quantized CPU runtime: a lean decoder forward on weights in their GGUF formats, over ragspec's batch-invariant
kernels, for every family of ``decoding.runtime.families``.

gpt-fast style: the model is a list of layer weights and one short forward,

    embed (dequantized rows) -> rs_forward: [norm, fused qkv, rope + KV store, attention, o, norm, fused
    gate/up, act * up, down] x layers -> rs_head: final norm + LM head

where ``rs_forward`` is one call into ``decoding/runtime/kernels/forward.c`` running one OpenMP parallel region
a layer (its structs and arguments declared once in ``kernels/abi.py``, checked against the library at load): no
per-op Python, no transformers module tree on the hot path, the GIL free for the whole forward. Weights
stay in their GGUF block formats (``decoding.runtime.quant``): a GGUF file is used as stored, a safetensors model is
quantized at load.

It is a ``decoding.runtime.interface.TargetRuntime`` (the engine drives it through that protocol alone), and it
also answers the transformers causal-LM call (``input_ids``, ``position_ids``, an additive tree mask, a
``SlotCache`` as ``past_key_values``, ``logits_to_keep``), which references in tests compare with. Every
output element is computed by the same operations whatever the number of rows in the forward (see the C
file), so a draft-tree node's logits equal its logits decoded alone, bit for bit, at any thread count. Several
sequences, each on its own cache, run in one forward (``forward_batch``): the linear layers read each weight once
for all their rows, attention runs per sequence on its cache, and every row is what it is alone.
Supported: the families of ``decoding.runtime.families`` (Llama 2 / 3, Mistral, Mixtral, Qwen 2 / 3, Qwen3-MoE,
gpt-oss, OLMoE, Gemma 2 / 3, Phi-3): their options (biases, q / k norms, post-norms, GELU, soft-capping,
sliding-window layers, a local rope base, a mixture of experts for the MLP) are fields of the same forward
(``ForwardPlan``); rotary frequencies must not depend on the sequence length.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from decoding.cache.slot import SlotCache, SlotLayer
from decoding.errors import ModelLoadError
from decoding.runtime import kernels
from decoding.runtime.families import ForwardPlan, family_of, forward_plan
from decoding.runtime.interface import CHUNK_ROWS, BatchItem, additive_tree_mask, visibility
from decoding.runtime.kernels import abi
from decoding.runtime.kernels.abi import CKvLayer, CLayer, CScratch, CSequence, CShape
from decoding.runtime.quant import QuantMatrix
from decoding.runtime.rope import rotary_tables
from decoding.runtime.weights import LayerWeights, ModelWeights, check_supported, model_dims

ROPE_ROWS = 4096  # positions the rotary tables cover at load (they grow as positions reach them)
KV_STORAGE = (torch.float32, torch.float16, torch.bfloat16, torch.int8)  # int8: per 32 values with fp32 scales


@dataclass
class _Part:
    """A sequence's rows of one kernel forward: positions, cache, first cache row and visibility."""

    rows: int
    pos: torch.Tensor
    cache: SlotCache
    start: int
    vis: Any  # (past, path, path_off)


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


def _matrix(m: QuantMatrix | None) -> tuple[int | None, int, int]:
    """A matrix as a layer struct holds it: (address, format, bytes per group of 8 rows); (NULL, 0, 0) for none."""
    return (None, 0, 0) if m is None else (_addr(m.data), int(m.kind), m.group_bytes)


def _layer_struct(lw: LayerWeights, rope: tuple[torch.Tensor, torch.Tensor], window: int) -> CLayer:
    mats = {name: _matrix(getattr(lw, attr)) for name, attr in (
        ("qkv", "qkv"), ("o", "o"), ("gu", "gate_up"), ("down", "down"), ("router", "router"),
        ("exp_gate", "experts_gate"), ("exp_up", "experts_up"), ("exp_down", "experts_down"))}
    biases = lw.experts_bias or (None, None, None)
    return CLayer(
        b_o=_addr(lw.o_bias), sinks=_addr(lw.sinks), b_router=_addr(lw.router_bias), b_exp_gate=_addr(biases[0]),
        b_exp_up=_addr(biases[1]), b_exp_down=_addr(biases[2]),
        attn_norm=_addr(lw.attn_norm), ffn_norm=_addr(lw.ffn_norm), b_qkv=_addr(lw.qkv_bias), q_norm=_addr(lw.q_norm),
        k_norm=_addr(lw.k_norm), post_attn_norm=_addr(lw.post_attn_norm), post_ffn_norm=_addr(lw.post_ffn_norm),
        cos_t=_addr(rope[0]), sin_t=_addr(rope[1]), window=window,
        **{f"w{name}": m[0] for name, m in mats.items()}, **{f"t_{name}": m[1] for name, m in mats.items()},
        **{f"ld_{name}": m[2] for name, m in mats.items()},
    )


class _Buffers:
    """Per-thread scratch for forwards of up to ``rows`` rows; grown on demand."""

    def __init__(self) -> None:
        self.rows = 0
        self.work_floats = 0
        self.experts = (0, 0, 0)
        self.tensors: dict[str, torch.Tensor] = {}
        self.struct = CScratch()

    def ensure(self, rows: int, work_floats: int, e: int, qkv: int, hd: int, inter: int,
               experts: tuple[int, int, int] = (0, 0, 0)) -> CScratch:
        """``experts``: (experts, experts a row, an expert's MLP size) of a mixture of experts, (0, 0, 0) without."""
        if rows <= self.rows and work_floats <= self.work_floats and experts == self.experts:
            return self.struct
        self.rows, self.work_floats = max(rows, self.rows), max(work_floats, self.work_floats)
        self.experts = experts
        r, widest = self.rows, max(e, hd, inter)
        f32 = torch.float32
        n, k, j = experts
        moe = {
            "router": torch.empty(r * n, dtype=f32), "moe_h": torch.empty(r * e, dtype=f32),
            "moe_xd": torch.empty(r * max(e, j) // 32, dtype=f32),
            "moe_xs": torch.empty(r * max(e, j) // 32, dtype=f32),
            "moe_gu": torch.empty(r * 2 * j, dtype=f32), "moe_act": torch.empty(r * j, dtype=f32),
            "moe_y": torch.empty(r * e, dtype=f32), "moe_out": torch.empty(r * k * e, dtype=f32),
            "moe_w": torch.empty(r * k, dtype=f32),
            "moe_xq": torch.empty(kernels.tile_rows(r) * max(e, j), dtype=torch.int8),
            "moe_sel": torch.empty(r * k, dtype=torch.int32), "moe_rows": torch.empty(r * k, dtype=torch.int32),
            "moe_start": torch.empty(n + 1, dtype=torch.int32),
        } if n else {}  # fmt: skip
        t = {**moe,
            "h": torch.empty(r * e, dtype=f32), "qkv": torch.empty(r * qkv, dtype=f32),
            "q": torch.empty(r * hd, dtype=f32), "att": torch.empty(r * hd, dtype=f32),
            "gu": torch.empty(r * 2 * inter, dtype=f32), "act": torch.empty(r * inter, dtype=f32),
            "xd": torch.empty(r * widest // 32, dtype=f32), "xs": torch.empty(r * widest // 32, dtype=f32),
            "work": torch.empty(self.work_floats, dtype=f32),
            "xq": torch.empty(kernels.tile_rows(r) * widest, dtype=torch.int8),  # whole tiles of rows (AMX)
        }  # fmt: skip
        self.tensors = t
        self.struct = CScratch(**{entry[0]: _addr(t.get(entry[0])) for entry in CScratch._fields_})
        return self.struct


class QuantizedModel:
    """The target's forward on quantized weights (CPU, fp32 activations, fp32 / fp16 / bf16 / int8 KV; by default
    bf16 where the attention runs on the tiles, fp16 elsewhere), one sequence or a batch of them per forward: a
    ``TargetRuntime``. ``rope_tag`` names a rope scaling the loader wrote into the config (in ``runtime_tag``)."""

    dtype = torch.float32  # activations and logits
    device = torch.device("cpu")
    batches = True  # forward_batch: one forward for every item, each row what it is alone

    def __init__(self, weights: ModelWeights, kv_dtype: torch.dtype | None = None, rope_tag: str = "") -> None:
        lib = kernels.load()
        if lib is None:
            raise ModelLoadError(f"the quantized CPU runtime needs the CPU kernels: {kernels.unavailable_reason()}")
        if kv_dtype is None:
            kv_dtype = kernels.default_kv_dtype(lib)
        if kv_dtype not in KV_STORAGE:
            raise ModelLoadError(f"KV cache dtype must be float32, float16, bfloat16 or int8, not {kv_dtype}")
        self.lib = lib
        self.weights = weights
        self.config = weights.config
        check_supported(self.config)
        self.kv_dtype = kv_dtype
        self.rope_tag = rope_tag
        kind = f"cpu-quantized+{rope_tag}" if rope_tag else "cpu-quantized"
        self.runtime_tag = f"{kind}:{weights.source}/kv-{str(kv_dtype).removeprefix('torch.')}"
        e, h, g, d, inter = model_dims(self.config)
        if kv_dtype == torch.int8 and d % 32:
            raise ModelLoadError(f"an int8 KV cache quantizes per 32 values: head size {d} is not a multiple of 32")
        self.dims = (e, h, g, d, inter)
        self.vocab = weights.head.rows
        self.max_positions = int(self.config.max_position_embeddings)
        plan: ForwardPlan = forward_plan(self.config)
        self.plan = plan
        eps = float(getattr(self.config, "rms_norm_eps", 1e-6))
        self.eps = eps
        self.experts = plan.experts  # (experts, a row's, an expert's MLP size); (0, 0, 0): a dense MLP
        self.shape = CShape(E=e, H=h, G=g, D=d, I=inter, eps=eps, scale=plan.query_scale, act=plan.activation,
                            softcap=plan.attn_softcap, tiles=int(self._tiles_allowed()), n_expert=plan.experts[0],
                            n_expert_used=plan.experts[1], I_expert=plan.experts[2], norm_topk=int(plan.norm_topk),
                            softmax_topk=int(plan.topk_softmax), qk_norm_all=int(plan.qk_norm_all))
        self._rope_tables(min(self.max_positions, ROPE_ROWS))
        self._local = threading.local()

    def _rope_tables(self, rows: int) -> None:
        """Rotary tables for positions below ``rows`` (a 128K-window model's would take hundreds of MB from the
        start: they grow, doubling, as positions reach them; a row's values do not depend on the table's size),
        and the layers' structs pointing at them."""
        self.rope_rows = rows
        self.cos, self.sin = rotary_tables(self.config, rows)
        ropes = {False: (self.cos, self.sin)}
        local = family_of(self.config).local_rope
        if any(self.plan.local_rope) and local is not None:
            ropes[True] = rotary_tables(local(self.config), rows)
        self._ropes = ropes
        self.layer_structs = (CLayer * len(self.weights.layers))(*(
            _layer_struct(lw, ropes[local], window)
            for lw, local, window in zip(self.weights.layers, self.plan.local_rope, self.plan.windows, strict=True)))

    @property
    def num_layers(self) -> int:
        return len(self.weights.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def weight_bytes(self) -> int:
        return int(self.weights.nbytes)

    def _buffers(self) -> _Buffers:
        buf: _Buffers | None = getattr(self._local, "buffers", None)
        if buf is None:
            buf = self._local.buffers = _Buffers()
        return buf

    def __call__(
        self,
        input_ids: torch.Tensor,  # [1, n]
        position_ids: torch.Tensor | None = None,  # [1, n]
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive (a tree) or None (causal)
        past_key_values: SlotCache | None = None,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> SimpleNamespace:
        return kernels.run_on_kernel_thread(self._call, input_ids, position_ids, attention_mask, past_key_values,
                                            logits_to_keep)

    def _call(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
        past_key_values: SlotCache | None, logits_to_keep: int,
    ) -> SimpleNamespace:
        cache = past_key_values if past_key_values is not None else self.new_cache(input_ids.numel())
        ids, pos, keep = self.check(BatchItem(input_ids, cache, position_ids, attention_mask, logits_to_keep))
        n, start = ids.numel(), cache.length
        x = self._embed(ids)  # [n, E]
        if attention_mask is not None:
            vis = self._treevisibility(attention_mask, n, start)
            self._check_window_reads(cache, vis)
            self._reserve(cache, start + n)
            self._layers(x, [_Part(n, pos, cache, start, vis)])
        else:
            for c0 in range(0, n, CHUNK_ROWS):  # room per chunk: a sliding window's layers drop rows in between
                c1 = min(n, c0 + CHUNK_ROWS)
                self._reserve(cache, start + c1)
                vis = visibility(None, c1 - c0, start + c1)
                self._layers(x[c0:c1], [_Part(c1 - c0, pos[c0:c1], cache, start + c0, vis)])
        return SimpleNamespace(logits=self._head(x, keep).unsqueeze(0))

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        cache: SlotCache,
        position_ids: torch.Tensor | None = None,  # [1, n]
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive (tree_mask's) or None (causal)
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """One sequence's rows on its cache: the kept logits ``[keep, V]`` (a causal input of any length runs in
        chunks of ``CHUNK_ROWS``, a tree takes at most ``kernels.MAX_ROWS`` rows)."""
        out = kernels.run_on_kernel_thread(self._call, input_ids, position_ids, attention_mask, cache, logits_to_keep)
        return out.logits[0]  # type: ignore[no-any-return]

    def row_kernels(self, choice: list[bool] | None = None) -> list[bool]:
        """Which of two interchangeable kernels a forward of ``m`` rows runs its matrix products on (entry ``m``, the
        last for that many or more; True: pairs of weight groups on 512-bit vectors): set to ``choice`` first where
        given (``decoding.speculative.calibration.choose_row_kernels`` measures it). Empty where there is no choice.
        The library's, so every model on it shares it; the same bits either way."""
        return kernels.pair_table(self.lib, choice)

    def tree_mask(self, ancestors: torch.Tensor, past: int) -> torch.Tensor:
        """A draft tree's 0 / -inf visibility ``[1, 1, n, past + n]`` (fp32), which the kernels read back as the
        tree's paths."""
        return additive_tree_mask(ancestors, past, self.dtype)

    def validate(self, item: BatchItem) -> None:
        self.check(item)

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """Several sequences, each on its own cache, in one forward per layer: the weights are read once for all
        their rows. Returns each item's kept logits ``[keep, V]``, equal bit for bit to what the item's own call
        returns (a causal item takes at most ``CHUNK_ROWS`` rows, a tree ``kernels.MAX_ROWS``)."""
        return kernels.run_on_kernel_thread(self._forward_batch, items)

    def _forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        if not items or len({id(item.cache) for item in items}) < len(items):
            raise ValueError("forward_batch takes one or more items, each on a cache of its own")
        checked = [self.check(item) for item in items]
        parts, keeps = [], []
        for item, (ids, pos, keep) in zip(items, checked, strict=True):
            n, start = ids.numel(), item.cache.length
            if item.attention_mask is None and n > CHUNK_ROWS:
                raise ValueError(f"a causal batch item takes at most {CHUNK_ROWS} rows, got {n}")
            vis = (self._treevisibility(item.attention_mask, n, start) if item.attention_mask is not None
                   else visibility(None, n, start + n))
            if item.attention_mask is not None:
                self._check_window_reads(item.cache, vis)
            parts.append(_Part(n, pos, item.cache, start, vis))
            keeps.append(keep)
        x = self._embed(torch.cat([ids for ids, _, _ in checked]))
        for part in parts:
            self._reserve(part.cache, part.start + part.rows)
        self._layers(x, parts)
        ends = torch.tensor([part.rows for part in parts]).cumsum(0).tolist()
        kept = torch.cat([torch.arange(end - keep, end) for end, keep in zip(ends, keeps, strict=True)])
        return list(self._head(x[kept].contiguous(), len(kept)).split(keeps))

    def check(self, item: BatchItem) -> tuple[torch.Tensor, torch.Tensor, int]:
        """An item's ids, positions (int64) and number of kept rows, or a ValueError."""
        ids = item.input_ids.reshape(-1)
        n, start = ids.numel(), item.cache.length
        pos = (item.position_ids.reshape(-1) if item.position_ids is not None else torch.arange(start, start + n))
        pos = pos.to(torch.int64).contiguous()
        if n == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.weights.embed.rows:
            raise ValueError(f"token ids must be in [0, {self.weights.embed.rows}), got {n} ids")
        if int(pos.max()) >= self.max_positions:
            raise ValueError(f"position {int(pos.max())} beyond the model's {self.max_positions}")
        return ids, pos, n if not item.logits_to_keep else min(int(item.logits_to_keep), n)

    @staticmethod
    def _treevisibility(mask: torch.Tensor, n: int, start: int) -> Any:
        if n > kernels.MAX_ROWS:
            raise ValueError(f"a tree forward takes at most {kernels.MAX_ROWS} rows, got {n}")
        vis = visibility(mask, n, start + n)
        if vis is None:
            raise ValueError("QuantizedModel takes a causal forward or a 0 / -inf visibility mask, not a bias")
        return vis

    @staticmethod
    def _check_window_reads(cache: SlotCache, vis: Any) -> None:
        """A ValueError if a query of a visibility mask (one reading chosen rows far back, as RAPID-KV's drafter
        does) would read rows a sliding-window layer of ``cache`` dropped; a causal or tree forward never does."""
        if not cache.floor:
            return
        past, path, off = vis
        counts = (off[1:] - off[:-1]).to(torch.int64)  # [n] path rows per query
        for window in {layer.window for layer in cache.slot_layers if layer.window}:
            lo = (past + counts - window).clamp(min=0)  # [n] each query's first visible key, by logical index
            at = (off[:-1].to(torch.int64) + (lo - past)).clamp(0, max(0, path.numel() - 1))
            reads = torch.where(lo < past, lo, path.to(torch.int64)[at] if path.numel() else lo)
            first = max(layer.first for layer in cache.slot_layers if layer.window == window)
            if int(reads.min()) < first:
                raise ValueError(f"the mask shows cache rows below {first}, which this cache's sliding-window layers "
                                 "dropped")

    @property
    def kv_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: the layer reads every row)."""
        return tuple(int(w) for w in self.plan.windows)

    def new_cache(self, capacity: int) -> SlotCache:
        """A cache whose sliding-window layers keep only the rows their window reads (``decoding.cache.slot``)."""
        return SlotCache(self.num_layers, capacity, self.kv_windows)

    @property
    def kv_storage(self) -> torch.dtype:
        """The cache buffers' dtype: int8 keys / values are stored as uint8 rows holding their scales."""
        return torch.uint8 if self.kv_dtype == torch.int8 else self.kv_dtype

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token's keys and values take in a cache, over the layers that keep every row (tiled
        copies included); a sliding-window layer holds a bounded number of rows."""
        _, _, g, d, _ = self.dims
        row = kernels.kv_row_width(self.kv_storage, d) * self.kv_storage.itemsize
        full = sum(1 for w in self.kv_windows if not w)
        return full * 2 * g * row * (2 if self._tile_keys() else 1)

    @property
    def share_block(self) -> int:
        """Rows per block a cache's shared prefix comes in (``SlotCache.load_prefix``): whole blocks of the attention
        are read in place, by every sequence of a batch at once; 0: this runtime copies prefixes (the tiles' path
        keeps each cache's own tiled layout)."""
        return 0 if self._tile_keys() and self.lib.rs_attention_tiles() else int(self.lib.rs_key_block())

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` [n] (dequantized; Gemma's times sqrt(hidden) in fp32, as transformers does)."""
        x = kernels.dequant_rows(self.lib, self.weights.embed, ids)  # [n, E]
        return x.mul_(self.plan.embed_scale) if self.plan.embed_scale != 1.0 else x

    def _tiles_allowed(self) -> bool:
        """Whether a bf16 cache's attention may run on the tiles: they neither slide a window, nor soft-cap, nor
        add sinks."""
        return not any(self.plan.windows) and not self.plan.attn_softcap and not self.plan.sinks

    def _tile_keys(self) -> int:
        """Keys per block the attention keeps laid out in the cache (0: this library and storage keep none)."""
        if self.kv_storage != torch.bfloat16 or self.dims[3] % 32:
            return 0
        if self.lib.rs_attention_tiles() and not self._tiles_allowed():
            return 0  # the vector attention runs this model: it lays out no tiles' blocks
        return int(self.lib.rs_tile_keys())

    def _ready(self, layer: SlotLayer, rows: int, tile_keys: int) -> bool:
        """Whether ``layer`` (and every layer of the cache with its window: they grow together) has room for
        ``rows`` rows, and, keeping every row, its blocks' and its shared prefix's layouts."""
        room = layer.is_initialized and layer.dtype == self.kv_storage and rows - layer.base <= layer.capacity
        if layer.window or not tile_keys or not room:
            return room
        tiles_cover = layer.tiles is not None and layer.tiles.shape[1] * tile_keys >= layer.capacity
        return tiles_cover and (layer.shared_tiles is not None or not layer.split)

    def _reserve(self, cache: SlotCache, rows: int) -> None:
        """Room in every layer of ``cache`` for rows up to ``rows`` (a sliding-window layer drops the rows below
        its next queries' window first), and the laid-out blocks of the layers that keep every row."""
        _, _, g, d, _ = self.dims
        layers, tile_keys = cache.slot_layers, self._tile_keys()
        kinds = {layer.window: layer for layer in reversed(layers)}  # the first layer of each window
        if all(self._ready(layer, rows, tile_keys) for layer in kinds.values()):
            return
        elems = int(self.lib.rs_tile_block_elems(d)) if tile_keys else 0
        for layer in layers:
            layer.reserve(g, kernels.kv_row_width(self.kv_storage, d), self.kv_storage, rows)
            if tile_keys and not layer.window:  # the attention keeps the whole blocks laid out for its bf16 products
                layer.reserve_tiles(g, elems, tile_keys)
        unlaid = [i for i, layer in enumerate(layers) if tile_keys and not layer.window and layer.split
                  and layer.shared_tiles is None]
        if unlaid:  # a shared prefix's, once for every cache reading it
            assert cache.shared_prefix is not None
            layouts = cache.shared_prefix.laid_out(layers[unlaid[0]].split, g, elems, tile_keys)
            for i in unlaid:
                layers[i].share_tiles(*layouts[i])

    @staticmethod
    def _kv_view(cache: SlotCache) -> Any:
        """The cache's layers as the kernels read them (``CKvLayer`` per layer), made again when a buffer moved."""
        moved = cache.moved()
        if cache.runtime_view is not None and cache.runtime_view[0] == moved:
            return cache.runtime_view[1]
        view = (CKvLayer * len(cache.slot_layers))()
        for kv, layer in zip(view, cache.slot_layers, strict=True):
            kbuf, vbuf = layer.buffers()
            kv.kbuf, kv.vbuf, kv.kv_sh, kv.kv_sn = kbuf.data_ptr(), vbuf.data_ptr(), kbuf.stride(1), kbuf.stride(2)
            kv.tiled = layer.tiled.data_ptr()
            if layer.tiles is not None:
                kv.tiles, kv.tiles_sh = layer.tiles.data_ptr(), layer.tiles.stride(0)
            kv.own0, kv.pre0 = layer.base, layer.pre0
            if layer.shared is not None:
                k0, v0 = layer.shared
                kv.k0, kv.v0, kv.sh0, kv.split = k0.data_ptr(), v0.data_ptr(), k0.stride(1), layer.split
            if layer.shared_tiles is not None:
                tiles0, tiled0 = layer.shared_tiles
                kv.tiles0, kv.tiles0_sh, kv.tiled0 = tiles0.data_ptr(), tiles0.stride(0), tiled0.data_ptr()
        cache.runtime_view = (moved, view)
        return view

    def _layers(self, x: torch.Tensor, parts: list[_Part]) -> None:
        """Run rows ``x`` [m, E] through every layer (one call into the kernels): ``parts``, one after the other, are
        the rows of each sequence, whose KV goes to its own cache from its ``start``."""
        m = x.shape[0]
        e, h, g, d, inter = self.dims
        reach = max(int(p.pos.max()) for p in parts) + 1
        if reach > self.rope_rows:
            self._rope_tables(min(self.max_positions, max(reach, 2 * self.rope_rows)))
        work = sum(kernels.attention_work_floats(h, p.rows, d, p.vis[0] + int((p.vis[2][1:] - p.vis[2][:-1]).max()))
                   for p in parts)
        scratch = self._buffers().ensure(m, work, e, (h + 2 * g) * d, h * d, inter, self.experts)
        assert x.is_contiguous(), "rows are updated in place"
        seqs = (CSequence * len(parts))()
        for seq, p in zip(seqs, parts, strict=True):
            past, path, off = p.vis
            seq.rows, seq.pos, seq.start, seq.past, seq.path, seq.path_off = (
                p.rows, _addr(p.pos), p.start, past, _addr(path), _addr(off))
            seq.kv = ctypes.addressof(self._kv_view(p.cache))
        abi.call(self.lib, "rs_forward", layers=ctypes.addressof(self.layer_structs), n_layers=len(self.layer_structs),
                 shape=self.shape, x=_addr(x), n_seqs=len(parts), seqs=ctypes.addressof(seqs),
                 kv_mode=kernels.kv_mode(self.kv_storage), scratch=scratch, threads=torch.get_num_threads())
        for p in parts:
            for layer in p.cache.slot_layers:
                layer.advance(p.rows)

    def _head(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        """Final norm and LM head of the last ``keep`` rows: logits ``[keep, V]``."""
        n, e = x.shape
        head = self.weights.head
        logits = torch.empty(keep, self.vocab, dtype=torch.float32)
        _, h, g, d, inter = self.dims
        scratch = self._buffers().ensure(keep, 0, e, (h + 2 * g) * d, h * d, inter, self.experts)
        abi.call(self.lib, "rs_head", x=_addr(x), M=n, keep=keep, E=e, norm=_addr(self.weights.norm), eps=self.eps,
                 w=_addr(head.data), wtype=int(head.kind), ldw=head.group_bytes, V=self.vocab,
                 softcap=self.plan.final_softcap, logits=_addr(logits), scratch=scratch,
                 threads=torch.get_num_threads())
        return logits
