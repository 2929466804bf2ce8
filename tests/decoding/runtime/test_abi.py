"""The boundary between Python and the C kernels is checked, not trusted: every struct's size and field offsets
against the library's own sizeof / offsetof (at load, and refused on a mismatch), every entry point's parameters
(names and types) against api.h, which the C definitions are compiled against, and every weight format's sizes
against formats.h's table (at load, and refused on a mismatch)."""

from __future__ import annotations

import ctypes
import dataclasses
import re
from pathlib import Path

import pytest

from decoding.runtime import kernels
from decoding.runtime.formats import FORMATS, WeightType, check_library
from decoding.runtime.kernels import abi
from decoding.runtime.kernels.building import FLAGS

KERNELS = Path(kernels.__file__).parent
C_TYPES = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float, "void": None}


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    found = kernels.load()
    if found is None:
        pytest.skip("CPU kernels unavailable on this machine")
    return found


def _ctype(decl: str) -> object:
    """The ctypes type a C parameter or return type crosses as: an address for any pointer, a C string for text."""
    decl = decl.replace("const ", "").strip()
    if decl.startswith("char *"):
        return ctypes.c_char_p
    if "*" in decl:
        return ctypes.c_void_p
    return C_TYPES[decl.split()[0]]


def api_h() -> dict[str, tuple[object, list[tuple[str, object]]]]:
    """api.h's prototypes: name -> (return type, [(parameter, type)])."""
    text = re.sub(r"/\*.*?\*/", "", (KERNELS / "api.h").read_text(), flags=re.S)
    out = {}
    for ret, name, params in re.findall(r"^([\w ]+?\s*\*?)\s*(rs_\w+)\(([^)]*)\);", text, flags=re.M):
        args = []
        for p in (q.strip() for q in params.split(",")):
            if p and p != "void":
                decl, arg = re.match(r"(.*?)(\w+)$", p).groups()  # type: ignore[union-attr]
                args.append((arg, _ctype(decl)))
        out[name] = (_ctype(ret), args)
    return out


def test_every_entry_point_is_declared_as_api_h_declares_it() -> None:
    header = api_h()
    assert "rs_forward" in header and len(header) >= 14  # the header is read
    assert set(abi.FUNCTIONS) == set(header)
    for name, (restype, params) in abi.FUNCTIONS.items():
        want_ret, want_params = header[name]
        assert restype == want_ret, name
        assert list(params) == want_params, name  # names, order and types


def test_every_defining_file_is_compiled_against_api_h() -> None:
    """The compiler holds each definition to api.h's prototype only where the file includes it."""
    for src in sorted(KERNELS.glob("*.c")):
        text = src.read_text()
        if re.search(r"^[a-z][\w ]*\*?\s*rs_\w+\([^;]*\)\s*\{", text, flags=re.M):
            assert '#include "api.h"' in text, src.name


def test_the_structs_match_the_library(lib: ctypes.CDLL) -> None:
    abi.check_layout(lib)  # raises on any difference
    for struct in abi.STRUCTS:
        assert lib.rs_abi_layout(struct.c_name.encode()) == ctypes.sizeof(struct) > 0


def test_a_struct_that_differs_is_refused_naming_the_field(lib: ctypes.CDLL) -> None:
    fields = list(abi.CShape._fields_)
    shifted = type("Shifted", (abi.Struct,), {"c_name": "rs_shape", "_fields_": [fields[0], ("extra", ctypes.c_int),
                                                                                   *fields[1:]]})
    size = ctypes.sizeof(abi.CShape)
    with pytest.raises(RuntimeError, match=rf"rs_shape: {size} bytes in C, {size + 4} in Python.*rs_shape\.H"):
        abi.check_layout(lib, (shifted,))
    narrowed = type("Narrowed", (abi.Struct,), {"c_name": "rs_sequence", "_fields_": [
        (name, ctypes.c_int if name == "start" else kind) for name, kind in abi.CSequence._fields_]})
    with pytest.raises(RuntimeError, match=r"rs_sequence\.past"):
        abi.check_layout(lib, (narrowed,))


def test_arguments_go_by_name(lib: ctypes.CDLL) -> None:
    assert abi.call(lib, "rs_tile_block_elems", D=64) == 2 * 64 * lib.rs_tile_keys()
    with pytest.raises(TypeError, match=r"missing \['D'\], unknown \['d'\]"):
        abi.call(lib, "rs_tile_block_elems", d=64)


def test_the_weight_formats_match_the_library(lib: ctypes.CDLL) -> None:
    check_library(lib)
    out = (ctypes.c_int * 3)()
    assert lib.rs_format_sizes(int(WeightType.Q4_K), out) == 0 and tuple(out) == (256, 144, 1184)
    assert lib.rs_format_sizes(int(WeightType.PARTS), out) == -1  # not a format


def test_a_format_table_that_differs_is_refused_naming_the_format(lib: ctypes.CDLL) -> None:
    wrong = {**FORMATS, WeightType.Q6_K: dataclasses.replace(FORMATS[WeightType.Q6_K], record_bytes=1672)}
    with pytest.raises(RuntimeError, match=r"Q6_K: \(weights, bytes, record bytes\) \(256, 210, 1680\) in C"):
        check_library(lib, wrong)
    fewer = {k: f for k, f in FORMATS.items() if k != WeightType.IQ4_NL}
    with pytest.raises(RuntimeError, match="format id 8: known to the library only"):
        check_library(lib, fewer)


def test_a_library_that_differs_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time checks run on every library opened: a mismatch leaves the kernels unavailable with the reason
    (the quantized runtime then refuses to start, naming it)."""
    from decoding.runtime.kernels import loading

    def refuse(lib: ctypes.CDLL) -> None:
        raise RuntimeError("the CPU kernels' weight formats differ from decoding.runtime.formats: Q6_K: ...")

    monkeypatch.setattr(loading, "check_library", refuse)
    monkeypatch.setattr(loading, "_lib", None)
    monkeypatch.setattr(loading, "_tried", False)
    monkeypatch.setattr(loading, "_why_not", "")
    assert loading.load() is None
    assert "weight formats differ" in loading.unavailable_reason()


def test_the_dispatch_names_every_format_and_nothing_guesses_one() -> None:
    """matmul.c's dispatch (a product, a row's dequantization) is a switch over rs_wtype naming every format with no
    default: -Werror=switch makes a format missing from it a compile error. Every other switch over rs_wtype names
    its file's formats and stops on any other (rs_unknown_format), never computing one with another's layout."""
    assert "-Werror=switch" in FLAGS
    matmul = (KERNELS / "matmul.c").read_text()
    dispatch = re.findall(r"switch \(\(rs_wtype\)wtype\) \{(.*?)\n    \}", matmul, flags=re.S)
    assert len(dispatch) == 2
    for body in dispatch:
        assert "default:" not in body
        assert all(f"W_{f.name}:" in body for f in FORMATS.values())
    for src in sorted(KERNELS.glob("*.[ch]")):
        text = src.read_text()
        for switch in re.finditer(r"switch \(\(rs_wtype\)\w+\) \{(.*?)\n( *)\}(.{0,80})", text, flags=re.S):
            body, after = switch.group(1), switch.group(3)
            default = next((line for line in body.splitlines() if "default:" in line), None)
            assert default is None or "rs_unknown_format" in default or "rs_unknown_format" in after, src.name
    assert all(f"X({f.name}, {int(k)}," in (KERNELS / "formats.h").read_text() for k, f in FORMATS.items())
