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

from benchmarks.common import TrainStep, release_gpu_memory, sync
from unet3d import DiceCELoss, UNet3D
from unet3d.amp import grad_scaler
from unet3d.control import StepControl
from unet3d.engine import train_one_epoch
from unet3d.layout import apply_memory_format, resolve_memory_format
from unet3d.optim import build_optimizer, build_schedule, optimizer_kernels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _project_loop(rank, features, patch, batch, amp_dtype, steps, device):
    """The project's own training loop (train_one_epoch: DDP, the per-step agreement, clipping) on one batch."""
    torch.manual_seed(rank)
    model = apply_memory_format(UNet3D(1, 3, features).to(device), resolve_memory_format("auto", device, amp_dtype))
    wrapped = DDP(model, device_ids=[rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    # The kernels training picks: fused on GPUs, except under fp16 loss scaling (see optimizer_kernels).
    optimizer = build_optimizer(model.parameters(), "sgd", 0.01, 3e-5, 0.95, optimizer_kernels(device, amp_dtype))
    schedule, scaler = build_schedule(optimizer, "sgd"), grad_scaler(device, amp_dtype)
    control = StepControl(device, max_bad_steps=5, budget=None, start_wall=time.time())
    batch_data = (torch.randn(batch, 1, *patch), torch.randint(0, 3, (batch, *patch), dtype=torch.uint8))
    loss = DiceCELoss()

    def run(count: int) -> None:
        train_one_epoch(
            wrapped,
            [batch_data] * count,
            count,
            loss,
            optimizer,
            schedule,
            scaler,
            amp_dtype,
            device,
            0,
            1,
            control,
            show_progress=False,
        )

    return run


def _rank(rank, world, port, threads, features, patch, batch, amp_dtype, steps, device_type, ddp, results) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work: this rank's context on its own GPU only
        torch.backends.cudnn.benchmark = True  # as training runs (a spawned process starts with the default)
    # With DDP, the project's training loop; without, bare steps that share only the barriers around the timed
    # ones: what the machine itself allows when processes run side by side, the ceiling for DDP's scaling.
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        if ddp:
            run = _project_loop(rank, features, patch, batch, amp_dtype, steps, device)
        else:
            step = TrainStep(UNet3D(1, 3, features), patch, batch, amp_dtype, device)

            def run(count: int) -> None:
                for _ in range(count):
                    step()

        run(2)
        sync(device)
        dist.barrier()
        began = time.perf_counter()
        run(steps)
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
    if device_type == "cuda":
        release_gpu_memory()
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
