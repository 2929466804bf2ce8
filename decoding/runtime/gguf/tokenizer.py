"""The tokenizer of a GGUF file, from its metadata alone, giving the token ids llama.cpp gives.

``tokenizer_from_gguf(path)`` builds a transformers ``PreTrainedTokenizerFast`` (a ``tokenizers`` pipeline) from
``tokenizer.ggml.*``: no tokenizer files, no download. ``end_of_turn_ids(path)`` names the tokens that end a
generation there. Both follow llama.cpp's ``src/llama-vocab.cpp`` (the version llama-cpp-python 0.3.36 vendors);
``tests/decoding/runtime/test_gguf_tokenizer.py`` checks the ids against llama.cpp's own.

Two tokenizer models (``tokenizer.ggml.model``):

- ``gpt2``, byte-level BPE (Llama 3, Qwen 2 / 2.5 / 3, SmolLM, gpt-oss, ...): the text is split by the regexes llama.cpp
  uses for the file's ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``; each regex splits the pieces of the one
  before, matches and the text between them alike), bytes are mapped to GPT-2's printable stand-ins, and the
  merges (``tokenizer.ggml.merges``, ranked in file order) apply within each piece; ``llama3``-style ``pre``
  values first take a piece whole when it is a token (``ignore_merges``). A ``pre`` this module does not know is
  refused (``ModelFileError``), never replaced by a near miss.
- ``llama``, SentencePiece-style (Mistral, Phi-3, Gemma 2 / 3, Llama 2): no pre-tokenization; spaces become
  ``▁``, a ``▁`` is put before the text and after every special token when ``tokenizer.ggml.add_space_prefix``
  (default true; Gemma's files say false), and adjacent pieces merge, the pair whose joined text is the token
  of highest score first (the leftmost of equal ones). That is a BPE whose merges are every split of every token
  into two tokens, ranked by the joined token's score; a character no token holds becomes its UTF-8 bytes'
  ``<0xNN>`` tokens.

Both: control, user-defined and unknown tokens (``tokenizer.ggml.token_type`` 3, 4, 2), and the tokens llama.cpp
takes for control tokens by their text (``<|eot_id|>``, ``<end_of_turn>``, ...), are matched in the raw text
before anything else; user-defined ones also where special tokens are not parsed (``split_special_tokens``), and
they are rendered when decoded: harmony's (gpt-oss's) ``<|channel|>``, ``<|message|>``, ``<|start|>``,
``<|constrain|>`` (and ``<|end|>`` beside ``<|return|>`` / ``<|call|>``) are user-defined whatever the file
says, as llama.cpp makes them. BOS / EOS
are added when ``add_bos_token`` / ``add_eos_token`` say so, with llama.cpp's defaults where the file is silent
(SentencePiece: BOS; ``llama3``-style BPE: BOS; other BPE: nothing). ``tokenizer.chat_template`` is the chat
template, rendered by transformers (jinja2).

Where transformers 4.57's own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) departs
from llama.cpp, and this module does not: it picks a converter by ``general.architecture`` and never reads
``tokenizer.ggml.pre``, so a Llama 3 file gets GPT-2's regex (digit runs whole, case-sensitive contractions,
other newline and punctuation splits), a SmolLM file no digit split, Qwen files an NFC normalizer llama.cpp does
not apply and only three hard-coded special tokens; ``add_bos_token`` / ``add_eos_token`` and the EOT / EOM ids
are not read (a Llama-architecture tokenizer adds BOS always, and takes the BOS token for EOS too); a
SentencePiece file without merges has them rebuilt by a search quadratic in the vocabulary (30 s for 32K tokens);
user-defined tokens are not matched first; Gemma files get a Unigram model (best total score, not llama.cpp's
merges), with byte token ``<0x09>`` renamed to a tab and user-defined whitespace tokens rewritten; Phi-3 files get
neither space handling nor byte fallback (spaces, newlines and unknown characters vanish).

Known limits: two merges of equal score that overlap resolve by rank here, by position in llama.cpp (real
vocabularies give distinct scores to mergeable tokens); a Phi-3 special token strips the Unicode whitespace after
it here, only ASCII whitespace in llama.cpp; a text (after a special token) that starts with U+FDD0, a Unicode
noncharacter, loses it (``CONTINUATION``).
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decoding.errors import ModelFileError

logger = logging.getLogger(__name__)

SPACE = "\u2581"  # SentencePiece's "▁"
# A text that starts with this noncharacter (Unicode keeps U+FDD0 for a program's internal use) is tokenized as the
# continuation of a text before it: without the space prefix. ``tokenizer.continuation_marker`` holds it on a
# tokenizer that prefixes (``decoding.speculative.prompt`` tokenizes a prompt piece by piece with it).
CONTINUATION = "\ufdd0"

# token types (tokenizer.ggml.token_type): llama.cpp's llama_token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes llama.cpp splits byte-level BPE text with (llm_tokenizer_bpe), per family of ``pre`` values.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k ("gpt-4o", gpt-oss's o200k_harmony): words split at case changes, as llama.cpp runs it. Its regex stands in
# for tokenizer.json's case classes ([\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] / [\p{Ll}\p{Lm}\p{Lo}\p{M}]) with "a letter
# that is not a-z" / "not A-Z", so a non-ASCII letter counts as either case and a combining mark as no letter.
_CASED_HEAD = r"(?:(?=\p{L})[^a-z])"  # a letter that is not ASCII lowercase
_CASED_TAIL = r"(?:(?=\p{L})[^A-Z])"  # a letter that is not ASCII uppercase
_SUFFIX = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED_HEAD}*{_CASED_TAIL}+{_SUFFIX}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_CASED_HEAD}+{_CASED_TAIL}*{_SUFFIX}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-tokenizes one family of ``tokenizer.ggml.pre`` values."""

    regexes: tuple[str, ...]  # applied in turn, each to the pieces of the one before
    ignore_merges: bool = False  # a piece that is a token is taken whole
    add_bos: bool = False  # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token


_FAMILIES: dict[PreTokenizer, tuple[str, ...]] = {
    PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True): (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
    PreTokenizer((_LLAMA3,)): ("dbrx", "smaug-bpe"),
    PreTokenizer((_QWEN2,)): ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"),
    PreTokenizer((_GPT4O,)): ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    PreTokenizer((r"\p{N}", _GPT2)): (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    PreTokenizer((_GPT2,)): (
        "gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "mpt", "olmo", "trillion", "granite-docling", "exaone4"),
    PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")): ("default",),
}
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for pre, names in _FAMILIES.items() for name in names}
MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values: byte-level BPE, SentencePiece-style

# Tokens llama.cpp treats as ending a generation (and as control tokens) by their text alone, whatever their type.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle tokens found by their text where the metadata names none: control tokens; pad / repo /
# file-separator ones also end a generation.
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", *_FIM_TEXTS)
# Harmony's message markup (gpt-oss): llama.cpp makes these user-defined whatever the file says (always parsed,
# always rendered), and "<|end|>" too where the vocabulary ends a generation with "<|return|>" / "<|call|>"
# instead (so "<|end|>", which closes a message there, ends no generation: ``end_of_turn_ids``).
_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_END_PAIRS = ({"<|return|>", "<|call|>"}, {"<|calls|>", "<|flush|>"})
# llama.cpp's special ids where the metadata names none (a default past the vocabulary is none)
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unknown": 0}, "gpt2": {"bos": 11, "eos": 11}}


@dataclass(frozen=True, eq=False)
class GGUFVocab:
    """A GGUF file's tokenizer metadata, with llama.cpp's defaults and special-token ids resolved."""

    path: str
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre (BPE only)
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    ids: dict[str, int]  # bos, eos, eot, eom, unknown, padding, fim_*: only the ones that exist
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    name: str  # general.name
    context_length: int | None
    control: frozenset[int] = field(default=frozenset())  # parsed as special tokens (control, unknown)
    user_defined: frozenset[int] = field(default=frozenset())  # always parsed first, not special

    def token(self, key: str) -> str | None:
        """The text of special token ``key`` (``"bos"``, ``"eos"``, ...), None where there is none."""
        i = self.ids.get(key)
        return None if i is None else self.tokens[i]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _metadata(path: Path) -> dict[str, Any]:
    """Every key / value of a little-endian GGUF file's metadata, read straight from its bytes: the tensors are not
    looked at, and string arrays are read in one pass (``gguf.GGUFReader`` makes a numpy view per element: seconds
    for a 128K-token vocabulary and its merges). A file this cannot read goes to ``read_gguf``, which names the
    problem."""
    import mmap

    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            raise ValueError("not a little-endian GGUF v2 / v3 file")
        (count,) = struct.unpack_from("<Q", m, 16)
        pos = 24
        out: dict[str, Any] = {}

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            if at + 8 + n > len(m):
                raise ValueError("a string runs past the end of the file")
            return m[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n

        def value(kind: int, at: int) -> tuple[Any, int]:
            if kind == _STRING:
                return string(at)
            if kind == _ARRAY:
                item, n = struct.unpack_from("<IQ", m, at)
                at += 12
                if item in _SCALARS:
                    dtype = np.dtype(_SCALARS[item].replace("?", "b1"))
                    if at + n * dtype.itemsize > len(m):
                        raise ValueError("an array runs past the end of the file")
                    return np.frombuffer(m, dtype, n, at).tolist(), at + n * dtype.itemsize
                items = []
                for _ in range(n):
                    x, at = value(item, at)
                    items.append(x)
                return items, at
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, m, at)[0], at + struct.calcsize(fmt)

        for _ in range(count):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            out[key], pos = value(kind, pos + 4)
        return out


def _reader_metadata(reader: Any) -> dict[str, Any]:
    """The metadata of a ``gguf.GGUFReader`` as plain values."""
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        types = [t.name for t in f.types]
        if not f.data:
            continue
        if types[0] == "ARRAY":
            out[key] = ([bytes(f.parts[i]).decode("utf-8") for i in f.data] if types[-1] == "STRING"
                        else [f.parts[i].tolist()[0] for i in f.data])
        elif types[0] == "STRING":
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8")
        else:
            out[key] = f.parts[f.data[0]].tolist()[0]
    return out


def read_vocab(source: str | Path | Any) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file (a path, or a ``gguf.GGUFReader``); a ``GGUFVocab`` is returned as is.

    Raises ``ModelFileError`` for a file without a vocabulary, or one of a tokenizer model or ``pre`` this module
    does not know (naming the ones it knows)."""
    if isinstance(source, GGUFVocab):
        return source
    if isinstance(source, str | Path):
        path = str(source)
        try:
            meta = _metadata(Path(source))
        except (OSError, ValueError, KeyError, IndexError, struct.error, RecursionError):
            from decoding.runtime.gguf.meta import read_gguf

            try:
                meta = _reader_metadata(read_gguf(Path(source)))  # names what is wrong with the file
            except UnicodeDecodeError as exc:
                raise ModelFileError(f"{path}: GGUF metadata that is not UTF-8 text ({exc})") from exc
    else:
        path = str(getattr(source, "path", "<GGUF>"))
        meta = _reader_metadata(source)
    t = "tokenizer.ggml."
    model = meta.get(t + "model")
    if model is None:
        raise ModelFileError(f"{path} has no tokenizer (no {t}model in its metadata)")
    if model not in MODELS:
        raise ModelFileError(f"{path}: GGUF tokenizer model {model!r} is not supported "
                             f"(supported: {', '.join(MODELS)})")
    pre = meta.get(t + "pre") if model == "gpt2" else None
    if model == "gpt2":
        if pre is None:
            logger.warning("%s names no pre-tokenizer (%spre): llama.cpp's 'default' is used", path, t)
            pre = "default"
        if pre not in PRE_TOKENIZERS:
            raise ModelFileError(f"{path}: GGUF pre-tokenizer {pre!r} ({t}pre) is not supported "
                                 f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = meta.get(t + "tokens")
    if not tokens:
        raise ModelFileError(f"{path} has no tokenizer vocabulary ({t}tokens)")
    tokens = [tok or f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]  # as llama.cpp names empty ones
    if len(set(tokens)) != len(tokens):
        raise ModelFileError(f"{path}: the GGUF vocabulary holds a token twice")
    n = len(tokens)
    types = meta.get(t + "token_type") or [NORMAL] * n
    scores = [float(s) for s in meta.get(t + "scores") or [0.0] * n]
    if len(types) < n or len(scores) < n:
        raise ModelFileError(f"{path}: the GGUF token types or scores are fewer than its {n} tokens")
    merges = meta.get(t + "merges") or []
    if model == "gpt2" and not merges:
        raise ModelFileError(f"{path}: a BPE vocabulary without merges ({t}merges)")

    ids: dict[str, int] = {k: v for k, v in _DEFAULT_IDS[model].items() if v < n}
    for key in _ID_KEYS:
        value = meta.get(f"{t}{key}_token_id")
        if value is not None and 0 <= int(value) < n:
            ids[key] = int(value)
        elif value is not None:
            logger.warning("%s: %s%s_token_id %s is past the vocabulary: ignored", path, t, key, value)
    index = {tok: i for i, tok in enumerate(tokens)}
    forced = {index[x] for x in _EOG_TEXTS if x in index}
    rendered = _rendered(index)
    forced -= rendered
    for key, texts in _FIM_TEXTS.items():
        if key not in ids:
            found = sorted(index[x] for x in texts if x in index)
            if found:
                ids[key] = found[0]
                forced.add(found[0])

    pre_tokenizer = PRE_TOKENIZERS.get(pre or "")
    add_bos = meta.get(t + "add_bos_token")
    add_eos = meta.get(t + "add_eos_token")
    add_prefix = meta.get(t + "add_space_prefix")
    arch = meta.get("general.architecture")
    context = meta.get(f"{arch}.context_length") if arch else None
    vocab = GGUFVocab(
        path=path,
        model=model,
        pre=pre,
        tokens=tokens,
        types=[int(x) for x in types[:n]],
        scores=scores[:n],
        merges=list(merges),
        ids=ids,
        add_bos=bool(add_bos) if add_bos is not None else (model == "llama" or bool(pre_tokenizer and
                                                                                    pre_tokenizer.add_bos)),
        add_eos=bool(add_eos) if add_eos is not None else False,
        add_space_prefix=model == "llama" and (bool(add_prefix) if add_prefix is not None else True),
        chat_template=meta.get("tokenizer.chat_template") or None,
        name=str(meta.get("general.name") or ""),
        context_length=int(context) if context else None,
        control=(frozenset(i for i, k in enumerate(types[:n]) if k in (CONTROL, UNKNOWN)) | frozenset(forced))
        - rendered,
        user_defined=(frozenset(i for i, k in enumerate(types[:n]) if k == USER_DEFINED) - frozenset(forced))
        | rendered,
    )
    for flag, key in ((vocab.add_bos, "bos"), (vocab.add_eos, "eos")):
        if flag and key not in ids:
            raise ModelFileError(f"{path}: the GGUF tokenizer adds a {key.upper()} token but names none")
    return vocab


def _rendered(index: dict[str, int]) -> frozenset[int]:
    """The tokens llama.cpp makes user-defined by their text: harmony's markup, and its "<|end|>" where the
    vocabulary has a pair of tokens that end a generation instead."""
    texts = [t for t in _RENDERED_TEXTS if t in index]
    if "<|end|>" in index and any(pair <= index.keys() for pair in _END_PAIRS):
        texts.append("<|end|>")
    return frozenset(index[t] for t in texts)


def end_of_turn_ids(source: str | Path | Any) -> tuple[int, ...]:
    """The ids that end a generation, as llama.cpp's ``llama_vocab_is_eog`` says: EOS, EOT and EOM (from the
    metadata, EOT / EOM else found by their text), every token whose text marks an end of turn (``<|im_end|>``,
    ``<end_of_turn>``, ``<|eot_id|>``, ``<|end|>``, ``<|endoftext|>``, ``</s>``, ...), and the fill-in-the-middle
    pad / repo / file-separator tokens. EOS first, then ascending. ``source``: a path, a ``gguf.GGUFReader`` or a
    ``GGUFVocab``."""
    v = read_vocab(source)
    eog = {i for i, tok in enumerate(v.tokens) if tok in _EOG_TEXTS}
    eog |= {v.ids[k] for k in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep") if k in v.ids}
    texts = {v.tokens[i]: i for i in eog}
    # llama.cpp's two exceptions: harmony-style "<|end|>" ends a message, not the generation; a "</s>" beside
    # "<|tool_response>" (Gemma 4) or "<|plamo:eos|>" is a normal token
    if "<|end|>" in texts and any(pair <= texts.keys() for pair in _END_PAIRS):
        eog.discard(texts["<|end|>"])
    if "</s>" in texts and texts.keys() & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(texts["</s>"])
    first = [v.ids["eos"]] if v.ids.get("eos") in eog else []
    return tuple(first + sorted(eog - set(first)))


def _spm_merges(v: GGUFVocab) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, highest-scoring token first (then by id, then split point): a BPE
    ranked so reproduces llama.cpp's SentencePiece merges."""
    index = {tok: i for i, tok in enumerate(v.tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for i, tok in enumerate(v.tokens):
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in index and right in index:
                found.append((-v.scores[i], i, k, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _bpe_merges(v: GGUFVocab) -> list[tuple[str, str]]:
    """The file's merges as llama.cpp reads them (split at the first space after the first character; a repeated
    pair keeps its first rank), leaving out the ones whose parts or result are not tokens."""
    index = set(v.tokens)
    seen: set[tuple[str, str]] = set()
    out: list[tuple[str, str]] = []
    dropped = 0
    for line in v.merges:
        cut = line.find(" ", 1)
        if cut < 0:
            dropped += 1
            continue
        pair = (line[:cut], line[cut + 1:])
        if pair in seen:
            continue
        if pair[0] not in index or pair[1] not in index or pair[0] + pair[1] not in index:
            dropped += 1
            continue
        seen.add(pair)
        out.append(pair)
    if dropped:
        logger.warning("%s: %d of its %d merges name no token; left out", v.path, dropped, len(v.merges))
    return out


def _template_processor(v: GGUFVocab) -> Any:
    """A post-processor adding BOS / EOS as the metadata says (built from its JSON form: a token text may hold a
    ':', which the constructor's string form cannot take)."""
    from tokenizers import processors

    def special(key: str) -> dict[str, Any]:
        return {"SpecialToken": {"id": v.tokens[v.ids[key]], "type_id": 0}}

    def seq(name: str) -> dict[str, Any]:
        return {"Sequence": {"id": name, "type_id": 0 if name == "A" else 1}}

    head = [special("bos")] if v.add_bos else []
    tail = [special("eos")] if v.add_eos else []
    keys = [k for k, on in (("bos", v.add_bos), ("eos", v.add_eos)) if on]
    state = {
        "type": "TemplateProcessing",
        "single": [*head, seq("A"), *tail],
        "pair": [*head, seq("A"), *tail, *head, seq("B"), *tail],
        "special_tokens": {v.tokens[v.ids[k]]: {"id": v.tokens[v.ids[k]], "ids": [v.ids[k]],
                                                "tokens": [v.tokens[v.ids[k]]]} for k in keys},
    }
    processor = processors.TemplateProcessing(single="$A")
    processor.__setstate__(json.dumps(state).encode())
    return processor


def _backend(v: GGUFVocab) -> Any:
    """The ``tokenizers.Tokenizer`` doing what llama.cpp does with this vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    try:
        if v.model == "gpt2":
            pre = PRE_TOKENIZERS[v.pre or "default"]
            backend = Tokenizer(BPE(vocab, _bpe_merges(v), ignore_merges=pre.ignore_merges))
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            backend.decoder = decoders.ByteLevel()
        else:
            unk = v.token("unknown")
            backend = Tokenizer(BPE(vocab, _spm_merges(v), unk_token=unk, byte_fallback=True))
            prefix = [normalizers.Prepend(SPACE), normalizers.Replace(Regex(rf"\A{SPACE}{CONTINUATION}"), "")]
            backend.normalizer = normalizers.Sequence(
                (prefix if v.add_space_prefix else []) + [normalizers.Replace(" ", SPACE)])
            backend.decoder = decoders.Sequence(
                [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if v.add_space_prefix else []))
    except Exception as exc:  # tokenizers raises its own Exception subclasses for a malformed vocabulary
        raise ModelFileError(f"{v.path}: cannot build its tokenizer: {exc}") from exc
    # Phi-3 (llama.cpp goes by general.name): special tokens but <unk>, <s>, <|endoftext|> eat the whitespace after them
    name = v.name.lower()
    phi3 = "phi-3" in name or "phi3" in name
    no_rstrip = {"<unk>", "<s>", "<|endoftext|>"}
    added = [AddedToken(v.tokens[i], special=i in v.control, normalized=False,
                        rstrip=phi3 and v.tokens[i] not in no_rstrip)
             for i in sorted(v.control | v.user_defined)]
    backend.add_tokens([a for a in added if not a.special])
    backend.add_special_tokens([a for a in added if a.special])
    if v.add_bos or v.add_eos:
        backend.post_processor = _template_processor(v)
    return backend


def tokenizer_from_gguf(source: str | Path | Any) -> Any:
    """A transformers ``PreTrainedTokenizerFast`` of a GGUF file's vocabulary (a path, ``gguf.GGUFReader`` or
    ``GGUFVocab``), tokenizing as llama.cpp does (see the module docstring): special tokens registered (so
    ``<|im_start|>`` is one id), BOS / EOS added as the metadata says, ``chat_template`` from
    ``tokenizer.chat_template`` (None where the file has none: a base model), ``model_max_length`` the context
    length; ``continuation_marker`` (``CONTINUATION``) where a space prefix is added; ``markup_texts`` where the
    vocabulary has markup llama.cpp parses even in plain text (harmony's). Raises ``ModelFileError`` for a
    vocabulary it cannot reproduce."""
    from transformers import PreTrainedTokenizerFast

    v = read_vocab(source)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(v),
        bos_token=v.token("bos"),
        eos_token=v.token("eos"),
        unk_token=v.token("unknown"),
        pad_token=v.token("padding"),
        chat_template=v.chat_template,
        model_max_length=v.context_length or int(1e30),
        clean_up_tokenization_spaces=False,
    )
    if v.add_space_prefix:
        tokenizer.continuation_marker = CONTINUATION
    rendered = _rendered({t: i for i, t in enumerate(v.tokens)})
    if rendered:  # harmony's markup, parsed wherever it is: caller texts escape it (decoding.speculative.prompt)
        tokenizer.markup_texts = tuple(v.tokens[i] for i in sorted(rendered))
    logger.debug("tokenizer of %s: %s%s, %d tokens, bos %s%s", v.path, v.model, f"/{v.pre}" if v.pre else "",
                 len(v.tokens), v.token("bos"), " added" if v.add_bos else "")
    return tokenizer
