"""Fault injection for the tests, installed only when one of its variables is set.

UNET3D_FAULT_NAN="RANK:STEP,STEP;RANK:STEP" makes that rank's loss NaN at those global steps (counted
from 0 over the whole run: epoch * steps_per_epoch + step), so the non-finite guard is tested end to end
through the real training loop; UNET3D_FAULT_OOM (same form) raises torch.OutOfMemoryError there instead,
as a GPU that runs out of memory does. In a normal run the loss function is returned untouched.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

FAULT_NAN, FAULT_OOM = "UNET3D_FAULT_NAN", "UNET3D_FAULT_OOM"


def fault_steps(spec: str, rank: int) -> set[int]:
    """The global steps at which `rank` is to fail, from a "RANK:STEP,STEP;RANK:STEP" value."""
    steps: set[int] = set()
    for part in filter(None, spec.split(";")):
        who, _, when = part.partition(":")
        if int(who) == rank:
            steps.update(int(s) for s in when.split(",") if s)
    return steps


class FaultyLoss(nn.Module):
    """`loss`, but NaN at the `nan` steps and out of memory at the `oom` steps; one call per training step,
    counted from `first_step` (a resumed run's position)."""

    def __init__(self, loss: nn.Module, nan: set[int], oom: set[int], first_step: int) -> None:
        super().__init__()
        self.loss = loss
        self.nan, self.oom = frozenset(nan), frozenset(oom)
        self.calls = first_step

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        step, self.calls = self.calls, self.calls + 1
        if step in self.oom:
            raise torch.OutOfMemoryError(f"injected by {FAULT_OOM} at step {step}: CUDA out of memory")
        value = self.loss(logits, target)
        return value * math.nan if step in self.nan else value


def inject_faults(loss: nn.Module, rank: int, first_step: int) -> nn.Module:
    """`loss` itself, or wrapped in `FaultyLoss` when a fault variable names this rank."""
    nan = fault_steps(os.environ.get(FAULT_NAN, ""), rank)
    oom = fault_steps(os.environ.get(FAULT_OOM, ""), rank)
    return FaultyLoss(loss, nan, oom, first_step) if nan or oom else loss
