"""One training epoch: the step, the progress bar on rank 0, and the epoch's statistics over all ranks."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from unet3d import dist
from unet3d.amp import autocast
from unet3d.optim import ProgressSchedule

POSTFIX_EVERY = 5  # steps between progress-bar loss readings (each one waits for the GPU)


@dataclass(frozen=True)
class EpochStats:
    loss: float  # mean training loss over every rank's samples
    samples: int  # samples trained on, all ranks
    seconds: float
    lr: float  # learning rate at the epoch's last step

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)


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
) -> EpochStats:
    """Train `steps` batches of (image (B, C, X, Y, Z), label (B, X, Y, Z)); every rank must call this.

    The learning rate follows training progress (epoch + step / steps) / epochs before every step.
    """
    model.train()
    world = dist.get_world_size()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    seen = 0
    bar = tqdm(total=steps, desc=f"train {epoch + 1}/{epochs}", disable=not dist.is_main(), dynamic_ncols=True)
    start = time.perf_counter()
    for step, (image, label) in enumerate(loader):
        schedule.set_progress((epoch + step / steps) / epochs)
        image = image.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, amp_dtype):
            loss = loss_fn(model(image), label)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach().double() * len(image)
        seen += len(image)
        bar.update(1)
        if not bar.disable and (step % POSTFIX_EVERY == 0 or step == steps - 1):
            rate = seen * world / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}", samples_s=f"{rate:.1f}")
    bar.close()
    totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(seen, dtype=torch.float64, device=device)]))
    seconds = time.perf_counter() - start
    total_seen = int(totals[1].item())
    return EpochStats(totals[0].item() / max(total_seen, 1), total_seen, seconds, schedule.get_last_lr()[0])
