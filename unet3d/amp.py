"""Choosing the mixed-precision dtype, and the one autocast/GradScaler code path that uses it."""

from __future__ import annotations

import torch


def resolve_amp(mode: str, device: torch.device) -> torch.dtype | None:
    """`--amp` value -> autocast dtype, or None for full precision.

    auto: bf16 on GPUs that support it (Ampere on), fp16 on older GPUs, bf16 on CPUs with native bf16
    arithmetic (AVX512-BF16 or AMX), else full precision.
    """
    if mode == "off":
        return None
    if mode == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use fp16")
        return torch.bfloat16
    if mode == "fp16":
        return torch.float16
    if mode == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else None
    raise ValueError(f"--amp must be auto, bf16, fp16 or off, got {mode!r}")


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
