"""Where each rank's time goes, step by step: waiting for the next batch, computing, waiting for the others.

Per step, three spans on this rank:

- data wait: from the end of the previous step's work to the batch's arrival from the DataLoader, on the
  host clock (the per-step agreement has just synchronised the device, so the device is idle meanwhile);
- sync wait: the two collectives every rank reaches each step, the meeting before the backward pass
  (`StepControl.meet`, where a rank waits for a slower one instead of inside DDP's gradient all_reduce)
  and the per-step agreement (`StepControl.agree`); on a GPU, CUDA events around them on the compute stream;
- compute: the rest of the step (forward, backward, clipping, optimizer): on a GPU from CUDA events around
  the step less the sync wait, read only at the end of the epoch, so the GPU is never stalled to time it.

At the end of each epoch one collective gathers every rank's totals (and, on GPUs, peak memory), so rank 0
can report min/mean/max over ranks and say, once, in plain words, what holds the job back.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unet3d.training import dist
from unet3d.training.logs import get_logger

# Diagnoses, printed once per run when an epoch (after the first, which pays for start-up) shows them:
DATA_WAIT_FRAC = 0.15  # ranks waited this share of their steps for data
STRAGGLER_RATIO = 1.25  # a rank's compute time over the median of the others'
FIELDS = ("data_wait_s", "compute_s", "sync_wait_s", "steps", "peak_gib", "workers", "cpus")


class _Clock:
    """Marks on the host clock (CPU) or CUDA events on the current stream (GPU), read after the epoch."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        # elapsed_time() raises while either event is still pending on the GPU, as the last step's end is when
        # the epoch's summary reads it (nothing has waited for that step's optimizer kernels); `start` was
        # recorded before `end` on the same stream, so it has completed once `end` has
        end.synchronize()
        return start.elapsed_time(end) / 1000


@dataclass
class StepTimer:
    """Collects one epoch's spans on this rank; `summary()` gathers every rank's (a collective)."""

    device: torch.device
    enabled: bool = True
    data_wait_s: float = 0.0
    _spans: list = field(default_factory=list)  # per step: start, meeting start/end, agreement start/end, end
    _ready: float | None = None  # host time the previous step's work ended

    def __post_init__(self) -> None:
        self.clock = _Clock(self.device)

    def start_epoch(self) -> None:
        self.data_wait_s, self._spans, self._ready = 0.0, [], time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def batch_arrived(self) -> list:
        """Called when the DataLoader has handed over the step's batch; returns the step's marks."""
        if not self.enabled:
            return []
        now = time.perf_counter()
        self.data_wait_s += now - self._ready
        marks = [self.clock.mark()]
        self._spans.append(marks)
        return marks

    def mark(self, marks: list) -> None:
        if self.enabled:
            marks.append(self.clock.mark())

    def step_done(self, marks: list) -> None:
        if self.enabled:
            marks.append(self.clock.mark())
            self._ready = time.perf_counter()

    def summary(self, where: Sequence[str], workers: int, cpus_per_rank: float) -> EpochTiming:
        """Every rank's totals for the epoch (every rank must call this: one all_reduce).

        Args:
            where: every rank's "host, device" (`Runtime.where`); workers, cpus_per_rank: this rank's loader.
        """
        compute = sync = 0.0
        for start, meet_start, meet_end, agree_start, agree_end, end in (s for s in self._spans if len(s) == 6):
            wait = self.clock.seconds(meet_start, meet_end) + self.clock.seconds(agree_start, agree_end)
            sync += wait
            compute += self.clock.seconds(start, end) - wait
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        mine = [self.data_wait_s, compute, sync, float(len(self._spans)), peak, float(workers), cpus_per_rank]
        table = torch.zeros(dist.get_world_size(), len(FIELDS), dtype=torch.float64, device=self.device)
        table[dist.get_rank()] = torch.tensor(mine, dtype=torch.float64)
        return EpochTiming(dist.all_reduce_sum(table).cpu().tolist(), list(where))


@dataclass(frozen=True)
class EpochTiming:
    """One epoch's spans of every rank: rows[rank] = the FIELDS."""

    rows: list[list[float]]
    where: list[str]  # "host, device" of every rank

    def column(self, name: str) -> list[float]:
        return [row[FIELDS.index(name)] for row in self.rows]

    def fractions(self, name: str) -> list[float]:
        """Per rank, the share of its step time spent in `name` (data_wait_s, compute_s or sync_wait_s)."""
        totals = [r[0] + r[1] + r[2] for r in self.rows]
        return [v / t if t > 0 else 0.0 for v, t in zip(self.column(name), totals)]

    def per_step(self, name: str) -> list[float]:
        return [v / max(n, 1.0) for v, n in zip(self.column(name), self.column("steps"))]

    def scalars(self) -> dict[str, float]:
        """TensorBoard's time/ and memory/ scalars: means over ranks, and the extremes."""
        out: dict[str, float] = {}
        for name, values in (
            ("data_wait_frac", self.fractions("data_wait_s")),
            ("sync_wait_frac", self.fractions("sync_wait_s")),
            ("compute_s", self.column("compute_s")),
        ):
            out[f"time/{name}"] = sum(values) / len(values)
            out[f"time/{name}_max"], out[f"time/{name}_min"] = max(values), min(values)
        peaks = self.column("peak_gib")
        if any(peaks):
            out["memory/peak_gib_max"], out["memory/peak_gib_min"] = max(peaks), min(peaks)
        return out

    def line(self) -> str:
        """The epoch line's part: shares of the step, and the spread over ranks when there are several."""
        data, sync = self.fractions("data_wait_s"), self.fractions("sync_wait_s")
        text = f"data wait {100 * sum(data) / len(data):.0f} %, sync wait {100 * sum(sync) / len(sync):.0f} %"
        if len(self.rows) > 1:
            compute = self.per_step("compute_s")
            text += f" (compute per step {min(compute):.3f}..{max(compute):.3f} s over ranks)"
        peaks = self.column("peak_gib")
        if any(peaks):
            text += f", peak memory {min(peaks):.1f}..{max(peaks):.1f} GiB"
        return text

    def diagnoses(self) -> dict[str, str]:
        """What holds the job back, in plain words, by kind ('data', 'straggler'); see the README."""
        found = {}
        data = self.fractions("data_wait_s")
        worst = max(range(len(data)), key=data.__getitem__)
        workers, cpus = int(self.column("workers")[worst]), self.column("cpus")[worst]
        if data[worst] > DATA_WAIT_FRAC:
            many = min(data) > DATA_WAIT_FRAC
            who = "ranks" if many else f"rank {worst} ({self.where[worst]})"
            share = sum(data) / len(data) if many else data[worst]
            waited = f"{who} waited {100 * share:.0f} % of each step for data"
            if cpus >= workers + 2:
                found["data"] = f"{waited}: raise --num-workers (now {workers}; this node has {cpus:.3g} CPUs per rank)"
            else:
                found["data"] = (
                    f"{waited}, and the loader's {workers} worker(s) share {cpus:.3g} CPU(s) per rank with the rank "
                    "itself: more workers would only compete for them; give the job more CPUs per rank"
                )
        compute = self.per_step("compute_s")
        if len(compute) > 1:
            slow = max(range(len(compute)), key=compute.__getitem__)
            others = sorted(c for i, c in enumerate(compute) if i != slow)
            median = others[len(others) // 2]
            if median > 0 and compute[slow] / median > STRAGGLER_RATIO:
                found["straggler"] = (
                    f"rank {slow} is {compute[slow] / median:.1f}x slower than the others ({self.where[slow]}): "
                    "every step waits for it"
                )
        return found


def _traced(folder: Path, rank: int):
    """TensorBoard's trace handler, which then names the file it wrote (it said nothing). The file's name
    holds the rank, the host and the pid: with --profile-every-rank the ranks write into one folder at about
    the same time, and each names its own file only."""
    worker = f"rank{rank}_{socket.gethostname()}_{os.getpid()}"
    write = torch.profiler.tensorboard_trace_handler(str(folder), worker_name=worker)

    def handler(prof) -> None:
        before = set(folder.glob(f"{worker}.*.pt.trace.json")) if folder.is_dir() else set()
        write(prof)
        for path in sorted(set(folder.glob(f"{worker}.*.pt.trace.json")) - before):
            get_logger().info(f"profile: {path} (TensorBoard's profiler plugin or https://ui.perfetto.dev)")

    return handler


def profiler(steps: int, out_dir: Path, device: torch.device, rank: int = 0):
    """A torch.profiler for `steps` steps after one of warm-up, writing a trace that TensorBoard's profiler
    plugin and Perfetto open (OUT/profile/rankR_HOST_PID.*.pt.trace.json); None when `steps` is 0."""
    if steps <= 0:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=_traced(out_dir / "profile", rank),
        record_shapes=False,
    )
