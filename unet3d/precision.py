"""How the model computes: the mixed-precision dtype (--amp) and the memory format (--memory-format).

Both are chosen once per process from the device, and used alike by training and inference: one
autocast/GradScaler code path (disabled when the dtype is None), one layout for the weights.
"""

from __future__ import annotations

import torch
from torch import nn

AMP_CHOICES = ("auto", "bf16", "fp16", "off")  # --amp, in train_ddp.py and evaluate.py
MEMORY_FORMATS = {"channels_last": torch.channels_last_3d, "contiguous": torch.contiguous_format}
MEMORY_FORMAT_CHOICES = ("auto", *MEMORY_FORMATS)  # --memory-format, in train_ddp.py and evaluate.py

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs whose tensor cores compute in bf16


def gpu_has_native_bf16(device: torch.device) -> bool:
    """Whether this GPU has bf16 tensor cores (compute capability 8.0 on).

    Not torch.cuda.is_bf16_supported(): it also counts bf16 that the GPU only emulates (V100, T4), where
    bf16 autocast runs slower than fp32 and much slower than fp16.
    """
    return torch.cuda.get_device_capability(device) >= BF16_MIN_CAPABILITY


def resolve_amp(mode: str, device: torch.device) -> torch.dtype | None:
    """`--amp` value -> autocast dtype, or None for full precision.

    auto: bf16 on GPUs with bf16 tensor cores (compute capability 8.0 on: Ampere, Hopper, ...), fp16 with
    a GradScaler on older GPUs, bf16 on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX), else full
    precision. `bf16` on a GPU without bf16 tensor cores is refused.
    """
    if mode == "off":
        return None
    if mode == "bf16":
        if device.type == "cuda" and not gpu_has_native_bf16(device):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"--amp bf16: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no "
                "bf16 tensor cores, so bf16 would be emulated and slow; use --amp fp16 (or auto)"
            )
        return torch.bfloat16
    if mode == "fp16":
        return torch.float16
    if mode == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if gpu_has_native_bf16(device) else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else None
    raise ValueError(f"--amp must be one of {AMP_CHOICES}, got {mode!r}")


def autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to `dtype` on `device`, disabled when `dtype` is None."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for fp16 (bf16 has fp32's exponent range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively; elsewhere bf16 is emulated and slower than fp32."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


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
        raise ValueError(f"--memory-format must be one of {MEMORY_FORMAT_CHOICES}, got {mode!r}")
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
