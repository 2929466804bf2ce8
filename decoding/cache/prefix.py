"""The shared prefix cache: the target's KV of prompt prefixes, kept across requests (and restarts).

``PrefixCache`` keeps entries in tiers, each an LRU bounded by bytes: the model's device, then (when that
device is not the CPU) host memory for what the device tier evicts, then optionally disk (safetensors)
under a quota of its own, so a restart does not pay the prefill again. A hit in a lower tier brings the
entry back to the device. An entry larger than a tier's budget skips that tier (one larger than every tier
is not even copied to the host). A prefix is cached as segments (a whole
``[system][document]``, or the system part and each retrieved chunk of a document too long for the window),
each keyed by its tokens chained to every key before it (``segment_keys``): the keys form a radix tree over
segments, and a prompt reuses the KV of its longest cached run of leading segments (``match``). Entries
are immutable: a generation copies them into its own ``SlotCache`` (``decoding.cache.slot``), so evicting one
never breaks a running generation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)


_HOST = torch.device("cpu")


@dataclass(frozen=True)
class PrefixEntry:
    """Target KV of one prompt segment: per layer ``[1, heads, n, head_dim]``; ``topk`` ``[n, k]`` optional.
    ``dropped`` (empty: none): per layer, the segment's leading rows it does not hold (a sliding-window layer
    keeps only the rows later tokens can read), so layer i's tensors are ``[1, heads, n - dropped[i], head_dim]``.

    Keys and values live on whichever device the tier holding the entry keeps; ``topk`` always lives on the
    host (its readers concatenate it with top-k computed on the host), which construction checks.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    topk: torch.Tensor | None
    dropped: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.topk is not None and self.topk.device.type != "cpu":
            raise ValueError(f"a prefix entry's top-k lives on the host, not on {self.topk.device}")
        if self.dropped and len(self.dropped) != len(self.keys):
            raise ValueError(f"{len(self.dropped)} dropped counts for {len(self.keys)} layers")
        if len({int(k.shape[2]) + self.dropped_rows(i) for i, k in enumerate(self.keys)}) > 1:
            raise ValueError("a prefix entry's layers hold rows of segments of different lengths")

    def dropped_rows(self, layer: int) -> int:
        """Leading rows of the segment layer ``layer`` does not hold."""
        return self.dropped[layer] if self.dropped else 0

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def to(self, device: torch.device) -> PrefixEntry:
        """This entry with its keys and values on ``device`` (itself if they are there already)."""
        if self.device == device:
            return self
        return PrefixEntry(tuple(k.to(device) for k in self.keys), tuple(v.to(device) for v in self.values),
                           self.topk, self.dropped)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) + self.dropped_rows(0)

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        if self.topk is not None:
            n += self.topk.numel() * self.topk.element_size()
        return n


def prefix_cache_key(model_name: str, prefix_key: str, prefix_ids: Sequence[int]) -> str:
    """Cache key binding the caller's key to the model and the exact prefix tokens."""
    return segment_keys(model_name, prefix_key, prefix_ids, [len(prefix_ids)])[0]


def segment_keys(model_name: str, prefix_key: str, ids: Sequence[int], ends: Sequence[int]) -> list[str]:
    """Cache keys of the segments ``ids[0:ends[0]]``, ``ids[ends[0]:ends[1]]``...: each binds the model, the
    caller's key, its own tokens and (chained) every token before it, so equal keys mean equal KV."""
    tokens = np.asarray(ids, dtype=np.int64)
    keys: list[str] = []
    start = 0
    for end in ends:
        h = hashlib.sha256()
        for part in (keys[-1] if keys else model_name, prefix_key):
            h.update(part.encode())
            h.update(b"\0")
        h.update(tokens[start:end].tobytes())
        keys.append(h.hexdigest()[:32])
        start = end
    return keys


class PrefixCache:
    """Tiered LRU of ``PrefixEntry``: ``byte_budget`` bytes on ``device``; when ``device`` is not the CPU, up to
    ``host_budget`` bytes in host memory of what the device tier evicts (on a CPU the device is the host: no
    second copy); optional persistence under ``persist_dir`` within ``disk_budget`` bytes.

    Thread-safe. ``tag`` groups entries (e.g. a document id) so ``drop(tag)`` removes all of them. Moves
    between the device and host tiers happen under the lock, so ``drop`` never misses an entry in transit.
    """

    def __init__(
        self,
        byte_budget: int,
        persist_dir: Path | None = None,
        disk_budget: int | None = None,
        host_budget: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.byte_budget = byte_budget
        self.device = torch.device(device) if device is not None else _HOST
        self.host_budget = host_budget if self.device.type != "cpu" else 0
        self.persist_dir = persist_dir
        self.disk_budget = disk_budget  # bytes of files under persist_dir (None: unbounded)
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()  # the device tier
        self._host: OrderedDict[str, PrefixEntry] = OrderedDict()  # the host tier (never both for one key)
        self._tags: dict[str, set[str]] = {}
        self._files: OrderedDict[str, int] = OrderedDict()  # persisted key -> bytes, least recently used first
        self._writers: set[threading.Thread] = set()  # disk writes under way
        self._save_lock = threading.Lock()  # one writer's host copy at a time: an entry can be 16 GiB
        self._lock = threading.Lock()
        self.hits = 0  # from any tier
        self.misses = 0
        self.host_hits = 0
        self.disk_hits = 0
        if persist_dir is not None:
            persist_dir.mkdir(parents=True, exist_ok=True)
            for leftover in persist_dir.glob("*.tmp*"):
                leftover.unlink(missing_ok=True)
            found = [(p.stat(), p.stem) for p in persist_dir.glob("*.safetensors")]
            for st, key in sorted(found, key=lambda f: f[0].st_mtime):  # file times carry recency over restarts
                self._files[key] = st.st_size
            with self._lock:
                self._trim_disk()

    @property
    def disk_bytes(self) -> int:
        with self._lock:
            return sum(self._files.values())

    @property
    def bytes_used(self) -> int:
        """Bytes of the device tier."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tier (0 when the device is the CPU)."""
        with self._lock:
            return sum(e.nbytes for e in self._host.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _path(self, key: str) -> Path:
        assert self.persist_dir is not None
        return self.persist_dir / f"{key}.safetensors"

    def get(self, key: str, device: torch.device | None = None) -> PrefixEntry | None:
        """The entry under ``key`` from the first tier holding it, its keys and values on ``device`` (default:
        the cache's); a host or disk hit moves it to the device tier when it fits there."""
        device = self.device if device is None else torch.device(device)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
            entry = self._host.get(key)
            if entry is not None:
                self.hits += 1
                self.host_hits += 1
                entry = entry.to(device)
                if entry.nbytes <= self.byte_budget:
                    del self._host[key]
                    self._keep_locked(key, entry)
                else:
                    self._host.move_to_end(key)
                return entry
        loaded = self._load(key)
        with self._lock:
            if loaded is None:
                self.misses += 1
                return None
            self.hits += 1
            self.disk_hits += 1
        entry = loaded.to(device)
        self._insert(key, entry if entry.nbytes <= self.byte_budget else loaded, tag=None)
        return entry

    def match(self, keys: Sequence[str], device: torch.device | None = None) -> list[PrefixEntry]:
        """The entries of the longest leading run of ``keys`` that is cached (device, host, then disk).

        The run is touched from its last entry back to its first, so a segment is always more recently used
        than the segments after it: LRU eviction takes a branch's tail before the prefix others share.
        """
        found: list[PrefixEntry] = []
        for key in keys:
            entry = self.get(key, device)
            if entry is None:
                break
            found.append(entry)
        with self._lock:
            for key in reversed(keys[: len(found)]):
                if key in self._entries:
                    self._entries.move_to_end(key)
        return found

    def put(self, key: str, entry: PrefixEntry, tag: str | None = None, persist: bool = True) -> None:
        """Cache ``entry`` (keys and values on the device) in the first memory tier it fits, and write it to
        disk in the background unless it is larger than the disk quota."""
        self._insert(key, entry, tag)
        if not persist or self.persist_dir is None:
            return
        if self.disk_budget is not None and entry.nbytes > self.disk_budget:
            logger.info("prefix %s (%d bytes) exceeds the disk quota (%d bytes); not persisted", key, entry.nbytes,
                        self.disk_budget)
            return
        writer = threading.Thread(target=self._save, args=(key, entry, tag), daemon=True)
        with self._lock:
            self._writers.add(writer)
        writer.start()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the disk writes started so far."""
        with self._lock:
            writers = list(self._writers)
        for writer in writers:
            writer.join(timeout)

    def _insert(self, key: str, entry: PrefixEntry, tag: str | None) -> bool:
        """Keep ``entry`` on the device if it fits the device budget, else a host copy if it fits the host
        budget; False when it fits neither (then it is not copied anywhere)."""
        with self._lock:
            if entry.nbytes <= self.byte_budget:
                self._host.pop(key, None)
                self._keep_locked(key, entry)
            elif not self._host_locked(key, entry):
                logger.info("prefix %s (%d bytes) exceeds the KV cache's memory budgets; not kept in memory",
                            key, entry.nbytes)
                return False
            if tag is not None:
                self._tags.setdefault(tag, set()).add(key)
            return True

    def _keep_locked(self, key: str, entry: PrefixEntry) -> None:
        """``entry`` into the device tier; the least recently used entries over its budget move to the host
        tier, or go (lock held)."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        used = sum(e.nbytes for e in self._entries.values())
        while used > self.byte_budget and len(self._entries) > 1:
            old_key, old = self._entries.popitem(last=False)
            used -= old.nbytes
            moved = self._host_locked(old_key, old)
            logger.debug("evicted prefix %s (%d bytes)%s", old_key, old.nbytes, " to host memory" if moved else "")

    def _host_locked(self, key: str, entry: PrefixEntry) -> bool:
        """A host copy of ``entry`` into the host tier, evicting its least recently used entries over budget;
        False (and no copy) when the tier is off or the entry larger than it (lock held)."""
        if not self.host_budget or entry.nbytes > self.host_budget:
            return False
        self._host[key] = _to_host(entry)
        self._host.move_to_end(key)
        used = sum(e.nbytes for e in self._host.values())
        while used > self.host_budget and len(self._host) > 1:
            old_key, old = self._host.popitem(last=False)
            used -= old.nbytes
            logger.debug("evicted prefix %s (%d bytes) from host memory", old_key, old.nbytes)
        return True

    def drop(self, tag: str) -> int:
        """Remove every entry recorded under ``tag`` (every tier); returns how many."""
        with self._lock:
            keys = self._tags.pop(tag, set())
            for key in keys:
                self._entries.pop(key, None)
                self._host.pop(key, None)
        if self.persist_dir is not None:
            for path in self.persist_dir.glob("*.safetensors"):
                if path.stem in keys or _file_metadata(path).get("tag", "") == tag:
                    path.unlink(missing_ok=True)
                    keys.add(path.stem)
            with self._lock:
                for key in keys:
                    self._files.pop(key, None)
        return len(keys)

    def _save(self, key: str, entry: PrefixEntry, tag: str | None) -> None:
        """Write ``entry`` to disk and record the file. One writer at a time holds its host copy (an entry at
        a 128K window can be 16 GiB): parallel writers would hold one each, and could exhaust host memory."""
        path = self._path(key)
        with self._save_lock:
            size = self._write(path, key, entry, tag)
        with self._lock:
            self._writers.discard(threading.current_thread())
            if size is not None and self.disk_budget is not None and size > self.disk_budget:
                logger.info("prefix %s (%d bytes on disk) exceeds the disk quota; not persisted", key, size)
                path.unlink(missing_ok=True)  # the file alone: trimming for it would empty the tier
                self._files.pop(key, None)
            elif size is not None:
                self._files[key] = size
                self._files.move_to_end(key)
                self._trim_disk()

    def _write(self, path: Path, key: str, entry: PrefixEntry, tag: str | None) -> int | None:
        """A host copy of ``entry`` written to ``path`` (via a temporary file); its size, None on failure."""
        host = _to_host(entry)
        tensors = {f"{kind}.{i}": t.detach().contiguous()
                   for kind, ts in (("k", host.keys), ("v", host.values)) for i, t in enumerate(ts)}
        if host.topk is not None:
            tensors["topk"] = host.topk.detach().contiguous()
        fd, tmp = tempfile.mkstemp(prefix=f"{key}.tmp", dir=str(self.persist_dir))
        os.close(fd)
        try:
            meta = {"tag": tag or "", "layers": str(len(entry.keys)), "dropped": ",".join(map(str, entry.dropped))}
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
            return path.stat().st_size
        except Exception:
            logger.exception("could not persist prefix %s", key)
            Path(tmp).unlink(missing_ok=True)
            return None

    def _trim_disk(self) -> None:
        """Remove the least recently used files while the disk tier is over its quota (lock held)."""
        if self.disk_budget is None or self.persist_dir is None:
            return
        used = sum(self._files.values())
        while used > self.disk_budget and self._files:
            key, size = self._files.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            used -= size
            logger.debug("removed persisted prefix %s (%d bytes) over the disk quota", key, size)

    def _load(self, key: str) -> PrefixEntry | None:
        """The persisted entry under ``key``, read into host memory (None: none, or unreadable)."""
        if self.persist_dir is None:
            return None
        path = self._path(key)
        if not path.exists():
            return None
        try:
            data = load_file(str(path), device="cpu")
            n = sum(1 for name in data if name.startswith("k."))
            keys = tuple(data[f"k.{i}"] for i in range(n))
            values = tuple(data[f"v.{i}"] for i in range(n))
            meta = _file_metadata(path)
            tag = meta.get("tag", "")
            dropped = tuple(int(d) for d in meta.get("dropped", "").split(",") if d)
            with self._lock:
                if tag:
                    self._tags.setdefault(tag, set()).add(key)
                if key in self._files:
                    self._files.move_to_end(key)
            os.utime(path)  # recency for the disk quota, across restarts too
            return PrefixEntry(keys=keys, values=values, topk=data.get("topk"), dropped=dropped)
        except Exception:
            logger.warning("discarding unreadable prefix cache file %s", path, exc_info=True)
            path.unlink(missing_ok=True)
            with self._lock:
                self._files.pop(key, None)
            return None


def _to_host(entry: PrefixEntry) -> PrefixEntry:
    """``entry`` with its keys and values in host memory: the host tier's copy and what the disk tier writes."""
    return entry.to(_HOST)


def _file_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:
        return {}
