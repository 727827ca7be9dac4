"""Rank 0's account of training: the epoch line, the TensorBoard scalars and overlay, the closing words."""

from __future__ import annotations

import math
from collections.abc import Sequence

from unet3d.inference.pictures import overlay, picture
from unet3d.training.checkpointing import BEST, LAST, checkpoint_dir
from unet3d.training.config import UNTIL_TIME_LIMIT
from unet3d.training.epoch import EpochStats
from unet3d.training.logs import get_logger
from unet3d.training.runtime import Runtime
from unet3d.training.state import TrainState
from unet3d.training.validation import ValResult


class Reporter:
    """Rank 0's account of each epoch: the console line, TensorBoard, and each diagnosis once per run."""

    def __init__(self, rt: Runtime, state: TrainState, class_names: Sequence[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops what a killed run logged past the checkpoint it resumes from, so TensorBoard gets
        # no duplicated or backwards steps. TensorBoard purges every tag of a folder at or past that step, so
        # the loss of each step (counted in steps, not epochs) has a folder of its own: one purge for both
        # cut the steps of every epoch but the first
        board = rt.out_dir / "tensorboard"
        self.writer = SummaryWriter(str(board), purge_step=state.epoch + 1)
        # the next step to be logged, counted across runs: a resumed run's steps per epoch may differ
        first_step = state.trained_steps + state.partial_epoch.step + 1
        self.steps = SummaryWriter(str(board / STEPS_FOLDER), purge_step=first_step)
        self.epochs = rt.cfg.epochs
        self.class_names = list(class_names)
        self.said: set[str] = set()

    def step_losses(self, stats: EpochStats) -> None:
        """TensorBoard: the loss of every step the epoch trained (a stopped epoch's too: the resumed run goes
        on after them). Before the epoch's checkpoint: a run killed between the two would lose them, where
        one killed before the checkpoint has them purged by the run that resumes from the one before."""
        log_steps(self.steps, stats)

    def board(self, stats: EpochStats, val: ValResult | None) -> None:
        """TensorBoard for every completed epoch and every validated one: before the epoch's checkpoint, as
        the step losses, so that a run killed between the two has them purged and logged again by the run
        that resumes (after it, they were lost for good)."""
        if stats.stopped is None or val is not None:
            log_epoch(self.writer, stats, val, self.class_names)

    def epoch(self, stats: EpochStats, val: ValResult | None, is_best: bool) -> None:
        """The epoch line, once its checkpoint is written (a line "epoch N/M:" means the epoch is saved), and
        each diagnosis once."""
        log = get_logger()
        log.info(epoch_summary(self.epochs, stats, val, self.class_names, is_best))
        if stats.epoch > 1 or stats.epoch == self.epochs:  # the first epoch also pays for the start
            for kind, words in stats.timing.diagnoses().items():
                if kind not in self.said:
                    self.said.add(kind)
                    log.warning(f"diagnosis: {words}")

    def validation(self, epoch: int, val: ValResult, is_best: bool) -> None:
        """The validation a stop signal cut short, made up for after the resume: its line and TensorBoard."""
        log_validation(self.writer, epoch, val, self.class_names)
        self.writer.flush()
        get_logger().info(f"epoch {epoch} validated on resuming: {validation_words(val, self.class_names, is_best)}")

    def close(self) -> None:
        self.writer.close()
        self.steps.close()


def epoch_summary(
    epochs: int, stats: EpochStats, val: ValResult | None, class_names: Sequence[str], is_best: bool
) -> str:
    """One line: loss, learning rate, time, throughput and where the time went, and the validation Dice
    when there is one.

    An epoch cut short by a stop reads "epoch 3/10 stopped at step 7: ..." so that "epoch 3/10:" appears
    once per completed epoch.
    """
    of = "" if epochs >= UNTIL_TIME_LIMIT else f"/{epochs}"
    where = f"epoch {stats.epoch}{of}" + (f" stopped at step {stats.steps_done}" if stats.stopped else "")
    line = (
        f"{where}: loss {stats.loss:.4f}, lr {stats.lr:.2e}, {stats.seconds:.1f} s, {stats.samples_per_s:.1f} samples/s"
        f", {stats.timing.line()}"
    )
    if stats.skipped:
        line += f", {stats.skipped} step(s) skipped"
    if stats.overflowed:
        line += f", {stats.overflowed} step(s) skipped for fp16 loss-scale overflow"
    if val is not None:
        line += f", {validation_words(val, class_names, is_best)}"
    return line


def validation_words(val: ValResult, class_names: Sequence[str], is_best: bool) -> str:
    """ "val Dice 0.9123 (organ 0.950, lesion 0.875) new best", as the epoch line and a made-up validation say it."""
    per_class = ", ".join(f"{n} {v:.3f}" for n, v in zip(class_names[1:], val.per_class))
    return f"val Dice {val.mean_dice:.4f} ({per_class})" + (" new best" if is_best else "")


STEPS_FOLDER = "steps"  # under OUT/tensorboard: train/loss_step, by global step


def log_steps(writer, stats: EpochStats) -> None:
    """TensorBoard (the steps folder): the loss of every step of the epoch trained in this run."""
    for step, loss in stats.step_losses:
        writer.add_scalar("train/loss_step", loss, step)
    writer.flush()


def log_epoch(writer, stats: EpochStats, val: ValResult | None, class_names: Sequence[str]) -> None:
    """TensorBoard: the epoch's training scalars, where the time went; the validation Dice and a mid-slice
    overlay when validated (the first validation case of rank 0)."""
    done = stats.epoch
    writer.add_scalar("train/loss", stats.loss, done)
    writer.add_scalar("train/lr", stats.lr, done)
    writer.add_scalar("time/epoch_s", stats.seconds, done)
    writer.add_scalar("time/samples_per_s", stats.samples_per_s, done)
    for tag, value in stats.timing.scalars().items():
        writer.add_scalar(tag, value, done)
    if val is not None:
        log_validation(writer, done, val, class_names)
    writer.flush()


def log_validation(writer, epoch: int, val: ValResult, class_names: Sequence[str]) -> None:
    """TensorBoard: the validation Dice of the model after `epoch` epochs, and a mid-slice overlay."""
    for name, value in zip(class_names[1:], val.per_class):
        writer.add_scalar(f"val/dice_{name}", value, epoch)
    writer.add_scalar("val/mean_dice", val.mean_dice, epoch)
    if val.preview is not None:
        writer.add_image("val/overlay", picture([overlay(val.preview)], class_names), epoch, dataformats="HWC")


def closing_words(rt: Runtime, state: TrainState, stats: EpochStats | None) -> str:
    """What the run says as it ends: where it stopped and how to continue, or where its checkpoints are."""
    folder = checkpoint_dir(rt.out_dir)
    if stats is not None and stats.stopped is not None:
        return (
            f"stopped by {stats.stopped.describe(state.budget)} after step {stats.steps_done}/{rt.steps_per_epoch} "
            f"of epoch {stats.epoch}; checkpoint {folder / LAST} records the position: run the same command "
            "again to continue"
        )
    written = state.best_metric > -math.inf and (folder / BEST).is_file()
    best = f"; best mean Dice {state.best_metric:.4f}: {folder / BEST}" if written else ""
    board = rt.out_dir / "tensorboard"
    return f"done. checkpoint: {folder / LAST}{best}\nTensorBoard logs: {board} (tensorboard --logdir {board})"
