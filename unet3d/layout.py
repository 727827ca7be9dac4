"""Choosing the memory format of the model's 5-D tensors: channels-first (contiguous) or channels-last."""

from __future__ import annotations

import torch
from torch import nn

MEMORY_FORMATS = {"channels_last": torch.channels_last_3d, "contiguous": torch.contiguous_format}
CHOICES = ("auto", *MEMORY_FORMATS)  # --memory-format, in train_ddp.py and evaluate.py


def resolve_memory_format(mode: str, device: torch.device, amp_dtype: torch.dtype | None) -> torch.memory_format:
    """`--memory-format` value -> the format for the model's convolution weights.

    auto: channels_last_3d when the CPU computes in fp32, where oneDNN's channels-last convolutions were
    1.2-1.4x faster (training and inference) on an AVX2 CPU and level on an AVX512 one; contiguous
    elsewhere: under CPU bf16 autocast, channels-last with GroupNorm measured 30-50 % slower, and on GPUs
    it is unmeasured here. The activations follow the weights: a convolution whose weight is channels-last
    returns a channels-last output whatever its input's layout, on oneDNN and cuDNN alike.
    """
    if mode == "auto":
        return torch.channels_last_3d if device.type == "cpu" and amp_dtype is None else torch.contiguous_format
    if mode not in MEMORY_FORMATS:
        raise ValueError(f"--memory-format must be one of {CHOICES}, got {mode!r}")
    return MEMORY_FORMATS[mode]


def format_name(memory_format: torch.memory_format) -> str:
    """'channels_last' or 'contiguous', as the option spells it."""
    return "channels_last" if memory_format == torch.channels_last_3d else "contiguous"


def apply_memory_format(model: nn.Module, memory_format: torch.memory_format) -> nn.Module:
    """Lay out `model`'s convolution weights in `memory_format`, in place; returns `model`.

    1x1x1 convolutions (the U-Net's head) stay channels-first: with every spatial size 1 the two layouts
    hold the same bytes under different strides, the kernels' weight gradient takes either one depending
    on the thread count, and DDP then warns and copies because the gradient's strides differ from its
    bucket's. UNet3D feeds its head contiguous activations to match.
    """
    model.to(memory_format=memory_format)
    for module in model.modules():
        if isinstance(module, nn.Conv3d) and all(k == 1 for k in module.kernel_size):
            module.weight.data = module.weight.data.clone(memory_format=torch.contiguous_format)
    return model
