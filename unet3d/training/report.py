"""Rank 0's account of training: the epoch line, the TensorBoard scalars and overlay, the closing words."""

from __future__ import annotations

import math
from collections.abc import Sequence

from unet3d.inference.pictures import overlay_planes
from unet3d.training.checkpointing import BEST, LAST, checkpoint_dir
from unet3d.training.epoch import EpochStats
from unet3d.training.logs import get_logger
from unet3d.training.runtime import Runtime
from unet3d.training.state import TrainState
from unet3d.training.validation import ValResult


def open_tensorboard(rt: Runtime, state: TrainState):
    """Rank 0's SummaryWriter (None elsewhere); `purge_step` drops what a killed run logged past the
    checkpoint it resumes from, so TensorBoard gets no duplicated or backwards steps."""
    if not rt.is_main:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(rt.out_dir / "tensorboard"), purge_step=state.epoch + 1)


def epoch_summary(
    epochs: int, stats: EpochStats, val: ValResult | None, class_names: Sequence[str], is_best: bool
) -> str:
    """One line: loss, learning rate, time and throughput, and the validation Dice when there is one.

    An epoch cut short by a stop reads "epoch 3/10 stopped at step 7: ..." so that "epoch 3/10:" appears
    once per completed epoch.
    """
    where = f"epoch {stats.epoch}/{epochs}" + (f" stopped at step {stats.steps_done}" if stats.stopped else "")
    line = (
        f"{where}: loss {stats.loss:.4f}, lr {stats.lr:.2e}, {stats.seconds:.1f} s, {stats.samples_per_s:.1f} samples/s"
    )
    if stats.skipped:
        line += f", {stats.skipped} step(s) skipped"
    if stats.overflowed:
        line += f", {stats.overflowed} step(s) skipped for fp16 loss-scale overflow"
    if val is not None:
        per_class = ", ".join(f"{n} {v:.3f}" for n, v in zip(class_names[1:], val.per_class))
        line += f", val Dice {val.mean_dice:.4f} ({per_class})" + (" new best" if is_best else "")
    return line


def log_epoch(writer, stats: EpochStats, val: ValResult | None, class_names: Sequence[str]) -> None:
    """TensorBoard: training scalars every epoch; validation Dice and a mid-slice overlay when validated.

    The overlay shows the first validation case of rank 0: image | reference | prediction.
    """
    done = stats.epoch
    writer.add_scalar("train/loss", stats.loss, done)
    writer.add_scalar("train/lr", stats.lr, done)
    writer.add_scalar("time/epoch_s", stats.seconds, done)
    writer.add_scalar("time/samples_per_s", stats.samples_per_s, done)
    if val is not None:
        for name, value in zip(class_names[1:], val.per_class):
            writer.add_scalar(f"val/dice_{name}", value, done)
        writer.add_scalar("val/mean_dice", val.mean_dice, done)
        if val.preview is not None:
            writer.add_image("val/overlay", overlay_planes(*val.preview), done, dataformats="HWC")
    writer.flush()


def report_epoch(
    writer, epochs: int, stats: EpochStats, val: ValResult | None, class_names: Sequence[str], is_best: bool
) -> None:
    """Rank 0: the epoch line; TensorBoard for every completed epoch and every validated one."""
    if stats.stopped is None or val is not None:
        log_epoch(writer, stats, val, class_names)
    get_logger().info(epoch_summary(epochs, stats, val, class_names, is_best))


def closing_words(rt: Runtime, state: TrainState, stats: EpochStats | None) -> str:
    """What the run says as it ends: where it stopped and how to continue, or where its checkpoints are."""
    folder = checkpoint_dir(rt.out_dir)
    if stats is not None and stats.stopped is not None:
        return (
            f"stopped by {stats.stopped.describe(state.budget)} after step {stats.steps_done}/{rt.steps_per_epoch} "
            f"of epoch {stats.epoch}; checkpoint {folder / LAST} records the position: run the same command "
            "again to continue"
        )
    best = f"; best mean Dice {state.best_metric:.4f}: {folder / BEST}" if state.best_metric > -math.inf else ""
    board = rt.out_dir / "tensorboard"
    return f"done. checkpoint: {folder / LAST}{best}\nTensorBoard logs: {board} (tensorboard --logdir {board})"
