"""Naming a hung rank (unet3d.training.hang): a stall past 0.9 x --dist-timeout is reported once, with where
every thread of the process is; a collective that failed after such a wait gets an error line that says so.
The end-to-end run (a rank held up for twice the timeout under launch.sh) is in test_reliability."""

from __future__ import annotations

import functools
import re
import threading
import time

import pytest
import torch

from unet3d.training import dist, hang
from unet3d.training.logs import setup_logging


def test_poll_reports_each_stall_once_and_waits_only_as_long_as_needed(monkeypatch):
    idle = [0.0]
    watcher = hang.HangWatch(rank=3, timeout=10.0, idle=lambda: idle[0])
    reported: list[float] = []
    monkeypatch.setattr(watcher, "report", reported.append)
    assert watcher.poll() == pytest.approx(9.0) and reported == []  # looks again when 9 s would have passed
    idle[0] = 8.9
    assert watcher.poll() == pytest.approx(0.1) and reported == []
    idle[0] = 9.5
    assert watcher.poll() == pytest.approx(0.9) and reported == [9.5]  # then a tenth of 9 s, for progress
    idle[0] = 30.0
    watcher.poll()
    assert reported == [9.5], "one report per stall"
    idle[0] = 0.5  # a collective returned: the next stall is a new one
    assert watcher.poll() == pytest.approx(8.5)
    idle[0] = 9.0
    watcher.poll()
    assert reported == [9.5, 9.0] and watcher.reports == 2


def _stuck_in_here(seconds: float) -> None:
    time.sleep(seconds)


def test_a_stalled_rank_logs_where_its_threads_are(tmp_path, capsys):
    """The real thread and the real log: one warning on the console, the main thread's stack in the log file
    (down to the function it is stuck in), the watcher's own thread left out."""
    log = setup_logging(1, tmp_path)
    start = time.monotonic()
    try:
        with hang.HangWatch(rank=1, timeout=0.5, idle=lambda: time.monotonic() - start) as watcher:
            _stuck_in_here(1.5)  # three times the 0.45 s after which it reports
    finally:
        for handler in log.handlers:
            handler.flush()
    assert watcher.reports == 1
    console = capsys.readouterr().out
    assert console.count("no collective has returned on this rank") == 1
    assert re.search(
        r"rank 1: no collective has returned on this rank for 0\.\d s, 90% of --dist-timeout 0\.5 s", console
    )
    assert f"its threads' stacks are in {tmp_path / 'rank1.log'}" in console
    text = (tmp_path / "rank1.log").read_text()
    stacks = re.split(r"rank 1 after 0\.\d s without a collective:\n", text, maxsplit=1)[1]
    assert stacks.startswith("thread MainThread:\n")
    assert "in _stuck_in_here\n    time.sleep(seconds)" in stacks
    assert "in test_a_stalled_rank_logs_where_its_threads_are" in stacks
    assert "thread unet3d-hang-watch" not in stacks and "unet3d/training/hang.py" not in stacks
    assert not any(t.name == "unet3d-hang-watch" for t in threading.enumerate()), "the thread ends with the block"


def test_one_process_has_no_watch(alone):
    before = threading.active_count()
    info = dist.DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    with hang.watch(info, timeout=900.0) as watcher:
        assert watcher is None and threading.active_count() == before


def test_a_collective_that_failed_after_the_wait_is_said_to_have(monkeypatch, tmp_path):
    setup_logging(0, tmp_path)
    error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 100000ms for recv\nmore")
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "idle_seconds", lambda: 101.2)
    message = hang.describe_failure(error, 0, 100.0)
    assert message == (
        "error: rank 0: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 100000ms for recv, 101.2 s "
        "after a collective last returned on this rank (--dist-timeout 100 s): a rank hung or fell that far "
        f"behind; each rank's log in {tmp_path} shows where its threads were. torchrun restarts the job from its "
        "last checkpoint, up to MAX_RESTARTS times"
    )
    monkeypatch.setattr(dist, "idle_seconds", lambda: 50.0)
    assert hang.describe_failure(error, 0, 100.0) is None, "an error soon after a collective is another fault"
    monkeypatch.setattr(dist, "idle_seconds", lambda: 101.2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert hang.describe_failure(error, 0, 100.0) is None, "alone there is no collective to time out"


def test_a_notice_read_is_said_once_per_node_and_ends_the_watch(monkeypatch, tmp_path, capsys):
    """EndWatch: nothing until another node's rank posts its notice; then the line (on the console from a node's
    local rank 0, in the file from the others) and the request to this rank's agent (none here: no torchrun)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    notices: list = [None, None, (3, "rank 3 (cuda:1) ran out of memory (...)")]
    for local_rank in (0, 1):
        setup_logging(4 + local_rank, tmp_path)
        read = functools.partial(next, iter(notices))  # one answer per look, whatever the node
        watcher = hang.EndWatch(rank=4 + local_rank, local_rank=local_rank, node=4, read=lambda node, r=read: r())
        assert [watcher.poll(), watcher.poll()] == [False, False] and watcher.ended_by is None
        assert watcher.poll() is True and watcher.ended_by == 3
        line = "error: rank 3 ended the job: rank 3 (cuda:1) ran out of memory (...)"
        assert line in (tmp_path / f"rank{4 + local_rank}.log").read_text()
        assert (line in capsys.readouterr().out) is (local_rank == 0)


def test_the_watches_a_job_gets(monkeypatch):
    """One node of several ranks: the stall watch; several nodes: also the end notice's; threads end with it."""
    monkeypatch.setattr(hang.EndWatch, "poll", lambda self: False)  # no store here: only which threads run
    names = lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("unet3d-"))  # noqa: E731
    for world, local, expected in ((2, 2, ["unet3d-hang-watch"]), (4, 2, ["unet3d-end-watch", "unet3d-hang-watch"])):
        info = dist.DistInfo(rank=1, local_rank=1, world_size=world, local_world_size=local, device=torch.device("cpu"))
        with hang.watch(info, timeout=900.0) as watcher:
            assert isinstance(watcher, hang.HangWatch) and names() == expected
        assert names() == []
