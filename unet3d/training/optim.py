"""Optimizers and learning-rate schedules for 3D segmentation, the schedule driven by training progress."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

WARMUP = 0.02  # share of training spent warming AdamW up


def optimizer_kernels(device: torch.device, amp_dtype: torch.dtype | None) -> str:
    """Which optimizer implementation to use: "fused" CUDA kernels, "foreach", or torch's "default".

    Fused kernels never run under fp16 loss scaling: when a step overflows (common at the GradScaler's
    initial scale), the fused SGD kernel returns early but keeps the momentum buffers it has just
    allocated, uninitialised, and every later step uses them. The foreach kernels are exact there.
    """
    if device.type != "cuda":
        return "default"
    return "foreach" if amp_dtype == torch.float16 else "fused"


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str,
    lr: float,
    weight_decay: float,
    momentum: float = 0.99,
    kernels: str = "default",
) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum (nnU-Net: 0.99) or AdamW; `kernels` from `optimizer_kernels`."""
    if kernels not in ("fused", "foreach", "default"):
        raise ValueError(f"kernels must be fused, foreach or default, got {kernels!r}")
    extra = {} if kernels == "default" else {kernels: True}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True, weight_decay=weight_decay, **extra)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **extra)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")


def fit_state_to_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Give loaded optimizer state the placement and layout this run's kernels need, in place.

    `load_state_dict` places each step count by the *saved* groups' flags (on the parameter's device for a
    fused or capturable run, else on the CPU) and keeps the saved buffers' strides. A checkpoint written with
    other kernels (an fp16 run's foreach, a CPU run's default) resumed with the fused CUDA kernels would step
    with a CPU step count ("Expected all tensors to be on the same device"), and one written in another memory
    format with momentum buffers whose strides differ from the weights' (the fused kernels require equal
    strides). Here every step count goes where this run's groups want it, as float32 where they are fused or
    capturable, and every buffer shaped like its parameter takes the parameter's strides.
    """
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if not torch.is_tensor(value):
                    continue  # SGD without momentum keeps None
                if key == "step":
                    state[key] = value.to(param.device, torch.float32) if on_device else value.to("cpu")
                elif value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


class ProgressSchedule:
    """Learning rate as a function of training progress in [0, 1].

    `poly` (with SGD): lr * (1 - progress) ** 0.9, as nnU-Net. `cosine` (with AdamW): linear warmup over
    the first WARMUP of training, then cosine decay to zero. Driving the schedule by progress rather than
    a step count lets the same schedule follow epochs or a time budget.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        if kind not in ("poly", "cosine"):
            raise ValueError(f"unknown schedule {kind!r}; choose poly or cosine")
        self.optimizer = optimizer
        self.kind = kind
        self.progress = 0.0
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.set_progress(0.0)

    def factor(self, progress: float) -> float:
        p = min(max(progress, 0.0), 1.0)
        if self.kind == "poly":
            return (1 - p) ** 0.9
        if p < WARMUP:
            return (p + 1e-3) / (WARMUP + 1e-3)
        return 0.5 * (1 + math.cos(math.pi * (p - WARMUP) / (1 - WARMUP)))

    def set_progress(self, progress: float) -> None:
        self.progress = progress
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * self.factor(progress)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "progress": self.progress, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kind, self.base_lrs = state["kind"], list(state["base_lrs"])
        self.set_progress(state["progress"])


def build_schedule(optimizer: torch.optim.Optimizer, optimizer_name: str) -> ProgressSchedule:
    return ProgressSchedule(optimizer, "poly" if optimizer_name == "sgd" else "cosine")
