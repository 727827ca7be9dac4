"""One training epoch: the step, the per-step agreement between ranks, the progress bar on rank 0."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from unet3d import dist
from unet3d.amp import autocast
from unet3d.control import StepControl
from unet3d.logs import get_logger
from unet3d.optim import ProgressSchedule

POSTFIX_EVERY = 5  # steps between progress-bar loss readings (each one waits for the GPU)
GRAD_CLIP = 12.0  # gradient-norm clipping, as nnU-Net


@dataclass
class EpochCarry:
    """The part of an epoch trained before a stop, carried into the resumed run (totals over all ranks)."""

    step: int = 0  # steps of the epoch already trained
    loss_sum: float = 0.0
    samples: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EpochStats:
    loss: float  # mean training loss over every rank's samples (skipped steps left out)
    samples: int  # samples trained on, all ranks
    seconds: float
    lr: float  # learning rate at the epoch's last step
    steps_done: int  # steps of this epoch trained so far, carried ones included
    skipped: int  # steps skipped for a non-finite loss or gradient
    overflowed: int  # steps the fp16 loss scale overflowed in (skipped, as the GradScaler does)
    stopped: str | None  # why training stopped inside this epoch, or None when it completed

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)

    def carry(self) -> EpochCarry:
        return EpochCarry(self.steps_done, self.loss * self.samples, self.samples, self.seconds)


def train_one_epoch(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: ProgressSchedule,
    scaler: torch.amp.GradScaler,
    amp_dtype: torch.dtype | None,
    device: torch.device,
    epoch: int,
    epochs: int,
    control: StepControl,
    carry: EpochCarry | None = None,
    fault_steps: frozenset[int] = frozenset(),
    show_progress: bool = True,
) -> EpochStats:
    """Train the epoch's remaining batches of (image (B, C, X, Y, Z), label (B, X, Y, Z)).

    Every rank must call this. `steps` is the whole epoch's length; `carry` the part already trained, in
    which case `loader` yields only the remaining batches. Before each step the learning rate follows
    training progress; after each backward pass the ranks agree (`StepControl.agree`) whether to skip the
    step (a non-finite loss or gradient anywhere) and whether to stop after it.
    """
    carry = carry or EpochCarry()
    model.train()
    log = get_logger()
    world = dist.get_world_size()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    seen, skipped, overflowed, stopped, step = 0, 0, 0, None, carry.step
    elapsed = control.elapsed()
    bar = tqdm(
        total=steps,
        initial=carry.step,
        desc=f"train {epoch + 1}/{epochs}",
        disable=not (show_progress and dist.is_main()),
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    for step, (image, label) in enumerate(loader, start=carry.step):
        schedule.set_progress(control.progress((epoch + step / steps) / epochs, elapsed))
        image = image.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, amp_dtype):
            loss = loss_fn(model(image), label)
        if epoch * steps + step in fault_steps:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        # Non-finite gradients under fp16 loss scaling mean the scale overflowed: a routine event (the scaler
        # lowers the scale and the step is skipped), not a fault. Anywhere else they are a fault, as is a NaN loss.
        grads_bad = ~torch.isfinite(grad_norm)
        local_bad = ~torch.isfinite(loss.detach()) | (grads_bad & (not scaler.is_enabled()))
        verdict = control.agree(local_bad, grads_bad & scaler.is_enabled())
        elapsed = verdict.elapsed
        if verdict.skip:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            log.warning(f"epoch {epoch + 1} step {step + 1}: skipped, a rank saw a non-finite loss or gradient")
        elif verdict.overflow:  # every rank skips it; the loss is left out of the epoch's mean as well
            overflowed += 1
            optimizer.zero_grad(set_to_none=True)
        else:
            scaler.step(optimizer)
            loss_sum += loss.detach().double() * len(image)
            seen += len(image)
        scaler.update()
        bar.update(1)
        if not bar.disable and (step % POSTFIX_EVERY == 0 or step == steps - 1):
            rate = seen * world / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}", samples_s=f"{rate:.1f}")
        if verdict.stop is not None:
            stopped = verdict.stop
            break
    bar.close()
    totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(seen, dtype=torch.float64, device=device)]))
    loss_total = totals[0].item() + carry.loss_sum
    samples = int(totals[1].item()) + carry.samples
    seconds = time.perf_counter() - start + carry.seconds
    done = step + 1 if stopped is not None else steps
    lr = schedule.get_last_lr()[0]
    return EpochStats(loss_total / max(samples, 1), samples, seconds, lr, done, skipped, overflowed, stopped)
