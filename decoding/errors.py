"""Domain errors of the decoding package. ``app`` maps them to HTTP codes; nothing here knows HTTP."""

from __future__ import annotations


class DecodingError(Exception):
    """Base class of every error raised by ``decoding``."""


class ModelLoadError(DecodingError):
    """A model or tokenizer could not be found, converted or loaded."""


class ModelFileError(ModelLoadError):
    """The model named is the problem, not how it is loaded: no such file, a file that is not a model or is corrupt,
    or an architecture the runtime does not run. The remedy is another model (``app`` names the setting to change)."""


class VocabularyMismatch(DecodingError):  # noqa: N818  (the name the service uses)
    """Target and drafter do not share one vocabulary, so drafted token ids would mean different things."""


class ContextTooLong(DecodingError, ValueError):  # noqa: N818
    """The prompt (plus room for new tokens) does not fit the model's context window: the one such error, raised by
    the engine and by the service's prompt fitting alike (``app`` answers it 400 ``context_too_long``)."""

    def __init__(self, message: str, *, tokens: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit

    @classmethod
    def of_prompt(cls, tokens: int, limit: int) -> ContextTooLong:
        return cls(f"prompt needs {tokens} tokens but the context window holds {limit}", tokens=tokens, limit=limit)
