"""One verify step's sampling state, in one frozen dataclass (vLLM v1's ``SamplingMetadata``).

The engine builds it afresh before every verify from the generation's state, and ``Engine.verify`` /
``Engine._judge`` read everything that decides the step's tokens from it: the request's sampling parameters, its
random source (a CPU generator, or the seeded noise coupled sampling draws from), the output so far (which
positions the noise and shapes each row's logits), and what the step reports beside its tokens (the target's
top-k after every row, log-probabilities).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoding.speculative.coupled import SeededNoise
from decoding.speculative.generation import SamplingParams
from decoding.speculative.shaping import LogitShaper


@dataclass(frozen=True)
class SamplingMetadata:
    """What one verify step samples with; the default is a plain greedy step that reports nothing extra.

    ``params``: the request's temperature / top-k / top-p / ... (greedy when its temperature is 0).
    ``generator``: the request's CPU generator for unseeded rejection sampling (None when greedy).
    ``noise``: a seeded request's noise; given, sampling is coupled (the answer does not depend on the drafts).
    ``output``: the tokens emitted before this step; its length is the position the noise is read at, and the
    shaper applies the request's penalties over it, each row's own tree path after it.
    ``topk``: how many of the target's most likely tokens to return after every verified row (None: none).
    ``shaper``: the request's logit shaping (None: none). ``logprobs``: how many top log-probabilities to report
    with each emitted token (None: off).
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    noise: SeededNoise | None = None
    output: Sequence[int] = ()
    topk: int | None = None
    shaper: LogitShaper | None = None
    logprobs: int | None = None

    @property
    def position(self) -> int:
        """The answer position of the step's first emitted token (what coupled sampling's noise is keyed on)."""
        return len(self.output)
