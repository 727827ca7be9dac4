"""Distributed set-up: torchrun's environment, device binding (GPU calls stubbed: no GPU here), collectives."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import spawn_ranks
from unet3d.training import dist


def test_read_env_defaults_to_one_process(alone):
    assert dist.read_env() == (0, 0, 1, 1)
    assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.is_main()


def test_read_env_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert dist.read_env() == (5, 1, 8, 4)
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's node rank: 5 is the second of node 1's four
    assert dist.read_env() == (5, 1, 8, 4)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun --virtual-local-rank sets it on every rank
    with pytest.raises(ValueError, match=r"RANK=5 on node GROUP_RANK=1 .* should have LOCAL_RANK=1, got 0"):
        dist.read_env()
    monkeypatch.delenv("GROUP_RANK")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        dist.read_env()
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match="LOCAL_RANK=4"):
        dist.read_env()


class FakeCuda:
    """Records the order of CUDA and process-group calls, as three masked GPUs would see them."""

    def __init__(self, monkeypatch, visible: int = 3) -> None:
        self.calls: list[tuple] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.calls.append(("set_device", torch.device(d))))
        monkeypatch.setattr(
            torch.distributed,
            "init_process_group",
            lambda backend, **kw: self.calls.append(("init_process_group", backend, kw.get("device_id"))),
        )


def test_setup_binds_local_rank_device_before_process_group(monkeypatch):
    fake = FakeCuda(monkeypatch)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    info = dist.setup()
    assert info.device == torch.device("cuda", 2) and info.rank == 2
    assert fake.calls == [
        ("set_device", torch.device("cuda", 2)),
        ("init_process_group", "nccl", torch.device("cuda", 2)),
    ]


def test_setup_refuses_local_rank_without_a_visible_gpu(monkeypatch):
    FakeCuda(monkeypatch, visible=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but only 2 GPU\(s\) are visible \(CUDA_VISIBLE_DEVICES=5,6\)"):
        dist.setup()


def test_setup_alone_on_cpu_makes_no_process_group(alone, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = dist.setup()
    assert info.device == torch.device("cpu") and info.world_size == 1 and not dist.is_dist()
    assert dist.run_on_main(lambda: 41 + 1) == 42
    assert dist.all_reduce_sum(torch.ones(2)).tolist() == [1, 1]


class _TwoArgumentError(ValueError):
    """A ValueError whose constructor takes more than a message (as data.prepare.DatasetError's does)."""

    def __init__(self, root: str, problems: list[str]) -> None:
        super().__init__(f"{root}: " + "; ".join(problems))


def _missing():
    raise FileNotFoundError("no such file: /data/case_1.nii.gz")


def _two_arguments():
    raise _TwoArgumentError("/data", ["bad spacing", "bad label"])


def _outcome(call) -> str | None:
    try:
        call()
        return None
    except Exception as e:  # every rank must see the failure, not hang
        return f"{type(e).__name__}: {e}"


def _collectives(info: dist.DistInfo, out: Path) -> None:
    total = dist.all_reduce_sum(torch.tensor([float(info.rank + 1)]))
    gathered = dist.all_gather_object(info.rank * 10)
    value = dist.run_on_main(lambda: "made on rank 0")

    class Local(Exception):  # its class cannot be sent: the others get a RuntimeError
        pass

    def local():
        raise Local("made here")

    failures = [_outcome(lambda f=f: dist.run_on_main(f)) for f in (lambda: 1 / 0, _missing, _two_arguments, local)]
    failures.append(_outcome(lambda: dist.run_on_local_main(_missing, info)))
    dist.barrier()
    time.sleep(0.6 if info.rank == 2 else 0.0)  # rank 2 late: the others wait for it in the all_reduce below
    idle_before = dist.idle_seconds()
    dist.all_reduce_max(torch.zeros(1))
    idle = [idle_before, dist.idle_seconds()]
    (out / f"{info.rank}.json").write_text(
        json.dumps([total.item(), gathered, value, failures, str(info.device), idle])
    )


def test_collectives_on_three_gloo_ranks(tmp_path):
    """The collectives' results; a failure of rank 0's (or of a node's local rank 0's) work reaches every rank
    as an error of its class, or of the nearest of ValueError, FileNotFoundError, RuntimeError: every rank
    then reaches the same verdict (a bad file is bad input on every rank, not a crash to restart from)."""
    spawn_ranks(_collectives, 3, tmp_path)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    own = [
        "ZeroDivisionError: division by zero",
        "FileNotFoundError: no such file: /data/case_1.nii.gz",
        "_TwoArgumentError: /data: bad spacing; bad label",
        "Local: made here",
    ]
    for rank, (total, gathered, value, failures, device, idle) in enumerate(results):
        assert total == 6 and gathered == [0, 10, 20] and value == "made on rank 0" and device == "cpu"
        if rank == 0:
            assert failures == [*own, own[1]]
        else:
            seen = ["ZeroDivisionError", "FileNotFoundError", "ValueError", "RuntimeError"]
            assert failures[:4] == [f"{cls}: rank 0 failed: {text}" for cls, text in zip(seen, own)]
        assert (
            failures[4] == own[1]
            if rank == 0
            else failures[4] == f"FileNotFoundError: a node's local rank 0 failed: {own[1]}"
        )
        # idle_seconds counts from the last collective to return here: the late rank's sleep, and then none
        assert idle[1] < 0.2, f"rank {rank}: the all_reduce that returned resets idle_seconds, got {idle}"
    assert results[2][5][0] >= 0.55, "rank 2 slept 0.6 s since the barrier returned"
    assert max(r[5][0] for r in results[:2]) < 0.3


def _arrivals(info: dist.DistInfo, out: Path) -> None:
    if info.rank == 2:
        time.sleep(1.0)  # a late rank: the waiter must see it arrive
    arrived_at = time.time()
    everyone = dist.arrive("late", wait=20.0 if info.rank == 0 else 0.0)
    returned_at = time.time()
    began = time.monotonic()
    alone = dist.arrive("only-rank-0", wait=0.5) if info.rank == 0 else None  # nobody else ever comes
    gave_up_after = time.monotonic() - began
    # Two of the three (one node's ranks, say) wait for each other alone; the third never comes.
    pair = dist.arrive("pair", wait=20.0 if info.rank == 0 else 0.0, expected=2) if info.rank < 2 else None
    # The end notice, with ranks 0 and 1 as one node (node 0) and rank 2 as another (node 2) that ends the job.
    dist.barrier()
    before = dist.read_end_notice(0)
    dist.barrier()
    if info.rank == 2:
        read = None
        posted = dist.post_end_notice(2, 2, "rank 2 ran out of memory", others=2, wait=20.0)
        own = dist.read_end_notice(2)  # its own node's read is not counted
    else:
        posted, read = None, None
        while read is None:
            read = dist.read_end_notice(0)
            time.sleep(0.02)
        own = None
    dist.barrier()
    count = torch.distributed.distributed_c10d._get_default_store().add(dist.END_READ, 0)
    record = [everyone, arrived_at, returned_at, alone, gave_up_after, pair, before, posted, read, own, count]
    (out / f"{info.rank}.json").write_text(json.dumps(record))


def test_arrive_waits_for_late_ranks_and_gives_up_on_absent_ones(tmp_path):
    """The exit path's rendezvous: a late rank is waited for; a rank that never comes costs the wait, not a hang."""
    spawn_ranks(_arrivals, 3, tmp_path)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    everyone, _, returned_at, alone, gave_up_after, pair = results[0][:6]
    for rank, (*_, before, posted, read, own, count) in enumerate(results):
        assert before is None and count == 2, "two reads from the other node, the poster's own not counted"
        assert posted is (True if rank == 2 else None), "the poster returns once the other node's ranks read it"
        assert (read if rank < 2 else own) == [2, "rank 2 ran out of memory"]
    assert everyone is True
    assert returned_at >= max(r[1] for r in results), "rank 0 returned only once the last rank had arrived"
    assert alone is False and 0.5 <= gave_up_after < 5
    assert pair is True, "the two expected ranks arrived: the third, not expected, is not waited for"


def _ddp_released(info: dist.DistInfo, out: Path) -> None:
    import gc
    import weakref

    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    gc.disable()  # no collection by chance: what frees the wrapper must be cleanup itself
    wrapped = DDP(torch.nn.Conv3d(1, 2, 3))
    wrapped(torch.randn(2, 1, 5, 5, 5)).sum().backward()  # a step's allreduce through the reducer
    wrapped.cycle = [wrapped]  # as the garbage of torch's lazy imports holds the first DDP's __init__ frame
    freed_with_group = []
    weakref.finalize(wrapped, lambda: freed_with_group.append(torch_dist.is_initialized()))
    del wrapped
    held_after_del = not freed_with_group
    dist.cleanup()
    gc.enable()
    (out / f"{info.rank}.json").write_text(json.dumps([held_after_del, freed_with_group]))


def test_cleanup_frees_ddp_wrappers_while_the_group_is_whole(tmp_path):
    """A DDP wrapper out of scope but held by cycle garbage keeps the group through its reducer; cleanup frees it
    before destroying the group, not during the interpreter's shutdown, where a rank then aborted at exit."""
    spawn_ranks(_ddp_released, 2, tmp_path)
    for rank in range(2):
        held_after_del, freed_with_group = json.loads((tmp_path / f"{rank}.json").read_text())
        assert held_after_del, "the wrapper outlives `del` (a cycle): otherwise this test shows nothing"
        assert freed_with_group == [True], "freed by cleanup, while the process group still existed"
