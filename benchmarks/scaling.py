"""DDP scaling: training samples per second with 1 and more ranks, each rank with the same thread count."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.common import TrainStep, sync
from unet3d import UNet3D


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, threads, features, patch, batch, amp_dtype, steps, device_type, ddp, results) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Without DDP the processes share only the barriers around the timed steps: what the machine itself allows
    # when they run side by side, the ceiling DDP's scaling is measured against.
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        step = TrainStep(UNet3D(1, 3, features), patch, batch, amp_dtype, device)
        if ddp:
            ids = [rank] if device.type == "cuda" else None
            step.model = DDP(step.model, device_ids=ids, gradient_as_bucket_view=True)
        for _ in range(2):
            step()
        sync(device)
        dist.barrier()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        dist.barrier()
        if rank == 0:
            results.put(world * batch * steps / (time.perf_counter() - began))
    finally:
        dist.destroy_process_group()


def samples_per_s(
    world: int,
    threads: int,
    features: Sequence[int],
    patch: Sequence[int],
    batch: int,
    amp_dtype: torch.dtype | None,
    steps: int,
    device_type: str = "cpu",
    ddp: bool = True,
) -> float:
    """Training samples per second of `world` DDP ranks (gloo on the CPU, nccl on GPUs) on random batches; with
    ddp=False, of as many independent processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (world, _free_port(), threads, tuple(features), tuple(patch), batch, amp_dtype, steps, device_type, ddp)
    args = (*args, results)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    rate = results.get(timeout=900)
    for p in procs:
        p.join()
    return rate
