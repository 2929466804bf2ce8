"""Reading a prompt into a generation's KV cache, through the shared prefix cache.

One path for every prompt: a question's (``[system][document][question]``, or ``[system][best chunks]
[question]`` for a document longer than the window) and a document's prefix warmed at upload alike. The
prefix is cut into segments (``Prompt.segment_ends``); the longest cached run of leading segments is
loaded, the rest is run through the target in chunks of ``prefill_chunk`` tokens, and each new segment
goes into the prefix cache as soon as it is complete (so a cancelled prefill keeps its finished segments).
A segment another prompt is computing right now is waited for, not computed twice (several people asking about
a document nobody has asked about yet pay its prefill once).

Top-k (``prompt_topk``, RACER's cues) is a host tensor wherever it leaves this module or enters the prefix
cache: drafters read it on the CPU. It stays on the device during the prefill and comes over with one
transfer per cached segment and one at the end (``decoding.runtime.host.fetch``); cached entries' top-k is
brought to the host too if an entry holds it elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from decoding.cache.prefix import PrefixCache, PrefixEntry, segment_keys
from decoding.cache.slot import SlotCache
from decoding.runtime import host
from decoding.speculative.generation import PrefillEvent, Prompt

_R = TypeVar("_R")

Forward = Callable[..., torch.Tensor]  # (input_ids [1, n], cache, all_logits=bool) -> logits [n or 1, vocab]

CPU_PREFILL_CHUNK = 256
DEVICE_PREFILL_CHUNK = 4096
TOPK_CHUNK = 256  # the fewest rows per forward when every row's logits are kept (prompt_topk)
TOPK_LOGITS_BYTES = 512 << 20  # ... and more only while a chunk's [rows, vocab] logits stay under this


def default_prefill_chunk(device: torch.device | str) -> int:
    """Tokens per prefill forward when none is configured. On the CPU 256: it bounds the attention's memory
    and how long a cancel waits, and longer chunks gain little there. On an accelerator 4096: a forward
    fills the device's matrix units only with thousands of rows, so small chunks waste most of it; the
    attention kernels' memory grows linearly with the chunk, and a cancel still waits one chunk at most."""
    return CPU_PREFILL_CHUNK if torch.device(device).type == "cpu" else DEVICE_PREFILL_CHUNK


def topk_chunk(chunk: int, vocab: int) -> int:
    """Rows per forward when every row's logits are kept for the top-k: ``chunk``, cut to what keeps the
    ``[rows, vocab]`` logits (counted as float32) under ``TOPK_LOGITS_BYTES``, but never below
    ``TOPK_CHUNK`` (``vocab`` 0: unknown, ``TOPK_CHUNK``).

    A large GPU chunk would otherwise hold gigabytes of logits (4096 rows of a 152K vocabulary in float32
    are 2.5 GB). Running the model body once per chunk and its LM head in blocks of rows would avoid them
    altogether, but it would bypass what a model's causal-LM forward does after the head (some scale or
    soft-cap the logits) and the quantized CPU runtime has no such split; a chunk of a thousand or more
    rows already keeps a GPU's matrix units busy. On the CPU (chunk 256) nothing changes."""
    rows = TOPK_LOGITS_BYTES // (vocab * 4) if vocab > 0 else 0
    return min(chunk, max(TOPK_CHUNK, rows))


@dataclass
class PromptRead:
    """What reading a prompt did: rows whose KV came from the prefix cache, and the last logits (on the
    device) and the rows' top-k (on the host) (``last`` None: nothing ran, or it was cancelled)."""

    reused: int
    last: torch.Tensor | None
    topk: torch.Tensor | None


class PromptReader:
    """Runs prompts into ``SlotCache``s with a target forward, reusing and filling ``prefix_cache``.

    ``cache_model`` names the model and its runtime in every cache key: KV computed by another runtime is
    never reused. ``prompt_topk`` > 0 also records the target's top-k at every prompt row (RACER's cues),
    in chunks of at most ``topk_chunk(prefill_chunk, vocab)`` rows. ``share_block`` > 0 (a target that reads a
    prefix in place): a cached prefix's whole blocks of that many rows are shared, not copied. ``idle``: a context
    entered while a prompt waits for a segment another one is computing (a batcher's ``away``).
    """

    def __init__(
        self,
        forward: Forward,
        prefix_cache: PrefixCache | None,
        cache_model: str,
        device: torch.device,
        prefill_chunk: int = 256,
        prompt_topk: int = 0,
        vocab: int = 0,
        share_block: int = 0,
        idle: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.forward = forward
        self.share_block = share_block
        self.idle = idle  # entered while waiting for another prompt's segment (its caller's batch goes on)
        self._computing: dict[str, threading.Event] = {}  # segment key -> set once its prompt stops computing it
        self._computing_lock = threading.Lock()
        self.prefix_cache = prefix_cache
        self.cache_model = cache_model
        self.device = device
        self.prefill_chunk = prefill_chunk
        self.prompt_topk = prompt_topk
        self.vocab = vocab

    def prefill(self, ids: Sequence[int], cache: SlotCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` into ``cache`` (no prefix cache); return the last logits ``[vocab]`` and top-k ``[n, k]``
        if configured."""
        result = drain(self._fill(ids, [(0, len(ids), None)], cache, None, None))
        assert result is not None
        return result

    def read(
        self, ids: Sequence[int], ends: Sequence[int], prefix_key: str | None, cache: SlotCache,
        cancel: threading.Event | None,
    ) -> Generator[PrefillEvent, None, PromptRead]:
        """Read ``ids`` into ``cache``: load the longest cached run of the prefix segments ending at ``ends``,
        run the rest (each new segment goes into the prefix cache as it completes), yielding progress.

        Both a question's prompt and a document warmed ahead of its first question come this way.
        """
        claimed: dict[str, threading.Event] = {}
        waited: set[str] = set()
        try:
            keys, entries = self._cached_run(prefix_key, ids, ends)
            while (busy := self._claim(keys[len(entries) :], claimed, waited)) is not None and not _set(cancel):
                with self.idle():  # another prompt computes the first missing segment: wait for it (or a cancel)
                    while not busy.wait(0.05) and not _set(cancel):
                        pass
                keys, entries = self._cached_run(prefix_key, ids, ends)
            reused = ends[len(entries) - 1] if entries else 0
            cache.load_prefix(entries, self.share_block)
            yield PrefillEvent(done=reused, total=len(ids), reused=reused)
            pieces = _missing(ends, keys, len(entries))
            covered = ends[-1] if ends else 0
            if covered < len(ids):
                pieces.append((covered, len(ids), None))  # the rows after the last segment: never cached
            if not pieces:
                return PromptRead(reused, None, None)
            run = self._fill(ids, pieces, cache, cancel, prefix_key, claimed)
            try:
                while True:
                    yield PrefillEvent(done=next(run), total=len(ids), reused=reused)
            except StopIteration as end:
                result = end.value
        finally:
            self._release(claimed)
        if result is None:
            return PromptRead(reused, None, None)  # cancelled
        last, topk = result
        if topk is not None:  # the engine records top-k: every cached entry in the run has it
            topk = torch.cat([*host.fetch(*(e.topk for e in entries if e.topk is not None)), topk])
        return PromptRead(reused, last, topk)

    def warm(self, prompt: Prompt, new_cache: Callable[[int], SlotCache],
             cancel: threading.Event | None = None) -> bool:
        """Compute and cache the KV of ``prompt``'s prefix segments ahead of the first question (stops between
        chunks when ``cancel`` is set; finished segments stay cached). True if anything was computed."""
        if self.prefix_cache is None or not prompt.prefix_key or not prompt.prefix_ids:
            return False
        ids = list(prompt.prefix_ids)
        cache = new_cache(len(ids) + 1)
        with torch.inference_mode():
            done = drain(self.read(ids, segment_ends(prompt, len(ids)), prompt.prefix_key, cache, cancel))
        return done.reused < len(ids)

    def _claim(self, missing: Sequence[str | None], claimed: dict[str, threading.Event],
               waited: set[str]) -> threading.Event | None:
        """The event of the first ``missing`` segment if another prompt is computing it (and this one has not waited
        for it before: left uncached, it is computed here rather than waited for again); else None, with every
        missing segment nobody computes marked as this prompt's (in ``claimed``: prompts wanting them wait)."""
        with self._computing_lock:
            first = missing[0] if missing else None
            if first is not None and first in self._computing and first not in waited:
                waited.add(first)
                return self._computing[first]
            for key in missing:
                if key is not None and key not in self._computing:
                    claimed[key] = self._computing[key] = threading.Event()
            return None

    def _release(self, claimed: dict[str, threading.Event], key: str | None = None) -> None:
        """This prompt stops computing its ``claimed`` segment ``key`` (None: all of them; computed, cancelled or
        failed): prompts waiting for it go on."""
        with self._computing_lock:
            for k in [key] if key is not None else list(claimed):
                if k in claimed:
                    del self._computing[k]
                    claimed.pop(k).set()

    def _cached_run(
        self, prefix_key: str | None, ids: Sequence[int], ends: Sequence[int]
    ) -> tuple[list[str | None], list[PrefixEntry]]:
        """The cache keys of the segments ending at ``ends`` (None: not cacheable) and the entries of their
        longest cached leading run (cut where an entry lacks the top-k this engine records)."""
        if self.prefix_cache is None or not prefix_key or not ends:
            return [None] * len(ends), []
        keys = segment_keys(self.cache_model, prefix_key, ids, ends)
        entries = self.prefix_cache.match(keys, self.device)
        if self.prompt_topk:  # cached without the top-k this engine needs: recompute from there
            entries = entries[: next((i for i, e in enumerate(entries) if e.topk is None), len(entries))]
        return list(keys), entries


    def _fill(
        self,
        ids: Sequence[int],
        pieces: Sequence[tuple[int, int, str | None]],
        cache: SlotCache,
        cancel: threading.Event | None,
        tag: str | None,
        claimed: dict[str, threading.Event] | None = None,
    ) -> Generator[int, None, tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Run ``ids[start:end]`` of each piece into ``cache`` (which holds the rows before the first piece),
        in chunks of ``prefill_chunk``; a piece with a key goes into the prefix cache as soon as it is done (and
        is released from ``claimed`` then: prompts waiting for it need not wait for the rest).

        Yields the rows done after every chunk but the last; stops between chunks when ``cancel`` is set
        (returns None). Returns the last logits ``[vocab]`` and the run rows' top-k ``[n, k]`` (host) if
        configured.
        """
        k = self.prompt_topk
        chunk = topk_chunk(self.prefill_chunk, self.vocab) if k else self.prefill_chunk
        topks: list[torch.Tensor] = []  # host top-k of the rows run so far, in order
        pending: list[torch.Tensor] = []  # device top-k of the chunks run since the last transfer
        last: torch.Tensor | None = None
        for start, end, key in pieces:
            for i in range(start, end, chunk):
                if cancel is not None and cancel.is_set():
                    return None
                part = torch.tensor([list(ids[i : min(end, i + chunk)])], dtype=torch.long, device=self.device)
                logits = self.forward(part, cache, all_logits=bool(k))  # [c or 1, vocab]
                if k:
                    pending.append(torch.topk(logits, k, dim=-1).indices)
                last = logits[-1]
                if cache.length < pieces[-1][1]:
                    yield cache.length
            if key is not None and self.prefix_cache is not None:
                topk = None
                if k:  # the segment's top-k goes into the cache on the host
                    topks.extend(host.fetch(torch.cat(pending)) if pending else ())
                    pending = []
                    topk = torch.cat(topks)[start - pieces[0][0] :]
                self.prefix_cache.put(key, cache.snapshot(start, end, topk), tag=tag)
            if key is not None and claimed is not None:
                self._release(claimed, key)
        assert last is not None
        if pending:
            topks.extend(host.fetch(torch.cat(pending)))
        return last, (torch.cat(topks) if k else None)


def _set(event: threading.Event | None) -> bool:
    return event is not None and event.is_set()


def segment_ends(prompt: Prompt, upto: int) -> list[int]:
    """The prompt's cacheable segment ends that lie within its first ``upto`` tokens."""
    return [e for e in (prompt.segment_ends or [len(prompt.prefix_ids)]) if 0 < e <= upto]


def _missing(ends: Sequence[int], keys: Sequence[str | None], cached: int) -> list[tuple[int, int, str | None]]:
    """(start, end, key) of the segments after the first ``cached`` ones: what a prefill still has to run."""
    starts = [0, *ends]
    return [(starts[i], ends[i], keys[i]) for i in range(cached, len(ends))]


def drain(run: Generator[Any, None, _R]) -> _R:
    """Run a generator to its end and return its return value."""
    while True:
        try:
            next(run)
        except StopIteration as end:
            return end.value  # type: ignore[no-any-return]
