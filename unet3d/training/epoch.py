"""One training epoch: the step, the per-step agreement between ranks, the progress bar on rank 0."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from unet3d.precision import autocast
from unet3d.training import dist
from unet3d.training.control import StepControl, StopReason, TrainingError
from unet3d.training.logs import get_logger
from unet3d.training.runtime import Runtime
from unet3d.training.state import PartialEpoch, TrainState
from unet3d.training.timing import EpochTiming

POSTFIX_EVERY = 5  # steps between progress-bar loss readings (each one waits for the GPU)
GRAD_CLIP = 12.0  # gradient-norm clipping, as nnU-Net
# fp16: an overflow at a loss scale below this is no overflow (the scaled gradients are smaller than the true
# ones) but non-finite gradients, which halving the scale further never cures: without this bound such a fault
# skipped every step to the end of training, the scale falling towards zero, --max-bad-steps never reached
MIN_LOSS_SCALE = 1.0


@dataclass(frozen=True)
class EpochStats:
    epoch: int  # the epoch trained, counted from 1
    loss: float  # mean training loss over every rank's samples (skipped steps left out)
    samples: int  # samples trained on, all ranks
    seconds: float
    lr: float  # learning rate at the epoch's last step
    steps_done: int  # steps of this epoch trained so far, carried ones included
    skipped: int  # steps skipped for a non-finite loss or gradient
    overflowed: int  # steps the fp16 loss scale overflowed in (skipped, as the GradScaler does)
    stopped: StopReason | None  # why training stopped inside this epoch, or None when it completed
    timing: EpochTiming  # where every rank's time went (`unet3d.training.timing`)
    step_losses: list[tuple[int, float]]  # (global step counted from 1, mean loss over all ranks) per step

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)


def train_one_epoch(
    rt: Runtime,
    state: TrainState,
    model: nn.Module,
    loss_fn: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    control: StepControl,
) -> EpochStats:
    """Train epoch `state.epoch` on `batches` of (image (B, C, X, Y, Z), label (B, X, Y, Z) or a soft label
    (B, 3, X, Y, Z), `data.patches`); advance `state`.

    Every rank must call this. `model` is what the forward pass runs through (the DDP wrapper, a compiled
    module or `state.model` itself); `batches` yields only the epoch's remaining batches when
    `state.partial_epoch` says some were trained before a stop. Before each step the learning rate follows
    training progress; after each backward pass the ranks agree (`StepControl.agree`) whether to skip the
    step and whether to stop after it. Afterwards `state` counts the epoch as done, or, after a stop, holds
    the partial epoch's position and totals.
    """
    steps, epochs, device = rt.steps_per_epoch, rt.cfg.epochs, rt.device
    optimizer, schedule, scaler, carry = state.optimizer, state.schedule, state.scaler, state.partial_epoch
    epoch = state.epoch
    model.train()
    log = get_logger()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    seen, skipped, overflowed, stopped, step = 0, 0, 0, None, carry.step
    elapsed = control.elapsed()
    timer, step_losses = control.timer, []
    timer.start_epoch()
    shown = rt.is_main and rt.show_progress
    bar = tqdm(
        total=steps, initial=carry.step, desc=f"train {epoch + 1}/{epochs}", disable=not shown, dynamic_ncols=True
    )
    start = time.perf_counter()
    for step, (image, label) in enumerate(batches, start=carry.step):
        marks = timer.batch_arrived()
        schedule.set_progress(control.progress((epoch + step / steps) / epochs, elapsed))
        image = image.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, rt.amp_dtype):
            loss = loss_fn(model(image), label)
        if timer.enabled:  # where a rank waits for a slower one, as a span of its own
            timer.mark(marks)
            control.meet()
            timer.mark(marks)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        # Non-finite gradients under fp16 loss scaling mean the scale overflowed: a routine event (the scaler
        # lowers the scale and the step is skipped), not a fault. Anywhere else they are a fault, as is a NaN loss.
        grads_bad = ~torch.isfinite(grad_norm)
        local_bad = ~torch.isfinite(loss.detach()) | (grads_bad & (not scaler.is_enabled()))
        timer.mark(marks)
        verdict = control.agree(local_bad, grads_bad & scaler.is_enabled(), loss, len(image))
        timer.mark(marks)
        elapsed = verdict.elapsed
        if verdict.skip:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            log.warning(f"epoch {epoch + 1} step {step + 1}: skipped, a rank saw a non-finite loss or gradient")
        elif verdict.overflow:  # every rank skips it; the loss is left out of the epoch's mean as well
            overflowed += 1
            optimizer.zero_grad(set_to_none=True)
            scale = scaler.get_scale()  # one read on a rare step; every rank's scaler saw the same gradients
            if scale < MIN_LOSS_SCALE:  # so every rank raises here together
                raise TrainingError(
                    f"epoch {epoch + 1} step {step + 1}: fp16 gradients are non-finite even at a loss scale of "
                    f"{scale:.3g} (the GradScaler halved it at each of the overflows before): not an overflow but "
                    "a fault; try --amp bf16 or --amp off, lower --lr, or check the data"
                )
        else:
            scaler.step(optimizer)
            loss_sum += loss.detach().double() * len(image)
            seen += len(image)
        scaler.update()
        timer.step_done(marks)
        if math.isfinite(verdict.loss):
            step_losses.append((state.trained_steps + step + 1, verdict.loss))  # counted across runs
        if control.profiler is not None:
            control.profiler.step()
        bar.update(1)
        if not bar.disable and (step % POSTFIX_EVERY == 0 or step == steps - 1):
            rate = seen * rt.world_size / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}", samples_s=f"{rate:.1f}")
        if verdict.stop is not None:
            stopped = verdict.stop
            break
    bar.close()
    timing = timer.summary(rt.where, rt.cfg.num_workers, rt.cpus_per_rank)
    totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(seen, dtype=torch.float64, device=device)]))
    loss_total = totals[0].item() + carry.loss_sum
    samples = int(totals[1].item()) + carry.samples
    seconds = time.perf_counter() - start + carry.seconds
    done = step + 1 if stopped is not None else steps
    stats = EpochStats(
        epoch + 1,
        loss_total / max(samples, 1),
        samples,
        seconds,
        schedule.get_last_lr()[0],
        done,
        skipped,
        overflowed,
        stopped,
        timing,
        step_losses,
    )
    if stopped is None:
        state.epoch, state.partial_epoch = epoch + 1, PartialEpoch()
        state.trained_steps += steps
    else:
        state.partial_epoch = PartialEpoch(done, loss_total, samples, seconds)
    return stats
