"""Incremental detokenization and stop strings for streaming.

Byte-level BPE tokens can split a multi-byte character, and many tokenizers fold a leading space into
the token, so decoding tokens one by one loses spaces or emits broken characters. We decode a small
window of recent tokens twice (with and without the new ones) and emit only the difference, holding
text back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, TypeVar

from decoding.speculative.channels import ANSWER, REASONING, ChannelParser, Harmony

REPLACEMENT = "\ufffd"
T = TypeVar("T")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that concatenate to ``decode(all_ids)``."""

    def __init__(self, tokenizer: Any, context: int = 6) -> None:
        self.tokenizer = tokenizer
        # a fast (``tokenizers``) tokenizer's own decoder: what its ``decode`` calls when asked not to clean up
        # spaces, without the wrapper's per-call conversions (most of the time of a few-token decode)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if callable(getattr(backend, "decode", None)) else None
        self.context = context
        self.ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are already emitted and never re-decoded
        self._read = 0  # tokens up to here are emitted

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens left out), as the fast tokenizer's decoder gives it."""
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=True))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(int(i) for i in ids)
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if after.endswith(REPLACEMENT):  # incomplete multi-byte character: wait for more tokens
            return ""
        if not after.startswith(before):  # a merge rewrote the window (rare): resynchronise
            return self._resync()
        delta = after[len(before) :]
        self._read = len(self.ids)
        self._prefix = max(self._prefix, self._read - self.context)
        return delta

    def _resync(self) -> str:
        # Extremely rare with byte-level BPE; emit what the full decode adds beyond what was emitted.
        full = self.decode(self.ids)
        emitted = self.decode(self.ids[: self._read])
        self._read = len(self.ids)
        self._prefix = max(0, self._read - self.context)
        return full[len(emitted) :] if full.startswith(emitted) else ""

    def flush(self) -> str:
        """Text still held back at the end (e.g. a dangling partial character)."""
        if self._read == len(self.ids):
            return ""
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        self._read = len(self.ids)
        return after[len(before) :] if after.startswith(before) else ""


class StopMatcher:
    """Streams text while holding back any tail that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # everything seen
        self.emitted = 0  # chars of ``text`` already released
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return what may be released now. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        search_from = max(0, self.emitted - max(len(s) for s in self.stops))
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out = self.text[self.emitted : cut]
            self.text = self.text[:cut]
            self.emitted = cut
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = len(self.text) - hold
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def finish(self) -> str:
        """Release the held-back tail at the end of generation."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class AnswerText:
    """One generation's output: token ids up to EOS, the token limit or a stop string, and its text.

    ``add`` takes a step's new tokens and returns the text that may be released now; ``finish`` is set
    ("stop" or "length") once nothing more may be added; ``close`` releases what is still held back.

    With ``channels`` (a harmony model: ``decoding.speculative.channels``) the text, its stop strings and
    ``answer_part`` are those of the final channel's tokens alone; the analysis channel's text collects in
    ``reasoning`` (``take_reasoning`` releases what is new); ``<|return|>`` and ``<|call|>`` end the generation, and
    ``<|end|>``, which only closes a message there, ends nothing. ``ids`` are every generated token either way (what
    the cache, the drafters and the token counts see).
    """

    def __init__(self, tokenizer: Any, eos: set[int], max_new: int, stops: Sequence[str],
                 channels: Harmony | None = None) -> None:
        self.ids: list[int] = []
        self.finish = ""
        self._eos, self._max_new = eos, max_new
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(stops)
        self._parser: ChannelParser | None = None
        self.reasoning: str | None = None  # harmony: the analysis channel's text so far
        if channels is not None:
            self._eos = (eos - {channels.end}) | channels.stops
            self._parser = ChannelParser(channels, self._detok.decode)
            self._thoughts = IncrementalDetokenizer(tokenizer)
            self.reasoning, self._reasoning_sent = "", 0
            self._answer_at: list[int] = []  # positions in ``ids`` of the final channel's tokens

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def text(self) -> str:
        return self._stops.text

    def add(self, tokens: Sequence[int]) -> str:
        kept: list[int] = []
        for tok in tokens:
            if tok in self._eos:
                self.finish = "stop"
                break
            kept.append(tok)
            if len(self.ids) + len(kept) >= self._max_new:
                self.finish = "length"
                break
        answer = self._route(kept)
        text = self._stops.feed(self._detok.push(answer)) if answer else ""
        if self._stops.stopped:
            self.finish = "stop"
        return text

    def _route(self, kept: list[int]) -> list[int]:
        """Add ``kept`` to ``ids``; return the answer's tokens among them (all of them without channels), the
        reasoning's decoded into ``reasoning``."""
        first = len(self.ids)
        self.ids.extend(kept)
        if self._parser is None:
            return kept
        answer, thought = [], []
        for at, tok in enumerate(kept, first):
            kind = self._parser.feed(tok)
            if kind == ANSWER:
                answer.append(tok)
                self._answer_at.append(at)
            elif kind == REASONING:
                thought.append(tok)
        if thought:
            self.reasoning = (self.reasoning or "") + self._thoughts.push(thought)
        return answer

    def answer_part(self, items: Sequence[T], lo: int = 0, hi: int | None = None) -> list[T]:
        """The entries of ``items`` (one per token of ``ids``, e.g. log-probabilities) at the answer's tokens
        among positions ``lo`` to ``hi``: all of them without channels, the final channel's with them."""
        hi = len(self.ids) if hi is None else hi
        if self._parser is None:
            return list(items[lo:hi])
        at = self._answer_at
        return [items[i] for i in at[bisect.bisect_left(at, lo):bisect.bisect_left(at, hi)] if i < len(items)]

    def take_reasoning(self) -> str:
        """The reasoning text not taken before ("" without channels)."""
        if self.reasoning is None:
            return ""
        out = self.reasoning[self._reasoning_sent:]
        self._reasoning_sent = len(self.reasoning)
        return out

    def close(self) -> str:
        """The held-back text (a dangling partial character, a partial stop string), at the end."""
        if self._parser is not None:
            self.reasoning = (self.reasoning or "") + self._thoughts.flush()
        if self._stops.stopped:
            return ""
        tail = self._stops.feed(self._detok.flush())
        tail += "" if self._stops.stopped else self._stops.finish()
        if self._stops.stopped:
            self.finish = "stop"
        return tail
