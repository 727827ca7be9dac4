"""Choosing the mixed-precision dtype, and the one autocast/GradScaler code path that uses it."""

from __future__ import annotations

import torch

CHOICES = ("auto", "bf16", "fp16", "off")  # --amp, in train_ddp.py and evaluate.py


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
    raise ValueError(f"--amp must be one of {CHOICES}, got {mode!r}")


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
