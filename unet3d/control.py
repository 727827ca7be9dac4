"""Decisions every rank must take together, once per step: skip a bad step, stop, how far training is.

One all_reduce per step carries each rank's view (a non-finite loss or gradient, a stop signal received,
the time elapsed), so all ranks skip the same steps and stop after the same step, and the learning rate,
when it follows a time budget, is the same everywhere.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from unet3d import dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEBOUNCE_S = 2.0  # one event often arrives twice (the terminal's Ctrl-C and torchrun forwarding it)
EXIT_MARGIN_S = 3.0  # a time-limited run's allowance for writing the last checkpoint and exiting


class TrainingError(RuntimeError):
    """Training cannot go on (repeated non-finite steps, non-finite weights)."""


class StopSignal:
    """SIGTERM or SIGINT during training asks for a graceful stop; a second one ends the process at once.

    Installed only while the training loop runs: before that, the default handlers end the process at
    once, as they should for a worker that torchrun stops before it has started training.
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum), now
            return
        if now - self._first_at < DEBOUNCE_S:
            return
        signal.signal(signum, signal.SIG_DFL)  # a second request: stop now, the default way
        os.kill(os.getpid(), signum)


@dataclass
class TimeBudget:
    """A wall-clock budget for this run; progress over it drives the learning rate.

    progress = start_progress + (1 - start_progress) * elapsed / (limit - reserve): a run resumed with a
    new budget anneals from where it was. `reserve` keeps room for a last validation and checkpoint.
    """

    limit_s: float
    start_wall: float  # time.time() at the budget's start (kept across torchrun restarts of one job)
    start_progress: float
    run_id: str
    reserve_s: float = 0.0

    def progress(self, elapsed: float) -> float:
        usable = max(self.limit_s - self.reserve_s, 1e-6)
        return self.start_progress + (1 - self.start_progress) * min(elapsed / usable, 1.0)

    def exhausted(self, elapsed: float) -> bool:
        return elapsed + self.reserve_s >= self.limit_s

    def plan_reserve(self, validation_s: float | None) -> None:
        """Room for the final validation (1.5x the last one, or 10 % of the budget before any is measured),
        the last checkpoint and the processes' exit."""
        validation = 0.1 * self.limit_s if validation_s is None else 1.5 * validation_s
        self.reserve_s = validation + 0.02 * self.limit_s + EXIT_MARGIN_S

    def state_dict(self) -> dict:
        return {
            "limit_s": self.limit_s,
            "start_wall": self.start_wall,
            "start_progress": self.start_progress,
            "run_id": self.run_id,
        }


def end_job_without_restart(local_rank: int) -> bool:
    """Ask torchrun's agent (this worker's parent) to end the job instead of restarting it.

    For failures a restart would only repeat (bad input, repeated non-finite steps). Every rank reaches
    such a failure together, and local rank 0 of each node stops its own agent. Returns whether it asked.
    """
    if local_rank != 0 or "TORCHELASTIC_RUN_ID" not in os.environ or os.getppid() <= 1:
        return False
    os.kill(os.getppid(), signal.SIGTERM)
    return True


def nan_fault_steps(rank: int) -> set[int]:
    """Global steps at which this rank's loss is made NaN, from UNET3D_FAULT_NAN="RANK:STEP,STEP;...".

    A fault-injection hook for testing the non-finite guard end to end; unset in normal runs.
    """
    steps: set[int] = set()
    for part in filter(None, os.environ.get("UNET3D_FAULT_NAN", "").split(";")):
        who, _, when = part.partition(":")
        if int(who) == rank:
            steps.update(int(s) for s in when.split(",") if s)
    return steps


@dataclass
class StepVerdict:
    skip: bool  # some rank saw a non-finite loss or gradient: nobody steps
    overflow: bool  # the fp16 loss scale overflowed on some rank: nobody steps, the scale is lowered
    stop: str | None  # why every rank stops after this step, or None
    elapsed: float  # seconds since the budget's start, averaged over ranks


class StepControl:
    """Per-step agreement between ranks, and the count of consecutive skipped steps."""

    def __init__(self, device: torch.device, max_bad_steps: int, budget: TimeBudget | None, start_wall: float):
        self.device = device
        self.max_bad_steps = max_bad_steps
        self.budget = budget
        self.start_wall = budget.start_wall if budget is not None else start_wall
        self.signal = StopSignal()
        self.bad_in_a_row = 0
        self.progress_floor = 0.0

    def elapsed(self) -> float:
        """Seconds since the budget's start, averaged over ranks (a collective: every rank calls it)."""
        mine = torch.tensor([time.time() - self.start_wall], dtype=torch.float64, device=self.device)
        return dist.all_reduce_sum(mine).item() / dist.get_world_size()

    def agree(self, local_bad: torch.Tensor, local_overflow: torch.Tensor | bool = False) -> StepVerdict:
        """One all_reduce of [bad, overflow, stop requested, elapsed]; every rank must call this every step."""
        elapsed = time.time() - self.start_wall
        flags = [local_bad, local_overflow, self.signal.received is not None, elapsed]
        mine = torch.stack([torch.as_tensor(f, dtype=torch.float64).to(self.device).reshape(()) for f in flags])
        bad, overflow, stop, elapsed_sum = dist.all_reduce_sum(mine).tolist()
        elapsed = elapsed_sum / dist.get_world_size()
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad > 0 else 0
        if self.bad_in_a_row >= self.max_bad_steps:
            raise TrainingError(
                f"non-finite loss or gradients in {self.bad_in_a_row} consecutive steps (--max-bad-steps "
                f"{self.max_bad_steps}); stopping. Lower --lr, try --amp off, or check the data"
            )
        reason = None
        if stop > 0:
            reason = "a stop signal (SIGTERM/SIGINT)"
        elif self.budget is not None and self.budget.exhausted(elapsed):
            reason = f"the time limit ({self.budget.limit_s:.0f} s)"
        return StepVerdict(bad > 0, overflow > 0 and bad == 0, reason, elapsed)

    def progress(self, epoch_progress: float, elapsed: float) -> float:
        """Training progress for the schedule: the larger of the epoch and time fractions, never decreasing."""
        p = epoch_progress if self.budget is None else max(epoch_progress, self.budget.progress(elapsed))
        self.progress_floor = max(self.progress_floor, p)
        return self.progress_floor
