"""The test vocabularies of the GGUF tokenizer (``decoding.runtime.gguf.tokenizer``) and the texts they tokenize.

Each is a GGUF file holding only tokenizer metadata, one per tokenizer model / ``pre`` the served models need:
byte-level BPE with the bundled SmolLM2 vocabulary and merges (plus a few tokens and merges of our own that make the
pre-tokenizers' differences show: multi-digit tokens, ``'S``, ``(the``, a token no merge reaches) under ``pre``
``llama-bpe`` (Llama 3), ``qwen2``, ``smollm``, ``default`` and ``gpt-2``, and ``gpt-4o`` with harmony's message
markup as gpt-oss files have it (``harmony``, with a harmony chat template); and SentencePiece-style vocabularies built
here (a small BPE trained on our own corpus, with scores, ``<0xNN>`` byte tokens and control tokens) as Mistral (space
prefix), Gemma (no space prefix, user-defined whitespace tokens) and Phi-3 (special tokens that eat the whitespace
after them) files have them. Every text of ``TEXTS`` (prose, non-ASCII, digit runs, whitespace runs) plus each
vocabulary's special-token texts is tokenized with BOS as the file says and special tokens parsed (``ids``), and
without BOS with special tokens as plain text (``plain``). llama.cpp's ids for them are ``EXPECTED``
(``python -m bench.gguf_tokens --write-expected`` writes it).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXPECTED = Path(__file__).with_name("gguf_tokenizer_ids.json")
SPACE = "\u2581"

TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "He's here; they'LL see what I'D done (the end). HE'S OK",
    "Digits: 1234567 89, 3.14159 and 2024-06-01; \u0661\u0662\u0663 \u00b2\u00b3 \uff11\uff12",
    "caf\u00e9 na\u00efve fa\u00e7ade cre\u0300me (e + combining accent) \u00c6r\u00f8 "
    "\u0395\u03bb\u03bb\u03ac\u03b4\u03b1 \u041f\u0440\u0438\u0432\u0435\u0442",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u4e2d\u6587 \ud55c\uad6d\uc5b4 "
    "\U0001f680\U0001f389 \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7",
    "tabs\t\there\t and  two   three    spaces\n\n\nnewlines\r\n  indented\n",
    "   leading and trailing   ",
    "no\u00a0break and ideographic\u3000space",
    "def f(x):\n    return x**2  # square\n",
    "xylograph xylograph, the (the",
    "",
    " ",
    "\n",
)


@dataclass(frozen=True)
class Vocab:
    """One test vocabulary: its tokenizer model, metadata and the texts with its special tokens."""

    name: str
    model: str  # "gpt2" (the SmolLM2 vocabulary, extended) or "llama" (built here)
    arch: str
    specials: tuple[str, ...]  # texts exercising its special tokens
    pre: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # bos / eos / ... as token texts, add_* flags, name
    template: str | None = None
    extra: tuple[str, ...] = ()  # control tokens of its own, after the shared ones (byte-level BPE)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
         "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
         "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
         "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
           "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}\n\n{% endif %}"
           "{% endfor %}")

# Harmony (gpt-oss), in our own words: a system message naming the reasoning effort (the template's variable,
# medium where the caller gives none), the system text as the developer's instructions, earlier answers as final-channel
# messages, and "<|start|>assistant" for the model to go on with its channel header.
HARMONY = ("{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' -%}"
           "<|start|>system<|message|>You answer questions about documents.\nReasoning: {{ effort }}\n\n"
           "# Valid channels: analysis, commentary, final. Every message names its channel.<|end|>"
           "{%- if messages[0]['role'] == 'system' %}{% set turns = messages[1:] -%}"
           "<|start|>developer<|message|># Instructions\n\n{{ messages[0]['content'] }}<|end|>"
           "{%- else %}{% set turns = messages %}{% endif -%}"
           "{%- for m in turns %}{% if m['role'] == 'assistant' -%}"
           "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
           "{%- else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor -%}"
           "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_TOKENS = ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                  "<|constrain|>")  # <|endoftext|> is SmolLM2's own

_CHATML_TEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi <|im_end|>x<|endoftext|>"
# each family's kind of tokenizer (the test name -> a vocabulary)
FAMILY_VOCAB = {"llama": "llama-bpe", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2",
                "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3", "gpt-oss": "harmony", "mixtral": "mistral",
                "olmoe": "gpt-2"}
VOCABS = {v.name: v for v in (
    Vocab("llama-bpe", "gpt2", "llama", pre="llama-bpe", template=LLAMA3,
          meta={"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "eot": "<|eot_id|>"},
          specials=("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
                    _CHATML_TEXT, "<tool_call>{\"a\": 1}</tool_call> <|vision_start|>")),
    Vocab("qwen2", "gpt2", "qwen2", pre="qwen2", template=CHATML,
          meta={"bos": "<|endoftext|>", "eos": "<|im_end|>", "padding": "<|endoftext|>", "add_bos": False},
          specials=(_CHATML_TEXT, "<tool_call>{\"a\": 1}</tool_call> <|vision_start|>")),
    Vocab("smollm", "gpt2", "llama", pre="smollm", template="from the file",
          meta={"bos": "<|im_start|>", "eos": "<|im_end|>", "unknown": "<|endoftext|>", "padding": "<|im_end|>",
                "add_bos": False, "add_space_prefix": False},
          specials=(_CHATML_TEXT,)),
    Vocab("default", "gpt2", "llama", pre="default", meta={"bos": "<|endoftext|>", "eos": "<|endoftext|>"},
          specials=(_CHATML_TEXT,)),
    Vocab("gpt-2", "gpt2", "gpt2", pre="gpt-2", meta={"bos": "<|endoftext|>", "eos": "<|endoftext|>", "add_bos": True},
          specials=(_CHATML_TEXT,)),
    Vocab("mistral", "llama", "llama", template=MISTRAL, meta={"bos": "<s>", "eos": "</s>", "unknown": "<unk>"},
          specials=("<s>[INST] What is it? [/INST] It is.</s>", "a<unk>b [INST]x[/INST]y")),
    Vocab("gemma", "llama", "gemma3", template=GEMMA,
          meta={"bos": "<bos>", "eos": "<eos>", "unknown": "<unk>", "padding": "<pad>", "add_bos": True,
                "add_space_prefix": False},
          specials=("<bos><start_of_turn>user\nhi  there<end_of_turn>\n<start_of_turn>model\n",
                    "a  b   c    d\t\te<eos>")),
    Vocab("phi3", "llama", "phi3", meta={"bos": "<s>", "eos": "<|endoftext|>", "unknown": "<unk>",
                                         "padding": "<|endoftext|>", "add_bos": True, "add_eos": False,
                                         "name": "Phi-3 test vocabulary"},
          template=("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
          specials=("<|user|>\n  hi<|end|>\n<|assistant|>  \nok</s> x", "<s> a <|endoftext|> b <unk> c")),
    Vocab("harmony", "gpt2", "gpt-oss", pre="gpt-4o", template=HARMONY, extra=HARMONY_TOKENS,
          meta={"bos": "<|startoftext|>", "eos": "<|return|>", "padding": "<|endoftext|>", "add_bos": False},
          specials=("<|start|>system<|message|>Reasoning: low<|end|><|start|>developer<|message|># Instructions\n\n"
                    "Be brief.<|end|><|start|>user<|message|>When was it built?<|end|><|start|>assistant",
                    "<|channel|>analysis<|message|>The user asks when. The text says 1889.<|end|><|start|>assistant"
                    "<|channel|>final<|message|>It was built in 1889.<|return|>",
                    "<|start|>assistant to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>"
                    "{\"q\": \"x\"}<|call|><|endoftext|>",
                    "parseHTTPResponse XMLHttpRequest iPhone McDONALD'S \u00c9COLE \u00c9cole don't/won't//\n"
                    "src/app.py\r\n/usr\t  e\u0301t\u00e9 \u0394\u03b5\u03bb\u03c4\u03b1DELTA")),
)}

# Tokens (and merges) added to the SmolLM2 vocabulary, after its own: (text, token type, merge or None)
_CONTROL, _USER = 3, 4
_BPE_EXTRA = (
    *((t, _CONTROL, None) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|vision_start|>")),
    ("<tool_call>", _USER, None), ("</tool_call>", _USER, None),
    ("12", 1, "1 2"), ("123", 1, "12 3"), ("34", 1, "3 4"), ("56", 1, "5 6"), ("567", 1, "56 7"), ("89", 1, "8 9"),
    ("\u01201", 1, "\u0120 1"), ("\u012012", 1, "\u01201 2"), ("\u0120123", 1, "\u012012 3"),
    ("'S", 1, "' S"), ("'L", 1, "' L"), ("'LL", 1, "'L L"), ("(the", 1, "( the"),
    (".\u010a", 1, ". \u010a"), (":\u010a\u010a", 1, ": \u010a\u010a"),
    ("\u0120xylograph", 1, None),  # no merge reaches it: one token only where whole pieces are looked up
)

# The SentencePiece-style vocabularies: a BPE trained here on this corpus (our own sentences)
_CORPUS = (
    "the quick brown fox jumps over the lazy dog and the other dog",
    "hello world, hello there: the tokens of the text are here",
    "a model reads the document and answers the question it is asked",
    "what is it? it is what it is, and that is all there is",
    "numbers like 2024 and 1234567 are split into their digits",
    "caf\u00e9, na\u00efve, fa\u00e7ade and cr\u00e8me are french words",
    "\u6771\u4eac and \u65e5\u672c are written in kanji",
    "def return square leading trailing indented spaces newlines tabs",
)


def _spm_pieces(merges: int = 400) -> list[str]:
    """Merged pieces in order, then single characters: a SentencePiece BPE vocabulary of ``_CORPUS``."""
    words = collections.Counter(SPACE + w for line in _CORPUS for w in line.split(" "))
    split = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, n in words.items():
            s = split[w]
            for a, b in itertools.pairwise(s):
                pairs[a, b] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        pieces.append(best[0] + best[1])
        for w in words:
            s, out, i = split[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    chars = sorted({c for w in words for c in w} | set("0123456789.,:;!?'\"()-#*=+"), key=lambda c: (c != SPACE, c))
    return pieces + [c for c in chars if c not in pieces]


def _spm_vocab(v: Vocab) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a SentencePiece-style vocabulary as llama.cpp's converter writes them."""
    if v.name == "gemma":
        head = [("<pad>", _CONTROL), ("<eos>", _CONTROL), ("<bos>", _CONTROL), ("<unk>", 2)]
        extra = [("<start_of_turn>", _CONTROL), ("<end_of_turn>", _CONTROL), ("  ", _USER), ("   ", _USER),
                 ("    ", _USER), ("\t\t", _USER)]
    elif v.name == "phi3":  # as Phi-3's file has them: <unk> control, </s> user-defined
        head = [("<unk>", _CONTROL), ("<s>", _CONTROL), ("</s>", _USER)]
        extra = [(t, _CONTROL) for t in ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")]
    else:
        head = [("<unk>", 2), ("<s>", _CONTROL), ("</s>", _CONTROL)]
        extra = [("[INST]", _CONTROL), ("[/INST]", _CONTROL)]
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in extra]
    types = [k for _, k in head] + [6] * 256 + [k for _, k in extra]
    scores = [0.0] * len(head) + [0.0] * 256 + [-1000.0] * len(extra)
    normal = _spm_pieces() + (["\n", "\t"] if v.name == "gemma" else [])
    for i, piece in enumerate(normal):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    return tokens, scores, types


@functools.cache
def _bpe_vocab(extra: tuple[str, ...] = ()) -> tuple[list[str], list[int], list[str], str | None]:
    """The bundled SmolLM2 GGUF's tokens, types and merges with ``_BPE_EXTRA`` and then ``extra`` (control tokens)
    after them, and its chat template."""
    from decoding.runtime.bundled import bundled_gguf_path
    from decoding.runtime.gguf.tokenizer import read_vocab

    base = read_vocab(bundled_gguf_path())
    tokens, merges = list(base.tokens), list(base.merges)
    types = [3 if i in base.control else 4 if i in base.user_defined else 1 for i in range(len(tokens))]
    known = set(tokens)
    for text, kind, merge in (*_BPE_EXTRA, *((t, _CONTROL, None) for t in extra)):
        if merge is not None:
            left, right = merge.split(" ")
            assert left in known and right in known and left + right == text, merge
            merges.append(merge)
        assert text not in known, text
        tokens.append(text)
        types.append(kind)
        known.add(text)
    return tokens, types, merges, base.chat_template


def add_vocab(w: Any, name: str, chat_template: bool = True) -> None:
    """Write test vocabulary ``name``'s tokenizer metadata (and ``general.name``) into ``gguf.GGUFWriter`` ``w``;
    without its chat template where ``chat_template`` is false (a base model)."""
    v = VOCABS[name]
    w.add_name(str(v.meta.get("name", f"{name} test vocabulary")))
    template = v.template if chat_template else None
    if v.model == "gpt2":
        tokens, types, merges, own_template = _bpe_vocab(v.extra)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(str(v.pre))
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        template = own_template if template == "from the file" else template
    else:
        tokens, scores, types = _spm_vocab(v)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
    index = {t: i for i, t in enumerate(tokens)}
    for key in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        if key in v.meta:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", index[v.meta[key]])
    for key in ("add_bos", "add_eos"):
        if key in v.meta:
            w.add_bool(f"tokenizer.ggml.{key}_token", bool(v.meta[key]))
    if "add_space_prefix" in v.meta:
        w.add_bool("tokenizer.ggml.add_space_prefix", bool(v.meta["add_space_prefix"]))
    if template:
        w.add_chat_template(template)


def write_vocab(name: str, directory: Path) -> Path:
    """The GGUF file of test vocabulary ``name`` (tokenizer metadata only, no tensors) in ``directory``."""
    import gguf

    path = Path(directory) / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), VOCABS[name].arch)
    w.add_context_length(4096)
    add_vocab(w, name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocab_digest(path: Path) -> str:
    """A short hash of a vocabulary file's tokenizer metadata (what the ids depend on)."""
    from decoding.runtime.gguf.tokenizer import read_vocab

    v = read_vocab(path)
    blob = json.dumps([v.tokens, v.types, v.scores, v.merges, sorted(v.ids.items()), v.add_bos, v.add_eos,
                       v.add_space_prefix, v.pre, v.model, v.chat_template], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def texts_of(name: str) -> list[str]:
    return [*TEXTS, *VOCABS[name].specials]


def ours(path: Path, texts: list[str]) -> dict[str, Any]:
    """``gguf_tokenizer``'s ids of ``texts`` (as ``llama_cpp_ids`` gives them) and end-of-generation ids."""
    from decoding.runtime.gguf.tokenizer import end_of_turn_ids, tokenizer_from_gguf

    tok = tokenizer_from_gguf(path)
    return {
        "ids": [tok(t).input_ids for t in texts],
        "plain": [tok(t, add_special_tokens=False, split_special_tokens=True).input_ids for t in texts],
        "eog": sorted(end_of_turn_ids(path)),
    }
