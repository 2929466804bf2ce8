"""Which cached KV prefixes hold which documents, kept on disk so deleting a document after a restart
still drops every prefix (single- or multi-document) it is part of."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


class PrefixRegistry:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._docs: dict[str, list[str]] = {}  # prefix key -> document ids
        if path.exists():
            try:
                self._docs = {str(k): [str(d) for d in v] for k, v in json.loads(path.read_text()).items()}
            except (ValueError, AttributeError, TypeError):
                logger.warning("ignoring unreadable prefix registry %s", path)

    def add(self, key: str, doc_ids: Sequence[str]) -> None:
        with self._lock:
            if self._docs.get(key) == list(doc_ids):
                return
            self._docs[key] = list(doc_ids)
            self._save()

    def pop_document(self, doc_id: str) -> list[str]:
        """Forget and return every prefix key that includes ``doc_id``."""
        return self._pop(lambda ids: doc_id in ids)

    def prune(self, existing: Collection[str]) -> list[str]:
        """Forget and return every prefix key that includes a document not in ``existing`` (deleted by a
        process that died before dropping its KV, or a data dir restored without it)."""
        return self._pop(lambda ids: any(d not in existing for d in ids))

    def _pop(self, match: Callable[[list[str]], bool]) -> list[str]:
        with self._lock:
            keys = [k for k, ids in self._docs.items() if match(ids)]
            for k in keys:
                del self._docs[k]
            if keys:
                self._save()
            return keys

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._docs))
        os.replace(tmp, self.path)
