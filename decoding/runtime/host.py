"""Device-to-host transfers of the decoding loop, all through one function.

On an accelerator, every host read of a device tensor (``.item()``, ``.tolist()``, ``float(t)``, ``.cpu()``)
waits until the device has run everything queued before it. A decoding step that reads the verify
forward's results piecemeal (the argmax of each row, a probability per tried child, the drafters' top-k)
stalls on every read. The engine instead computes on the device what the host needs from a step and brings
it over with one ``fetch``; the prefill keeps its top-k on the device and fetches it once per cached
segment and once at the end. Every such transfer goes through ``fetch``, which makes their number
countable in tests.

Tensors already on the CPU come back as they are: on the CPU runtime nothing is copied or packed.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # byte offset of every packed piece: a multiple of the widest element size


def fetch(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host versions of ``tensors``, with at most one device-to-host copy.

    Several device tensors (of any dtypes and shapes, all on one device) are packed byte-wise into one
    device buffer, copied once, and viewed back as the original dtypes and shapes on the host.
    """
    moving = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    if not moving:
        return tensors
    devices = {tensors[i].device for i in moving}
    if len(devices) > 1:
        raise ValueError(f"fetch takes tensors of one device, got {sorted(map(str, devices))}")
    out = list(tensors)
    if len(moving) == 1:
        out[moving[0]] = tensors[moving[0]].to("cpu")
        return tuple(out)
    parts = [tensors[i] for i in moving]
    for i, t in zip(moving, unpack(pack(parts).to("cpu"), parts), strict=True):
        out[i] = t
    return tuple(out)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dim, as ``torch.argmax`` gives it (the first maximal index; a NaN counts as
    the maximum), int64. Plain fp32 CPU tensors go through numpy: one thread, no pool to wake (torch's reduction wakes
    its thread pool, which costs more than the work on a few vocabulary-sized rows and competes with the kernels'
    threads). Elsewhere it stays on the device, for ``fetch``."""
    if type(logits) is torch.Tensor and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer on the tensors' device holding each tensor's bytes, at aligned offsets."""
    spans, total = _spans(tensors)
    packed = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, (at, size) in zip(tensors, spans, strict=True):
        packed[at : at + size].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return packed


def unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors ``pack(like)`` holds, viewed out of ``packed`` (any device) as ``like``'s dtypes and shapes."""
    spans, _ = _spans(like)
    return [packed[at : at + size].view(t.dtype).reshape(t.shape) for t, (at, size) in zip(like, spans, strict=True)]


def _spans(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, byte size) of each tensor in the packed buffer, and the buffer's size."""
    spans, at = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        spans.append((at, size))
        at += -(-size // _ALIGN) * _ALIGN
    return spans, at
