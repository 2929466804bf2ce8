"""Everything that crosses into the C kernels, declared once on the Python side: the structs (ctypes mirrors of
``forward.h``'s, each naming its C type), and every entry point's parameters by name and type (``FUNCTIONS``,
mirroring ``api.h``, which the C definitions are compiled against). ``check_layout`` compares every struct's size and
field offsets with the library's own ``sizeof`` / ``offsetof`` (``rs_abi_layout``) when a library loads, and
``call`` passes arguments by name, so a parameter added, removed or reordered on one side fails loudly instead of
shifting every value after it. tests/decoding/runtime/test_abi.py compares ``FUNCTIONS`` with ``api.h``."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class Struct(ctypes.Structure):
    c_name: ClassVar[str]  # the C typedef it mirrors (forward.h)


class CLayer(Struct):
    """``rs_layer_weights``: one layer's weights (addresses), their formats and row strides, the family's options."""

    c_name = "rs_layer_weights"
    _fields_ = [
        ("attn_norm", _p), ("ffn_norm", _p), ("wqkv", _p), ("wo", _p), ("wgu", _p), ("wdown", _p),
        ("t_qkv", _i), ("t_o", _i), ("t_gu", _i), ("t_down", _i),
        ("ld_qkv", _l), ("ld_o", _l), ("ld_gu", _l), ("ld_down", _l), ("b_qkv", _p),
        ("q_norm", _p), ("k_norm", _p), ("post_attn_norm", _p), ("post_ffn_norm", _p), ("cos_t", _p), ("sin_t", _p),
        ("window", _i),
        ("wrouter", _p), ("wexp_gate", _p), ("wexp_up", _p), ("wexp_down", _p),
        ("t_router", _i), ("t_exp_gate", _i), ("t_exp_up", _i), ("t_exp_down", _i),
        ("ld_router", _l), ("ld_exp_gate", _l), ("ld_exp_up", _l), ("ld_exp_down", _l),
        ("b_o", _p), ("sinks", _p), ("b_router", _p), ("b_exp_gate", _p), ("b_exp_up", _p), ("b_exp_down", _p),
    ]  # fmt: skip


class CShape(Struct):
    """``rs_shape``: the model's dimensions and the options every layer shares."""

    c_name = "rs_shape"
    _fields_ = [
        ("E", _i), ("H", _i), ("G", _i), ("D", _i), ("I", _i), ("eps", _f), ("scale", _f), ("act", _i),
        ("softcap", _f), ("tiles", _i), ("n_expert", _i), ("n_expert_used", _i), ("I_expert", _i), ("norm_topk", _i),
        ("softmax_topk", _i), ("qk_norm_all", _i),
    ]  # fmt: skip


class CKvLayer(Struct):
    """``rs_kv_layer``: one layer of a sequence's cache as the kernels read it."""

    c_name = "rs_kv_layer"
    _fields_ = [
        ("kbuf", _p), ("vbuf", _p), ("kv_sh", _l), ("kv_sn", _l), ("tiles", _p), ("tiles_sh", _l), ("tiled", _p),
        ("k0", _p), ("v0", _p), ("sh0", _l), ("split", _l), ("tiles0", _p), ("tiles0_sh", _l), ("tiled0", _p),
        ("own0", _l), ("pre0", _l),
    ]  # fmt: skip


class CSequence(Struct):
    """``rs_sequence``: one sequence's rows of a forward (positions, visibility, its cache's layers)."""

    c_name = "rs_sequence"
    _fields_ = [
        ("rows", _i), ("pos", _p), ("start", _l), ("past", _i), ("path", _p), ("path_off", _p), ("kv", _p),
    ]  # fmt: skip


class CScratch(Struct):
    """``rs_scratch``: a forward's work buffers."""

    c_name = "rs_scratch"
    _fields_ = [
        ("h", _p), ("qkv", _p), ("q", _p), ("att", _p), ("gu", _p), ("act", _p), ("xd", _p), ("xs", _p),
        ("work", _p), ("xq", _p),
        ("router", _p), ("moe_h", _p), ("moe_xd", _p), ("moe_xs", _p), ("moe_gu", _p), ("moe_act", _p), ("moe_y", _p),
        ("moe_out", _p), ("moe_w", _p), ("moe_xq", _p), ("moe_sel", _p), ("moe_rows", _p), ("moe_start", _p),
    ]  # fmt: skip


STRUCTS: tuple[type[Struct], ...] = (CLayer, CShape, CKvLayer, CSequence, CScratch)

# name -> (return type, ((parameter, type), ...)), as api.h declares them (pointers: addresses, or a struct's)
Signature = tuple[Any, tuple[tuple[str, Any], ...]]
FUNCTIONS: dict[str, Signature] = {
    "rs_isa": (ctypes.c_char_p, ()),
    "rs_format_sizes": (_i, (("wtype", _i), ("out", _p))),
    "rs_abi_layout": (_l, (("name", ctypes.c_char_p),)),
    "rs_pair_table": (_i, (("set", _p), ("got", _p))),
    "rs_forward": (None, (("layers", _p), ("n_layers", _i), ("shape", _p), ("x", _p), ("n_seqs", _i), ("seqs", _p),
                          ("kv_mode", _i), ("scratch", _p), ("threads", _i))),
    "rs_head": (None, (("x", _p), ("M", _i), ("keep", _i), ("E", _i), ("norm", _p), ("eps", _f), ("w", _p),
                       ("wtype", _i), ("ldw", _l), ("V", _i), ("softcap", _f), ("logits", _p), ("scratch", _p),
                       ("threads", _i))),
    "rs_qlinear": (None, (("x", _p), ("M", _i), ("K", _i), ("w", _p), ("wtype", _i), ("ldg", _l), ("N", _i),
                          ("bias", _p), ("res", _p), ("y", _p), ("xq", _p), ("xd", _p), ("xs", _p), ("threads", _i))),
    "rs_dequant_rows": (None, (("w", _p), ("wtype", _i), ("ldg", _l), ("K", _i), ("rows", _p), ("R", _i),
                               ("out", _p), ("threads", _i))),
    "rs_linear_f32": (None, (("x", _p), ("M", _i), ("K", _i), ("w", _p), ("N", _i), ("bias", _p), ("y", _p),
                             ("threads", _i))),
    "rs_attention": (None, (("q", _p), ("q_sh", _l), ("q_sn", _l), ("H", _i), ("n", _i), ("D", _i), ("k", _p),
                            ("v", _p), ("kv_sh", _l), ("kv_sn", _l), ("G", _i), ("past", _i), ("path", _p),
                            ("path_off", _p), ("scale", _f), ("out", _p), ("o_sn", _l), ("o_sh", _l), ("work", _p),
                            ("kvm", _i), ("threads", _i))),
    "rs_tile_keys": (_i, ()),
    "rs_tile_block_elems": (_l, (("D", _i),)),
    "rs_attention_tiles": (_i, ()),
    "rs_attention_bf16": (_i, ()),
    "rs_key_block": (_i, ()),
}


def declare(lib: ctypes.CDLL) -> None:
    """Give every entry point of ``lib`` its ctypes argument and return types."""
    for name, (restype, params) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes = [kind for _, kind in params]
        fn.restype = restype


def call(lib: ctypes.CDLL, name: str, **args: Any) -> Any:
    """``lib.<name>`` with its arguments by name: a TypeError for a name missing or unknown (no positional lists).
    A struct argument is passed by reference; an address as an int (None: NULL)."""
    _, params = FUNCTIONS[name]
    wanted = [p for p, _ in params]
    if set(args) != set(wanted):
        missing, extra = sorted(set(wanted) - set(args)), sorted(set(args) - set(wanted))
        raise TypeError(f"{name}: missing {missing}, unknown {extra}")
    values = [ctypes.byref(v) if isinstance(v, ctypes.Structure) else v for v in (args[p] for p in wanted)]
    return getattr(lib, name)(*values)


def check_layout(lib: ctypes.CDLL, structs: tuple[type[Struct], ...] = STRUCTS) -> None:
    """A RuntimeError unless every struct in ``structs`` has the library's size and every field its offset."""
    wrong = []
    for struct in structs:
        size = lib.rs_abi_layout(struct.c_name.encode())
        if size != ctypes.sizeof(struct):
            wrong.append(f"{struct.c_name}: {size} bytes in C, {ctypes.sizeof(struct)} in Python")
        for field in (entry[0] for entry in struct._fields_):
            at = lib.rs_abi_layout(f"{struct.c_name}.{field}".encode())
            if at != getattr(struct, field).offset:
                wrong.append(f"{struct.c_name}.{field}: offset {at} in C ({'unknown' if at < 0 else 'known'}), "
                             f"{getattr(struct, field).offset} in Python")
    if wrong:
        raise RuntimeError("the CPU kernels' structs differ from decoding/runtime/kernels/abi.py: " + "; ".join(wrong))
