"""Rank 0's account of an epoch: the summary line and the TensorBoard scalars and overlay image."""

from __future__ import annotations

from collections.abc import Sequence

from unet3d.engine import EpochStats
from unet3d.overlay import overlay_planes
from unet3d.validation import ValResult


def epoch_summary(
    done: int, epochs: int, stats: EpochStats, val: ValResult | None, class_names: Sequence[str], is_best: bool
) -> str:
    """One line: loss, learning rate, time and throughput, and the validation Dice when there is one.

    An epoch cut short by a stop reads "epoch 3/10 stopped at step 7: ..." so that "epoch 3/10:" appears
    once per completed epoch.
    """
    where = f"epoch {done}/{epochs}" + (f" stopped at step {stats.steps_done}" if stats.stopped else "")
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


def log_epoch(writer, done: int, stats: EpochStats, val: ValResult | None, class_names: Sequence[str]) -> None:
    """TensorBoard: training scalars every epoch; validation Dice and a mid-slice overlay when validated.

    The overlay shows the first validation case of rank 0: image | reference | prediction.
    """
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
