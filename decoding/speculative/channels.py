"""Harmony's channels (gpt-oss's chat format): which of a generation's tokens are the answer.

A harmony model answers in messages, each a header and a content::

    <|channel|>analysis<|message|>reasoning...<|end|><|start|>assistant<|channel|>final<|message|>answer...<|return|>

The prompt ends with ``<|start|>assistant`` (the template's generation prompt), so a generation begins inside the
first message's header. The header names the message's channel (``<|channel|>final``, maybe a recipient ``to=...``
and a ``<|constrain|>`` type after it); ``<|message|>`` starts the content; ``<|end|>`` closes a message (another
may follow), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call) ends the generation. Only the
``final`` channel's content is the answer: the ``analysis`` channel is the model's reasoning, ``commentary`` its
tool calls and preambles. A message without a channel and without a recipient counts as the answer.

``harmony_of(tokenizer)`` says whether a tokenizer's chat template is harmony (its markup tokens, and a generation
prompt ending in ``<|start|>assistant``); ``ChannelParser`` sorts a generation's tokens, one at a time, into
``ANSWER``, ``REASONING`` and ``MARKUP`` (headers, markers, other channels). ``AnswerText``
(``decoding.speculative.detokenize``) uses it so that a harmony answer's text, stop strings and log-probabilities
are those of its final channel alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ANSWER, REASONING, MARKUP = "answer", "reasoning", "markup"
GENERATION_PROMPT = "<|start|>assistant"
_MARKUP_TEXTS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>")


@dataclass(frozen=True)
class Harmony:
    """The ids of harmony's markup tokens in one vocabulary."""

    start: int
    end: int  # closes a message; does not end the generation
    message: int
    channel: int
    stops: frozenset[int]  # <|return|>, <|call|>: they end the generation
    constrain: int | None = None


def harmony_of(tokenizer: Any, chat_options: Mapping[str, Any] | None = None) -> Harmony | None:
    """The harmony markup of ``tokenizer`` where its chat template is harmony, else None: the vocabulary holds
    ``<|start|>``, ``<|end|>``, ``<|message|>``, ``<|channel|>`` and ``<|return|>`` as tokens, and the template's
    generation prompt (the text ``add_generation_prompt`` adds, rendered with ``chat_options``) ends in
    ``<|start|>assistant``. A template that fails to render a plain question is no harmony one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    vocab = tokenizer.get_vocab()
    if any(t not in vocab for t in _MARKUP_TEXTS):
        return None
    messages = [{"role": "user", "content": "?"}]
    try:
        asked = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              **dict(chat_options or {}))
        bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             **dict(chat_options or {}))
    except Exception:  # jinja's errors, a template raising on purpose: not harmony
        return None
    if not (isinstance(asked, str) and isinstance(bare, str) and asked.startswith(bare)
            and asked[len(bare):].strip().endswith(GENERATION_PROMPT)):
        return None
    stops = frozenset(vocab[t] for t in ("<|return|>", "<|call|>") if t in vocab)
    return Harmony(start=vocab["<|start|>"], end=vocab["<|end|>"], message=vocab["<|message|>"],
                   channel=vocab["<|channel|>"], stops=stops, constrain=vocab.get("<|constrain|>"))


def channel_kind(name: str) -> str:
    """What the content of a message on channel ``name`` is: the answer (``final``), the reasoning (``analysis``)
    or neither (``commentary``, any other)."""
    return ANSWER if name == "final" else REASONING if name == "analysis" else MARKUP


class ChannelParser:
    """Sorts a harmony generation's tokens, fed one at a time, into ``ANSWER``, ``REASONING`` and ``MARKUP``.

    ``decode`` turns a header's token ids into text (the tokenizer's). The parser starts in the first message's
    header, where the prompt's ``<|start|>assistant`` left it."""

    def __init__(self, harmony: Harmony, decode: Callable[[Sequence[int]], str]) -> None:
        self.harmony = harmony
        self._decode = decode
        self._header: list[int] = []  # the current header's tokens (in a header: ``_content`` is None)
        self._content: str | None = None  # the current message's kind, while in its content

    def feed(self, token: int) -> str:
        """The kind of ``token``: its message's kind inside a content, ``MARKUP`` for headers and markers."""
        h = self.harmony
        if token == h.end or token == h.start or token in h.stops:  # a message ends (or a new one starts)
            self._content, self._header = None, []
            return MARKUP
        if self._content is not None:
            return self._content
        if token == h.message:
            self._content, self._header = self._kind(self._header), []
            return MARKUP
        self._header.append(token)
        return MARKUP

    def _kind(self, header: list[int]) -> str:
        """A message's kind from its header's tokens (role, recipient, ``<|channel|>`` name, ``<|constrain|>``)."""
        h = self.harmony
        if h.constrain is not None and h.constrain in header:
            header = header[:header.index(h.constrain)]
        if h.channel not in header:
            return ANSWER if "to=" not in self._decode(header) else MARKUP
        at = len(header) - 1 - header[::-1].index(h.channel)
        if "to=" in self._decode(header[:at]):  # addressed to a tool: never the answer
            return MARKUP
        name = self._decode(header[at + 1:]).split()
        return channel_kind(name[0] if name else "")
