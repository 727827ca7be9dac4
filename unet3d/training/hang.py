"""Naming a hung rank, and where it hangs; ending every node's part of a job that one rank ended.

When one rank stops (a deadlock, a DataLoader worker stuck on a network disk, a collective that only some
ranks reach), the others wait in their next collective until --dist-timeout, and then fail: gloo raises,
nccl's watchdog ends the process. Their errors say only that they waited. So while training runs on several
ranks, a thread on each watches how long its rank has gone without a collective returning
(`dist.idle_seconds`), and once that passes `HANG_FRACTION` of the timeout, shortly before the waiting ranks
fail, it logs where each of the process's threads is, once per stall: a rank waiting in a collective shows
the call it waits in, the rank holding it up shows what it is doing instead. One line per rank goes to the
console, the stacks to the rank's log file. `describe_failure` words the error of a collective that failed
after such a wait.

In a job of several nodes, a rank that ends the job for good on its own (out of GPU memory) stops only its
own node through its agent. So there it also posts a notice in the process group's store
(`dist.post_end_notice`), which an `EndWatch` thread on every rank looks for every `NOTICE_EVERY` seconds:
a rank that reads it asks its own agent to end the job too, instead of the agent restarting it and waiting
at the rendezvous for the node that is gone until RDZV_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from unet3d.training import dist
from unet3d.training.control import end_job_without_restart
from unet3d.training.logs import file_only, get_logger

HANG_FRACTION = 0.9  # of --dist-timeout: late enough that only a hang gets there, early enough to beat the timeout
W = TypeVar("W", bound="_Watch")
NOTICE_EVERY = 1.0  # seconds between two looks for another rank's notice that it ended the job


def thread_stacks(skip: int | None = None) -> str:
    """Where every thread of this process is now, the main thread first (thread `skip` left out)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)).rstrip()
        for ident, frame in frames
        if ident != skip
    )


def _log_path(log: logging.Logger) -> str | None:
    files = [h.baseFilename for h in log.handlers if isinstance(h, logging.FileHandler)]
    return files[0] if files else None


class _Watch:
    """A daemon thread running `_run` while the object is entered; `_stop` is set on leaving, after which the
    thread is waited for at most `join_timeout` seconds (None: until it ends)."""

    name = "unet3d-watch"
    join_timeout: float | None = None

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self: W) -> W:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout)


class HangWatch(_Watch):
    """While entered: a daemon thread that reports each stall of this rank longer than
    `HANG_FRACTION * timeout` seconds (no collective returning), once per stall."""

    name = "unet3d-hang-watch"

    def __init__(self, rank: int, timeout: float, idle: Callable[[], float] = dist.idle_seconds) -> None:
        super().__init__()
        self.rank, self.timeout = rank, timeout
        self.after = HANG_FRACTION * timeout
        self.idle = idle  # seconds this rank has gone without a collective returning
        self.reports = 0
        self._reported = False  # the current stall has been reported

    def poll(self) -> float:
        """Report the current stall if it is long enough and not reported yet; returns the seconds until
        the next look (when the stall would become long enough, or, once reported, a tenth of it)."""
        idle = self.idle()
        if idle < self.after:
            self._reported = False
            return self.after - idle
        if not self._reported:
            self._reported = True
            self.reports += 1
            self.report(idle)
        return self.after / 10

    def report(self, idle: float) -> None:
        log = get_logger()
        path = _log_path(log)
        where = f"its threads' stacks are in {path}" if path else "its threads' stacks follow"
        log.warning(
            f"rank {self.rank}: no collective has returned on this rank for {idle:.1f} s, "
            f"{HANG_FRACTION:.0%} of --dist-timeout {self.timeout:g} s: a rank is hung, or every rank is this "
            f"slow; {where} (a rank waiting in a collective waits for the one that is elsewhere)"
        )
        stacks = thread_stacks(skip=threading.get_ident())
        if path:
            file_only(log, f"rank {self.rank} after {idle:.1f} s without a collective:\n{stacks}", logging.WARNING)
        else:
            log.warning(stacks)

    def _run(self) -> None:
        while not self._stop.wait(self.poll()):
            pass


ReadNotice = Callable[[int], "tuple[int, str] | None"]  # dist.read_end_notice's signature


class EndWatch(_Watch):
    """While entered: a daemon thread that looks for another rank's notice that it ended the job
    (`dist.post_end_notice`) and, once it reads one, says so and asks this rank's agent to end the job."""

    name = "unet3d-end-watch"
    join_timeout = 2 * NOTICE_EVERY  # not for ever: a look into a store whose host is unreachable may hang

    def __init__(self, rank: int, local_rank: int, node: int, read: ReadNotice = dist.read_end_notice) -> None:
        super().__init__()
        self.rank, self.local_rank, self.node = rank, local_rank, node
        self.read = read
        self.ended_by: int | None = None  # the rank whose notice was read

    def poll(self) -> bool:
        """Look once; True when a notice was read (and acted on), after which there is nothing more to do."""
        notice = self.read(self.node)
        if notice is None:
            return False
        self.ended_by, message = notice
        log = get_logger()
        line = f"error: rank {self.ended_by} ended the job: {message}"
        (log.error if self.local_rank == 0 else lambda m: file_only(log, m))(line)  # one line per node
        if end_job_without_restart():
            file_only(log, "asked torchrun to end the job: another node's rank ended it")
        return True

    def _run(self) -> None:
        while not self._stop.wait(NOTICE_EVERY):
            if self.poll():
                return


@contextlib.contextmanager
def watch(info: dist.DistInfo, timeout: float) -> Iterator[HangWatch | None]:
    """For the block: a `HangWatch` on several ranks, and an `EndWatch` where they span several nodes; alone
    there is no collective to wait in, and neither."""
    with contextlib.ExitStack() as stack:
        watcher = stack.enter_context(HangWatch(info.rank, timeout)) if info.world_size > 1 else None
        if info.other_nodes_ranks:
            stack.enter_context(EndWatch(info.rank, info.local_rank, info.node))
        yield watcher


def describe_failure(error: BaseException, rank: int, timeout: float) -> str | None:
    """The error line for `error` when it ended a wait of at least `HANG_FRACTION` of --dist-timeout without a
    collective returning on this rank (decided on the clock, not on the message), else None."""
    idle = dist.idle_seconds()
    if dist.get_world_size() < 2 or idle < HANG_FRACTION * timeout:
        return None
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else type(error).__name__
    path = _log_path(get_logger())
    logs = str(Path(path).parent) if path else "OUT/logs"
    return (
        f"error: rank {rank}: {first}, {idle:.1f} s after a collective last returned on this rank "
        f"(--dist-timeout {timeout:g} s): a rank hung or fell that far behind; each rank's log in {logs} shows "
        "where its threads were. torchrun restarts the job from its last checkpoint, up to MAX_RESTARTS times"
    )
