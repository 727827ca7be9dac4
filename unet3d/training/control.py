"""Decisions every rank must take together, once per step: skip a bad step, stop, how far training is.

One all_reduce per step carries each rank's view (a non-finite loss or gradient, a stop signal received,
the time elapsed, its loss), so all ranks skip the same steps and stop after the same step, the learning
rate, when it follows a time budget, is the same everywhere, and every step's loss over all ranks comes
for free. The same collective is where a rank waits for the slowest one: `StepTimer` times it.
"""

from __future__ import annotations

import enum
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unet3d.training import dist
from unet3d.training.logs import file_only, get_logger
from unet3d.training.timing import StepTimer

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # (torchrun passes a hangup on as SIGHUP)
STOP_FILE_ENV = "UNET3D_STOP_FILE"  # launch.sh's file for the ranks that stopped gracefully on a signal
DEBOUNCE_S = 2.0  # one event often arrives twice (the terminal's Ctrl-C and torchrun forwarding it)
SCHEDULE_DONE = 0.99  # a saved schedule progress this far along: annealed to its end (by a time budget)
EXIT_MARGIN_S = 3.0  # a time-limited run's allowance for writing the last checkpoint and exiting
LAUNCH_TIME_ENV = "UNET3D_LAUNCH_TIME"  # set by launch.sh: --time-limit counts from there


class TrainingError(RuntimeError):
    """Training cannot go on (repeated non-finite steps, non-finite weights)."""


class StopReason(enum.Enum):
    """Why every rank stopped training inside an epoch (decisions go by the value, never by the message)."""

    SIGNAL = "signal"  # SIGTERM, SIGINT or SIGHUP on some rank
    TIME_LIMIT = "time limit"  # --time-limit reached; a last validation still fits

    def describe(self, budget: TimeBudget | None) -> str:
        if self is StopReason.TIME_LIMIT and budget is not None:
            return f"the time limit ({budget.limit_s:.0f} s)"
        return "a stop signal (SIGTERM/SIGINT/SIGHUP)" if self is StopReason.SIGNAL else "the time limit"


class StopSignal:
    """SIGTERM, SIGINT or SIGHUP during training asks for a graceful stop; a second one ends the process at once.

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

    def plan_reserve(self, validation_s: float | None, validates: bool = True) -> None:
        """Room for the final validation (1.5x the last one, or 10 % of the budget before any is measured;
        none for a run that never validates, as with --fold all), the last checkpoint and the processes'
        exit."""
        validation = 0.0 if not validates else 0.1 * self.limit_s if validation_s is None else 1.5 * validation_s
        self.reserve_s = validation + 0.02 * self.limit_s + EXIT_MARGIN_S

    def state_dict(self) -> dict[str, Any]:
        return {
            "limit_s": self.limit_s,
            "start_wall": self.start_wall,
            "start_progress": self.start_progress,
            "run_id": self.run_id,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TimeBudget:
        return cls(state["limit_s"], state["start_wall"], state["start_progress"], state["run_id"])

    @classmethod
    def for_job(
        cls,
        limit_s: float | None,
        saved: TimeBudget | None,
        started: float,
        progress: float,
        validates: bool = True,
        launches: Sequence[float | None] | None = None,
    ) -> TimeBudget | None:
        """The --time-limit budget of this job: the saved one after a torchrun restart of the same job, else a
        new one that counts from launch.sh's start (so its pre-flight and torchrun's start-up count too) and
        anneals from training `progress` so far.

        `launches`: every rank's `launch_time()` (this rank's alone when not given). The same job is the same
        torchrun run id, the same limit and a budget that started at one of the nodes' launch.sh starts:
        the run id alone repeats across jobs (a multi-node job's default `RDZV_ID`, a requeued Slurm job),
        while launch.sh's start stays the same only across torchrun's restarts. The result is the same on
        every rank, the nodes' launch.sh having started at different moments.
        """
        if limit_s is None:
            return None
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}")
        stamps = _stamps(launches)
        if cls.same_job(limit_s, saved, launches):
            budget = cls(saved.limit_s, saved.start_wall, saved.start_progress, run_id)
        else:
            budget = cls(limit_s, min(stamps) if stamps else started, progress, run_id)
        budget.plan_reserve(None, validates)
        return budget

    @staticmethod
    def same_job(
        limit_s: float | None, saved: TimeBudget | None, launches: Sequence[float | None] | None = None
    ) -> bool:
        """Whether `saved` is this job's budget (see `for_job`): a torchrun restart of the job that saved it."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}")
        stamps = _stamps(launches)
        return (
            limit_s is not None
            and saved is not None
            and saved.run_id == run_id
            and saved.limit_s == limit_s
            and (not stamps or saved.start_wall in stamps)  # no launch.sh (bare torchrun): the run id decides
        )


def _stamps(launches: Sequence[float | None] | None) -> list[float]:
    """The launch.sh starts given (this rank's own when none are), without the ranks started without it."""
    return [t for t in (launches if launches is not None else [launch_time()]) if t is not None]


def schedule_start(
    same_job: bool,
    saved_progress: float,
    epoch_progress: float,
    epochs_changed: bool = False,
    until_time_limit: bool = False,
) -> float:
    """Where a resumed run's learning-rate schedule stands.

    Where it stood, within one job (a torchrun restart keeps its time budget), and in a new job that goes on
    (a preempted one). Otherwise from the epochs trained (`epoch_progress`, of this run's --epochs): after a
    resume with another --epochs (the old progress was of the old count: more epochs held the old run's last
    rate), and after a schedule that a time budget annealed to its end while epochs remain (it kept every
    later job at a learning rate near zero): then from the epochs trained, or, training until the time limit
    (no epoch count), from the start, a new cycle over the new budget. `same_job`: `TimeBudget.same_job`."""
    if same_job:
        return saved_progress
    if epochs_changed and not until_time_limit:
        return min(max(epoch_progress, 0.0), 1.0)
    if saved_progress >= SCHEDULE_DONE:
        return 0.0 if until_time_limit else min(max(epoch_progress, 0.0), 1.0)
    return saved_progress


def launch_time() -> float | None:
    """When launch.sh started on this node (`UNET3D_LAUNCH_TIME`, kept by every torchrun restart it runs), or
    None for a job started without it."""
    stamp = os.environ.get(LAUNCH_TIME_ENV, "")
    return float(stamp) if stamp else None


def tell_the_launcher(stopped: StopReason | None = None, *, starting: bool = False) -> None:
    """Write this rank's line to launch.sh's UNET3D_STOP_FILE: "<torchrun restart> -1" as training starts
    (`starting`), "<torchrun restart> <rank>" after a stop on a signal with the checkpoint saved.

    torchrun that got the signal too (Ctrl-C, a scheduler signalling every process) exits 1 with a
    SignalException once its ranks have ended; launch.sh reads here that every rank of its node stopped and
    saved in torchrun's last attempt (the one that started training last), and exits 0 as a graceful stop
    should. Nothing without launch.sh."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path or not (starting or stopped is StopReason.SIGNAL):
        return
    rank = "-1" if starting else os.environ.get("RANK", "0")
    try:
        with open(path, "a") as f:  # one short append per line: whole lines
            f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {rank}\n")
    except OSError as e:  # launch.sh then reports torchrun's exit code, as it would without the file
        get_logger().warning(f"could not write to launch.sh's {path} ({e.strerror or e})")


def end_job_without_restart() -> bool:
    """Ask torchrun's agent (this worker's parent) to end the job instead of restarting it.

    For failures a restart would only repeat (bad input, repeated non-finite steps, running out of GPU
    memory). The agent then stops every worker of its node. Call it before exiting, from every rank that
    fails so: the agent restarts the job when a worker's exit reaches it first. Returns whether the agent
    was asked, by this rank or another of its attempt (False when this process was not started by torchrun).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.getppid() <= 1:
        return False
    # One signal per agent and attempt: the agent's handler raises again on every further SIGTERM, and a
    # third one abandoned its shutdown before it killed the workers, leaving a rank that had not failed
    # waiting in a collective, without a parent, until --dist-timeout (several ranks out of memory at once)
    if _first_to_ask():
        os.kill(os.getppid(), signal.SIGTERM)
    return True


def _first_to_ask() -> bool:
    """Whether no other rank of this agent's current attempt has asked it to end the job (an exclusive file,
    named by the agent's pid and the restart count: beside launch.sh's stop file, which it removes with
    these at exit; under plain torchrun in the temporary folder, named by the run too)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    stop_file = os.environ.get(STOP_FILE_ENV)
    if stop_file:
        marker = Path(f"{stop_file}.end-{os.getppid()}-{restart}")
    else:
        run = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID", ""))[:64]
        marker = Path(tempfile.gettempdir()) / f"unet3d-end-{run}-{os.getppid()}-{restart}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:  # no temporary folder to write: ask anyway
        return True
    return True


@dataclass
class StepVerdict:
    loss: float  # the step's mean loss over every rank's samples (NaN when a rank's was not finite)
    skip: bool  # some rank saw a non-finite loss or gradient: nobody steps
    overflow: bool  # the fp16 loss scale overflowed on some rank: nobody steps, the scale is lowered
    stop: StopReason | None  # why every rank stops after this step, or None
    elapsed: float  # seconds since the budget's start, averaged over ranks


class StepControl:
    """Per-step agreement between ranks, the stop signals, the time budget and the count of bad steps."""

    def __init__(self, device: torch.device, max_bad_steps: int, budget: TimeBudget | None, started: float):
        self.device = device
        self.max_bad_steps = max_bad_steps
        self.budget = budget
        self.start_wall = budget.start_wall if budget is not None else started
        self.signal = StopSignal()
        self.timer = StepTimer(device)
        self.profiler = None  # a torch.profiler to step, on the rank asked to (`--profile`)
        self.bad_in_a_row = 0
        self.progress_floor = 0.0

    @contextmanager
    def running(self) -> Iterator[None]:
        """While training runs: SIGTERM/SIGINT/SIGHUP ask for a graceful stop (`StopSignal`), and the profiler, if
        any, records."""
        self.signal.install()
        if self.profiler is not None:
            self.profiler.start()
        try:
            yield
        finally:
            self.signal.uninstall()
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None

    def elapsed(self) -> float:
        """Seconds since the budget's start, averaged over ranks (a collective: every rank calls it)."""
        mine = torch.tensor([time.time() - self.start_wall], dtype=torch.float64, device=self.device)
        return dist.all_reduce_sum(mine).item() / dist.get_world_size()

    def meet(self) -> None:
        """Every rank reaches the backward pass together (a one-number all_reduce; every rank must call it).

        DDP's gradient all_reduce in the backward pass would otherwise be where ranks wait for a slower one,
        hidden inside what looks like computing; here the wait is a span of its own (`StepTimer`).
        """
        dist.all_reduce_sum(torch.zeros(1, device=self.device))

    def agree(
        self, local_bad: torch.Tensor, local_overflow: torch.Tensor | bool, loss: torch.Tensor, samples: int
    ) -> StepVerdict:
        """One all_reduce of [bad, overflow, stop requested, elapsed, loss x samples, samples]; every rank must
        call this every step."""
        elapsed = time.time() - self.start_wall
        host = torch.tensor([float(self.signal.received is not None), elapsed, samples], dtype=torch.float64)
        flags = [torch.as_tensor(f, device=self.device).double().reshape(1) for f in (local_bad, local_overflow)]
        weighted = (loss.detach().double() * samples).reshape(1)
        mine = torch.cat([*flags, host.to(self.device), weighted])  # one copy to the device, one all_reduce
        bad, overflow, stop, elapsed_sum, samples_sum, loss_sum = dist.all_reduce_sum(mine).tolist()
        elapsed = elapsed_sum / dist.get_world_size()
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad > 0 else 0
        if self.bad_in_a_row >= self.max_bad_steps:
            raise TrainingError(
                f"non-finite loss or gradients in {self.bad_in_a_row} consecutive steps (--max-bad-steps "
                f"{self.max_bad_steps}); stopping. Lower --lr, try --amp off, or check the data"
            )
        reason = None
        if stop > 0:
            reason = StopReason.SIGNAL
        elif self.budget is not None and self.budget.exhausted(elapsed):
            reason = StopReason.TIME_LIMIT
        return StepVerdict(loss_sum / max(samples_sum, 1.0), bad > 0, overflow > 0 and bad == 0, reason, elapsed)

    def progress(self, epoch_progress: float, elapsed: float) -> float:
        """Training progress for the schedule: the larger of the epoch and time fractions, never decreasing."""
        p = epoch_progress if self.budget is None else max(epoch_progress, self.budget.progress(elapsed))
        self.progress_floor = max(self.progress_floor, p)
        return self.progress_floor


def fail_together(error: Exception, info: dist.DistInfo) -> int:
    """Every rank reached this verdict (bad input, repeated bad steps): rank 0 says it, each rank logs it,
    and the job ends without torchrun restarting it. Returns the exit code: 2 for bad input, else 1."""
    log = get_logger()
    (log.error if info.is_main else lambda m: file_only(log, m))(f"error: {error}")
    # Stopping the agent stops every local rank, so each first waits until this node's ranks have all
    # recorded the verdict (another node's ranks are its own agent's to stop, and may count restarts apart).
    # Then every rank asks (one signal reaches the agent): a rank that only exited is a failed worker, which
    # torchrun restarts when it notices that before another rank's request (rank 0 waiting here, rank 1 gone).
    if info.other_nodes_ranks:  # a verdict of one node's alone must still end the others
        dist.post_end_notice(info.rank, info.node, str(error), info.other_nodes_ranks, wait=0.0)
    dist.arrive(f"failed/node{info.node}", wait=10.0, expected=info.local_world_size)
    if end_job_without_restart():
        file_only(log, "asked torchrun to end the job: a restart would repeat this failure")
    return 1 if isinstance(error, TrainingError) else 2


def no_room(error: OSError) -> TrainingError:
    """The verdict on a write refused for want of room (`unet3d.files.out_of_room`), with what to do."""
    return TrainingError(
        f"{error}: a restart would fail the same way, so the job ends here; files are written under a temporary "
        "name first, so the checkpoints and cache files already there are intact. Make room (disk space, quota, "
        "ulimit -f), then run the same command again: it continues from the last checkpoint saved, if any"
    )


NOTICE_WAIT_S = 10.0  # how long a rank that ends a job of several nodes waits for the other nodes to read it


def fail_alone(error: torch.cuda.OutOfMemoryError, info: dist.DistInfo) -> int:
    """This rank ran out of GPU memory: the others wait in a collective until torchrun stops them. A restart
    would run out again, so this rank ends the job itself, with advice. Returns the exit code, 1."""
    log = get_logger()
    first = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    message = (
        f"rank {info.rank} ({info.device}) ran out of memory ({first}); lower --batch-size or --patch-size, or add "
        "--grad-checkpoint"
    )
    log.error(f"error: {message}")
    others = info.other_nodes_ranks  # other nodes: only a notice tells them (`hang.EndWatch`)
    if others and not dist.post_end_notice(info.rank, info.node, message, others, wait=NOTICE_WAIT_S):
        file_only(log, f"not every rank of the other nodes read the notice within {NOTICE_WAIT_S:g} s")
    if end_job_without_restart():
        file_only(log, "asked torchrun to end the job: a restart would run out of memory again")
    return 1
