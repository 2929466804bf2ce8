"""Prompt layout ``[system][document][question]`` through the model's chat template.

The system message holds the system text followed by the document; earlier (question, answer) turns and the
new question follow; the template's generation prompt ends it. Everything up to the end of the document is
``Prompt.prefix_ids``: it never depends on the question or the history, so its target KV cache is computed
once per document and reused. The RAG drafter's prompt is the same call with the retrieved chunks' text as
``document``.

How the split is found (robust to any template that copies message contents verbatim): the chat is
rendered with a unique sentinel in place of every caller-supplied text (document, past turns, question).
The rendered string is cut at the sentinels into template pieces and text pieces. Template pieces are
tokenized with special tokens recognised (``<|im_start|>`` ...); caller texts with special tokens treated
as plain text, so a document containing ``<|im_end|>`` cannot end its own message (nor, escaped, one containing
markup its tokenizer parses even in plain text: harmony's ``<|end|>``, ``<|start|>``, ``markup_texts``). Pieces are
tokenized separately without added special tokens and their ids concatenated (whitespace at the end of a template
piece joins the text after it, where a byte-level pre-tokenizer would split anyway); the document piece is
the last one of the prefix, so the prefix ends exactly where the document text ends.

A tokenizer without a chat template (a base model's GGUF) gets a plain layout instead, split the same way: the BOS
its tokenizer adds (if any), the system text, ``Context:`` and the document, earlier turns as ``Question:`` /
``Answer:`` pairs, then ``Question: ...`` and ``Answer:`` for the model to complete (``load_model`` logs once that
a model has no template). Its answer ends where the layout's next turn would start (``turn_stops``).
"""

from __future__ import annotations

import bisect
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from decoding.errors import DecodingError
from decoding.speculative.generation import Prompt


def _encode(tokenizer: Any, text: str, *, plain: bool, after_text: bool = False) -> list[int]:
    """Token ids of ``text``; ``plain`` treats special-token strings in it as ordinary text. ``after_text``: the
    piece continues text (not a special token, not the prompt's start), so a tokenizer that puts a space before
    a text (SentencePiece's prefix; ``continuation_marker``, ``decoding.runtime.gguf.tokenizer``) does not here."""
    if not text:
        return []
    markup = getattr(tokenizer, "markup_texts", ()) if plain else ()
    if any(m in text for m in markup):
        return _escaped(tokenizer, text, markup, after_text)
    marker = getattr(tokenizer, "continuation_marker", None) if after_text else None
    text = marker + text if marker else text
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=plain).input_ids)


def _escaped(tokenizer: Any, text: str, markup: Sequence[str], after_text: bool) -> list[int]:
    """Plain ``text`` holding markup its tokenizer parses even in plain text (harmony's ``<|end|>``, ``<|start|>``,
    ``<|channel|>``, ``<|message|>``: llama.cpp makes them user-defined tokens): each occurrence tokenized as two
    ordinary pieces (``<|`` and the rest), so a document, a question or an earlier answer cannot close its message
    or open another one; its text stays what it was."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(re.escape(m) for m in markup) + ")", text):
        for piece in (part[:2], part[2:]) if part in markup else (part,):
            ids += _encode(tokenizer, piece, plain=True, after_text=after_text or bool(ids))
    return ids


PLAIN_TURN = "\nQuestion:"  # a plain prompt's turn marker: the answer ends before a line starting a new question


def turn_stops(tokenizer: Any) -> tuple[str, ...]:
    """Stop strings the prompt layout itself implies: for the plain layout (no chat template), its next
    ``Question:`` line, since a base model goes on to ask and answer questions of its own, as a completion does in
    llama.cpp without a stop sequence; a chat template's turns end with its end-of-turn tokens instead (none)."""
    return (PLAIN_TURN,) if getattr(tokenizer, "chat_template", None) is None else ()


def render_chat(
    tokenizer: Any,
    *,
    system: str,
    document: str,
    question: str,
    history: Sequence[tuple[str, str]] = (),
    chat_options: Mapping[str, Any] | None = None,
) -> str:
    """The full prompt as the chat template renders it, or the plain layout where the tokenizer has no template
    (what ``build_prompt``'s ids decode to). ``chat_options``: variables the template may read (e.g. Qwen3's
    ``enable_thinking``); a template that reads none ignores them."""
    if getattr(tokenizer, "chat_template", None) is None:
        return _plain(tokenizer, system, document, question, history)
    return str(tokenizer.apply_chat_template(
        _messages(system, document, question, history), tokenize=False, add_generation_prompt=True,
        **dict(chat_options or {}),
    ))


def _plain(tokenizer: Any, system: str, document: str, question: str, history: Sequence[tuple[str, str]]) -> str:
    """A base model's prompt: the BOS its tokenizer adds (where it adds one; the text parses back to that token),
    the system text and a blank line, ``Context:`` with the document on the next line and a blank line, each
    earlier turn as ``Question: ...`` / ``Answer: ...`` lines and a blank line, then ``Question: <question>`` and
    ``Answer:`` for the model to complete."""
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = False
    if bos:
        ids = list(tokenizer("a").input_ids)
        adds_bos = ids[:1] == [tokenizer.bos_token_id] and _encode(tokenizer, "a", plain=False)[:1] != ids[:1]
    turns = "".join(f"Question: {asked}\nAnswer: {answered}\n\n" for asked, answered in history)
    head = f"{system}\n\n" if system else ""
    return f"{bos if adds_bos else ''}{head}Context:\n{document}\n\n{turns}Question: {question}\nAnswer:"


def _messages(
    system: str, document: str, question: str, history: Sequence[tuple[str, str]]
) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": f"{system}\n\n{document}" if system else document}]
    for asked, answered in history:
        messages.append({"role": "user", "content": asked})
        messages.append({"role": "assistant", "content": answered})
    messages.append({"role": "user", "content": question})
    return messages


def build_prompt(
    tokenizer: Any,
    *,
    system: str,
    document: str | Sequence[str],
    question: str,
    history: Sequence[tuple[str, str]] = (),
    prefix_key: str | None,
    chat_options: Mapping[str, Any] | None = None,
) -> Prompt:
    """Token ids of the chat, split into the cacheable ``[system][document]`` prefix and the rest.

    ``prefix_key`` names the prefix for the KV cache; it must change whenever the system text, the document
    or the tokenizer does (e.g. include the document id, a hash of ``system`` and the tokenizer fingerprint).
    ``document`` given as pieces (retrieved chunks, separators included) is their concatenation, each piece
    tokenized on its own: the prefix is then cut into segments (``Prompt.segment_ends``: everything before
    the document, then each piece) whose ids do not depend on the pieces after them, so their KV can be
    shared by every prompt that starts with the same pieces. ``chat_options``: as ``render_chat``'s.
    """
    pieces = None if isinstance(document, str) else list(document)
    tag = uuid.uuid4().hex
    texts: list[str] = [document if isinstance(document, str) else ""]
    for asked, answered in history:
        texts += [asked, answered]
    texts.append(question)
    slots = [f"\x00slot{tag}{i}\x00" for i in range(len(texts))]
    history_slots = [(slots[1 + 2 * i], slots[2 + 2 * i]) for i in range(len(history))]
    rendered = render_chat(tokenizer, system=system, document=slots[0], question=slots[-1],
                           history=history_slots, chat_options=chat_options)

    # Special tokens: a space prefix restarts after them (a tokenizer with one); some eat the whitespace after them
    added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    specials = set(added) if getattr(tokenizer, "continuation_marker", None) else set()
    eats_space = {i for i, t in added.items() if getattr(t, "rstrip", False)}
    prefix: list[int] = []
    suffix: list[int] = []
    rest = rendered
    for i, (slot, text) in enumerate(zip(slots, texts, strict=True)):
        head, found, rest = rest.partition(slot)
        if not found or slot in rest:
            raise DecodingError("the chat template does not copy message contents verbatim; cannot split it")
        out = prefix if i == 0 else suffix
        # Whitespace ending a template piece goes with the text that follows, so the boundary splits the
        # string where the tokenizer's own pre-tokenizer would (for "\n\nThe" as for "\nThe").
        template = head.rstrip()
        ids = _encode(tokenizer, template, plain=False, after_text=i > 0)
        out += ids
        after_text = ids[-1] not in specials if ids else i > 0  # the text follows template text, or the slot before
        space = head[len(template):]
        strip = bool(ids) and ids[-1] in eats_space  # the whitespace after it goes, as in a whole-string tokenization
        if i == 0 and pieces is not None:
            ends = [len(prefix)]
            for j, piece in enumerate(pieces):
                if j == 0:
                    piece = piece.lstrip() if strip else space + piece
                prefix += _encode(tokenizer, piece, plain=True, after_text=after_text or j > 0)
                ends.append(len(prefix))
            continue
        out += _encode(tokenizer, text.lstrip() if strip else space + text, plain=True, after_text=after_text)
    suffix += _encode(tokenizer, rest, plain=False, after_text=True)
    if pieces is None:
        return Prompt(prefix_ids=prefix, suffix_ids=suffix, prefix_key=prefix_key)
    segment_ends = sorted({e for e in ends if e > 0})
    return Prompt(prefix_ids=prefix, suffix_ids=suffix, prefix_key=prefix_key, segment_ends=segment_ends)


def context_rows(
    tokenizer: Any, prompt: Prompt, document: str, spans: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Rows of ``prompt`` (built over ``document``) that a drafter reading only ``spans`` of the document sees:
    everything before the document (template, system text), the tokens of each character span ``[start, end)``,
    and everything after the document (history, question). Sorted, merged ``[start, end)`` row ranges.

    The document is the last piece of ``prompt.prefix_ids``, so its tokens end there; their character offsets
    come from tokenizing the document alone (a template's leading whitespace may shift the first token by
    one, escaped markup a few: harmless for a drafter, whose drafts are verified anyway)."""
    enc = tokenizer(document, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    starts = [a for a, _ in enc["offset_mapping"]]
    ends = [b for _, b in enc["offset_mapping"]]
    doc_start = max(0, len(prompt.prefix_ids) - len(starts))
    ranges = [(0, doc_start)]
    for a, b in spans:  # the tokens overlapping [a, b) (a token may carry the space before a word)
        lo, hi = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        ranges.append((doc_start + lo, doc_start + hi))
    ranges.append((len(prompt.prefix_ids), len(prompt.prefix_ids) + len(prompt.suffix_ids)))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged
