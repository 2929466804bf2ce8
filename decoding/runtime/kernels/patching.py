"""A transformers model on the fp32 kernels: its ``nn.Linear`` layers switched to ``KernelLinear`` and every module
flagged (``KERNEL_FLAG``) for the attention layers (``decoding.runtime.attention``); ``disable`` undoes it."""

from __future__ import annotations

import torch

from decoding.runtime.kernels.loading import load, loaded
from decoding.runtime.kernels.ops import MAX_ROWS, linear

KERNEL_FLAG = "_ragspec_cpu_kernels"  # set on every module of a switched model; the attention layers read it


class KernelLinear(torch.nn.Linear):
    """``nn.Linear`` whose small-batch fp32 CPU forward runs on the batch-invariant kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        lib = loaded()
        if (
            lib is not None
            and input.dtype == torch.float32
            and input.device.type == "cpu"
            and input.numel() <= MAX_ROWS * input.shape[-1]
            and not torch.is_grad_enabled()
        ):
            return linear(lib, input, self.weight, self.bias)
        return super().forward(input)


def use_cpu_kernels(model: torch.nn.Module) -> bool:
    """Switch an fp32 CPU model's ``nn.Linear`` layers to ``KernelLinear`` and let its attention layers use
    the attention kernel (``decoding.runtime.attention``, grouped SDPA models). True if switched."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype != torch.float32:
        return False
    if load() is None:
        return False
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.is_contiguous():
            if module.bias is not None and not module.bias.is_contiguous():
                continue
            module.__class__ = KernelLinear
    for module in model.modules():
        setattr(module, KERNEL_FLAG, True)
    return True


def kernels_active(model: torch.nn.Module) -> bool:
    return any(isinstance(m, KernelLinear) for m in model.modules())


def disable(model: torch.nn.Module) -> None:
    """Undo ``use_cpu_kernels`` (benchmarks compare both)."""
    for module in model.modules():
        if type(module) is KernelLinear:
            module.__class__ = torch.nn.Linear  # type: ignore[assignment]
        if hasattr(module, KERNEL_FLAG):
            delattr(module, KERNEL_FLAG)
