"""The engine's log-probabilities -> the APIs' shape (each token's text and bytes, as OpenAI's)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from app.schemas import TokenLogprobOut, TopLogprob
from decoding.speculative.generation import TokenLogprob


class LogprobText:
    """The engine's ``TokenLogprob``s in the APIs' shape, with each token's text and bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self._bytes = lru_cache(maxsize=65536)(_token_bytes_of(tokenizer))

    def _top(self, token: int, logprob: float) -> TopLogprob:
        raw = self._bytes(token)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    def __call__(self, entries: Sequence[TokenLogprob]) -> list[TokenLogprobOut]:
        out = []
        for e in entries:
            head = self._top(e.token, e.logprob)
            out.append(TokenLogprobOut(**head.model_dump(), top_logprobs=[self._top(t, v) for t, v in e.top]))
        return out


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's scheme): printable Latin-1 bytes stand for themselves, every
    other byte for the character 256 + its rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_ALPHABET = _byte_level_alphabet()


def _token_bytes_of(tokenizer: Any) -> Any:
    """token id -> its bytes: a byte-level BPE piece mapped back through its alphabet, a SentencePiece byte
    token's byte, else the token decoded alone."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and "ByteLevel" in type(backend.decoder).__name__
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)

    def token_bytes(token: int) -> bytes:
        piece = to_piece(token) if to_piece is not None else None
        if isinstance(piece, str) and piece:
            if byte_level and all(c in _ALPHABET for c in piece):
                return bytes(_ALPHABET[c] for c in piece)
            match = _SP_BYTE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return str(tokenizer.decode([token])).encode("utf-8")

    return token_bytes
