"""Checks of a rope scaling (``load_model(rope_scaling=...)``, the app's ``RAGSPEC_ROPE_SCALING``) that need no
model: the app runs them when it reads its settings, so a bad value stops the start at once rather than after
the models have loaded; ``decoding.runtime.models.apply_rope_scaling`` runs the same ones before writing the scaling
into a config (and transformers' own validation after)."""

from __future__ import annotations

from typing import Any

from decoding.errors import ModelLoadError

# Rope scalings with frequencies fixed at load: transformers and decoding.runtime.cpu_llama (rotary_tables) run
# them alike
ROPE_TYPES = ("linear", "yarn", "llama3")


def check_rope_scaling(rope_scaling: Any) -> tuple[str, float]:
    """(type, factor) of ``rope_scaling``, or ``ModelLoadError`` if no model could take it: not a dict, a type
    (``rope_type``, else the older ``type`` key) not in ``ROPE_TYPES``, a factor that is no number >= 1, or an
    ``original_max_position_embeddings`` given that is no positive integer (absent: the model's window)."""
    if not isinstance(rope_scaling, dict):
        raise ModelLoadError(f"rope_scaling must be a JSON object, not {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"rope_scaling type {rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
    factor = rope_scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise ModelLoadError(f"rope_scaling needs a numeric factor >= 1, not {factor!r}")
    if rope_scaling.get("original_max_position_embeddings"):  # 0 / null: the model's own window, as absent
        check_original_positions(rope_scaling["original_max_position_embeddings"])
    return str(rope_type), float(factor)


def check_original_positions(original: Any) -> int:
    """``original`` (the positions a scaling stretches) if it is a positive integer, else ``ModelLoadError``."""
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ModelLoadError(f"rope_scaling's original_max_position_embeddings must be a positive integer, "
                             f"not {original!r}")
    return original
