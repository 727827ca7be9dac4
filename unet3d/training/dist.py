"""Distributed state in one place: set-up, rank accessors and the few collectives the trainer uses.

Every accessor falls back to single-process values when no process group exists, so the same code runs
under torchrun and as a plain `python train_ddp.py`. Global RANK decides who writes files; LOCAL_RANK
only picks the device. The launcher has already masked CUDA_VISIBLE_DEVICES, so local rank i binds to
the logical device cuda:i, whatever physical GPU that is.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# When a collective call of this module last returned on this rank (time.monotonic()), for `idle_seconds`:
# a rank that stops making them for about --dist-timeout is hung, or waits for one that is.
_last_collective = time.monotonic()


def _returned() -> None:
    global _last_collective
    _last_collective = time.monotonic()


def idle_seconds() -> float:
    """Seconds since a collective call of this module last returned on this rank (or the group was set up).

    On nccl a call returns once its work is queued, and the next read of its result waits for it: a rank
    stuck there stays idle all the same. DDP's own gradient all_reduce does not count; the trainer's
    per-step agreement follows it.
    """
    return time.monotonic() - _last_collective


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int  # global rank: decides who writes files
    local_rank: int  # rank on this node: picks the device
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node(self) -> int:
        """This node's first global rank, which names it: ranks are numbered contiguously per node (`read_env`)."""
        return self.rank - self.local_rank

    @property
    def other_nodes_ranks(self) -> int:
        """How many ranks the other nodes run (every node runs as many)."""
        return self.world_size - self.local_world_size


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def read_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's environment, else one process."""
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise ValueError(
            f"inconsistent torchrun environment: RANK={rank} LOCAL_RANK={local_rank} "
            f"WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}"
        )
    # The trainer takes a node's ranks to be numbered contiguously, the same number on every node (a node's
    # local rank 0 builds its data and cache; failures are counted per node). torchrun numbers them so, except
    # with --virtual-local-rank, which gives every rank LOCAL_RANK=0 (and one GPU each, as its cuda:0).
    group = _env_int("GROUP_RANK", -1)  # the node's rank, set by torchrun
    if group >= 0 and rank - group * local_world_size != local_rank:
        raise ValueError(
            f"RANK={rank} on node GROUP_RANK={group} of LOCAL_WORLD_SIZE={local_world_size} rank(s) should have "
            f"LOCAL_RANK={rank - group * local_world_size}, got {local_rank}: the ranks of a node must be numbered "
            "contiguously, as many on every node (torchrun's --virtual-local-rank is not supported; launch.sh "
            "masks the GPUs itself)"
        )
    return rank, local_rank, world_size, local_world_size


EXPECT_CUDA = "UNET3D_EXPECT_CUDA"  # set to 1 by launch.sh when it was given GPU ids


def check_gpus_visible() -> None:
    """Raise ValueError when launch.sh was given GPU ids but PyTorch sees no GPU (a CPU-only build of torch,
    a driver it cannot use): the ranks would otherwise train on the CPU after the launcher said nccl."""
    if os.environ.get(EXPECT_CUDA) == "1" and not torch.cuda.is_available():
        raise ValueError(
            f"launch.sh was given GPUs (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}) "
            f"but PyTorch sees none (torch {torch.__version__}, CUDA build {torch.version.cuda}): check the driver "
            "with nvidia-smi and that this torch is a CUDA build, or launch with cpu[:N]"
        )


def setup(timeout: timedelta | None = None, setup_timeout: timedelta | None = None) -> DistInfo:
    """Bind this process to its device, then create the process group (nccl on GPUs, else gloo).

    The device is bound before the process group exists and before any CUDA work, so no rank ever
    creates a context on a GPU other than its own. Connecting uses `setup_timeout`, so a restarted group
    whose connection hangs fails fast and torchrun can try again; once every rank has answered a first
    barrier, collectives get `timeout`.
    """
    rank, local_rank, world_size, local_world_size = read_env()
    check_gpus_visible()
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {visible} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1:
        dist.init_process_group(
            backend, timeout=setup_timeout or timeout, device_id=device if device.type == "cuda" else None
        )
        if setup_timeout is not None and timeout is not None and setup_timeout != timeout:
            barrier()  # every rank connected within setup_timeout
            dist.distributed_c10d._set_pg_timeout(timeout)
    _returned()
    return DistInfo(rank, local_rank, world_size, local_world_size, device)


def cleanup() -> None:
    """Destroy the process group if there is one; safe to call in `finally`.

    DistributedDataParallel sits in a reference cycle, so a wrapper already out of scope still holds the
    group through its reducer until the cycle collector runs, which may be during the interpreter's
    shutdown, after the group was destroyed (a rank then aborts at exit). Collecting first lets the
    group's last users go while the group and the interpreter are whole.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank; on nccl the barrier names this rank's device so it touches no other GPU."""
    if not is_dist():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    _returned()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place (a no-op alone) and return it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        _returned()
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of `tensor` over ranks, in place (a no-op alone); returns it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        _returned()
    return tensor


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (picklable objects only)."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    _returned()
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    _returned()
    return out


def run_on_local_main(fn: Callable[[], T], info: DistInfo) -> T:
    """Run `fn` on local rank 0 of every node and hand each node's result to its ranks; any failure to all.

    For work whose result lives on a node's own disk (a generated dataset, a cache). Ranks are numbered
    contiguously per node, so a node's local rank 0 is global rank `rank - local_rank`. A failure reaches
    the other ranks as an error of the same class (`_failure`), so that every rank reaches the same verdict.
    """
    result: tuple[bool, Any] = (True, None)
    error: Exception | None = None
    if info.local_rank == 0:
        try:
            result = (True, fn())
        except Exception as e:  # handed to the node's ranks, re-raised below
            error = e
            result = (False, _describe(e))
    results = all_gather_object(result)
    if error is not None:
        raise error
    failures = [value for ok, value in results if not ok]
    if failures:  # every rank stops, not just the failing node's
        text = "; ".join(sorted({message for _, message, _ in failures}))
        raise _failure(failures[0][0], "a node's local rank 0 failed: " + text, failures[0][2])
    return results[info.node][1]


def run_on_main(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and hand its result, or its failure, to every rank.

    The other ranks wait in a broadcast rather than a barrier, so when rank 0 fails they raise an error of
    the same class at once (`_failure`: a bad checkpoint is a ValueError on every rank, and every rank exits
    as for bad input) instead of hanging until the collective times out.
    """
    result: tuple[bool, Any] = (True, None)
    error: Exception | None = None
    if is_main():
        try:
            result = (True, fn())
        except Exception as e:  # handed to every rank, re-raised below
            error = e
            result = (False, _describe(e))
    ok, value = broadcast_object(result)
    if error is not None:
        raise error
    if not ok:
        raise _failure(value[0], f"rank 0 failed: {value[1]}", value[2])
    return value


def _describe(error: Exception) -> tuple[type | None, str, int | None]:
    """(the error's class, if it pickles: every rank runs the same code; "Class: message"; an OSError's errno)
    for the other ranks."""
    cls: type | None = type(error)
    try:
        pickle.loads(pickle.dumps(cls))
    except Exception:  # a class defined in a function: the others get a RuntimeError
        cls = None
    return cls, f"{type(error).__name__}: {error}", getattr(error, "errno", None)


def _failure(cls: type | None, message: str, errno: int | None = None) -> Exception:
    """An error of class `cls` made from `message` alone, else of the first of the families the trainer tells
    apart (FileNotFoundError, ValueError) that `cls` belongs to, else a RuntimeError. An OSError keeps `errno`,
    so that every rank decides on the same value (a full disk ends the job without a restart)."""
    for candidate in (cls, FileNotFoundError, ValueError):
        if cls is None or not issubclass(cls, candidate):
            continue
        try:
            made = candidate(message)
        except Exception:  # a constructor that takes other arguments
            continue
        if str(made) == message:  # not KeyError's quoted form
            if isinstance(made, OSError):
                made.errno = errno  # str() stays the message: it has no strerror
            return made
    return RuntimeError(message)


def arrive(key: str, wait: float = 0.0, expected: int | None = None) -> bool:
    """Count this rank in at `key`; with `wait` > 0, then wait up to `wait` seconds for `expected` ranks (every
    rank when None) to have arrived there.

    Not a collective: it goes through the process group's key-value store, so ranks that never arrive
    cost the waiter at most `wait` seconds instead of a hang. Meant for the exit path, where a rank may
    already be gone; returns whether they all arrived (False also when the store is unreachable). The key is
    this node's torchrun restart count's: ranks of one node agree on it, ranks of other nodes may not (a
    node's agent counts only the restarts its own workers failed).
    """
    if not is_dist():
        return True
    expected = get_world_size() if expected is None else expected
    key = f"unet3d/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{key}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add(key, 1)
        return _count_reaches(store, key, expected, wait)
    except (RuntimeError, ValueError):  # the store's host (rank 0) has gone: nobody left to wait for
        return False


def _count_reaches(store: dist.Store, key: str, expected: int, wait: float) -> bool:
    """Whether the store's counter `key` reaches `expected` within `wait` seconds (looked at every 20 ms)."""
    deadline = time.monotonic() + wait
    count = store.add(key, 0)
    while count < expected and time.monotonic() < deadline:
        time.sleep(0.02)
        count = store.add(key, 0)
    return count >= expected


END_NOTICE, END_READ = "unet3d/job-ended", "unet3d/job-ended-read"  # keys in the process group's store


def post_end_notice(rank: int, node: int, message: str, others: int, wait: float) -> bool:
    """Say through the store that rank `rank` of node `node` ends the job for good (`message`: why), then wait
    up to `wait` seconds for the `others` ranks of the other nodes to have read it (`read_end_notice`).

    For a rank that fails alone in a job of several nodes: its own agent stops its node, and nothing tells the
    others, whose agents would restart and wait for this node at the rendezvous until it times out. Not a
    collective; returns whether they all read it (False also when the store is unreachable).
    """
    if not is_dist():
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(END_NOTICE, json.dumps({"rank": rank, "node": node, "message": message}))
        return _count_reaches(store, END_READ, others, wait)
    except (RuntimeError, ValueError):  # the store's host has gone
        return False


def read_end_notice(node: int) -> tuple[int, str] | None:
    """(rank, message) of another rank's `post_end_notice`, counted as read by this rank when it posted from
    another node than `node`; None when there is none, or no store to ask."""
    if not is_dist():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([END_NOTICE]):
            return None
        notice = json.loads(store.get(END_NOTICE))
        if notice["node"] != node:
            store.add(END_READ, 1)
        return int(notice["rank"]), str(notice["message"])
    except (RuntimeError, ValueError):
        return None
