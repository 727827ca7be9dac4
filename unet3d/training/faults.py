"""Fault injection for the tests, installed only when one of its variables is set.

UNET3D_FAULT_NAN="RANK:STEP,STEP;RANK:STEP" makes that rank's loss NaN at those global steps (counted
from 0 over the whole run: epoch * steps_per_epoch + step), so the non-finite guard is tested end to end
through the real training loop; UNET3D_FAULT_OOM (same form) raises torch.cuda.OutOfMemoryError there instead,
as a GPU that runs out of memory does. UNET3D_SLOW_DATA="RANK:SECONDS" makes that rank's every sample
take that much longer to load, UNET3D_SLOW_STEP="RANK:SECONDS" every training step (a slower GPU, a busy
host), so the diagnoses of `unet3d.training.timing` are tested end to end. UNET3D_SLOW_START="LOCAL_RANK:SECONDS"
holds that local rank back before it sets up the process group (a rank whose node is slower to start it),
so the order in which ranks fail at start-up is fixed. In a normal run the loss function and the dataset
are returned untouched, and no rank waits.
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

FAULT_NAN, FAULT_OOM = "UNET3D_FAULT_NAN", "UNET3D_FAULT_OOM"
SLOW_DATA, SLOW_STEP, SLOW_START = "UNET3D_SLOW_DATA", "UNET3D_SLOW_STEP", "UNET3D_SLOW_START"


def fault_steps(spec: str, rank: int) -> set[int]:
    """The global steps at which `rank` is to fail, from a "RANK:STEP,STEP;RANK:STEP" value."""
    steps: set[int] = set()
    for part in filter(None, spec.split(";")):
        who, _, when = part.partition(":")
        if int(who) == rank:
            steps.update(int(s) for s in when.split(",") if s)
    return steps


def delay(spec: str, rank: int) -> float:
    """The seconds of delay a "RANK:SECONDS;RANK:SECONDS" value gives `rank` (0 when it names it not)."""
    for part in filter(None, spec.split(";")):
        who, _, seconds = part.partition(":")
        if int(who) == rank:
            return float(seconds)
    return 0.0


class SlowDataset(Dataset):
    """`dataset`, each item `seconds` late."""

    def __init__(self, dataset: Dataset, seconds: float) -> None:
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        time.sleep(self.seconds)
        return self.dataset[key]


def slow_data(dataset: Dataset, rank: int) -> Dataset:
    """`dataset` itself, or a `SlowDataset` when UNET3D_SLOW_DATA names this rank."""
    seconds = delay(os.environ.get(SLOW_DATA, ""), rank)
    return SlowDataset(dataset, seconds) if seconds > 0 else dataset


class FaultyLoss(nn.Module):
    """`loss`, but NaN at the `nan` steps and out of memory at the `oom` steps, `slow` seconds late at every
    one; one call per training step, counted from `first_step` (a resumed run's position)."""

    def __init__(self, loss: nn.Module, nan: set[int], oom: set[int], first_step: int, slow: float = 0.0) -> None:
        super().__init__()
        self.loss = loss
        self.nan, self.oom = frozenset(nan), frozenset(oom)
        self.calls = first_step
        self.slow = slow

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        step, self.calls = self.calls, self.calls + 1
        time.sleep(self.slow)
        if step in self.oom:
            raise torch.cuda.OutOfMemoryError(f"injected by {FAULT_OOM} at step {step}: CUDA out of memory")
        value = self.loss(logits, target)
        return value * math.nan if step in self.nan else value


def inject_faults(loss: nn.Module, rank: int, first_step: int) -> nn.Module:
    """`loss` itself, or wrapped in `FaultyLoss` when a fault variable names this rank."""
    nan = fault_steps(os.environ.get(FAULT_NAN, ""), rank)
    oom = fault_steps(os.environ.get(FAULT_OOM, ""), rank)
    slow = delay(os.environ.get(SLOW_STEP, ""), rank)
    return FaultyLoss(loss, nan, oom, first_step, slow) if nan or oom or slow else loss


def slow_start() -> None:
    """Sleep as long as UNET3D_SLOW_START gives this process's LOCAL_RANK (not at all in a normal run)."""
    seconds = delay(os.environ.get(SLOW_START, ""), int(os.environ.get("LOCAL_RANK", "0")))
    if seconds > 0:
        time.sleep(seconds)
