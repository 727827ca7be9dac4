"""DDP scaling: training samples per second with 1 and more ranks, each rank with the same thread count."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import TrainStep, release_gpu_memory, sync
from data.plan import legacy_plan
from unet3d import DiceCELoss, UNet3D
from unet3d.precision import apply_memory_format, resolve_memory_format
from unet3d.training.config import TrainConfig
from unet3d.training.control import StepControl
from unet3d.training.dist import DistInfo
from unet3d.training.epoch import train_one_epoch
from unet3d.training.runtime import Runtime, wrap_for_training
from unet3d.training.state import new_state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ScalingRun:
    """One measurement: `world` processes, each with `threads` threads, training `steps` timed steps."""

    world: int
    threads: int
    features: tuple[int, ...]
    patch: tuple[int, int, int]
    batch: int
    amp_dtype: torch.dtype | None
    steps: int
    device_type: str = "cpu"
    ddp: bool = True  # the project's DDP training loop; False: independent processes (the machine's ceiling)
    timing: bool = True  # the loop's per-step timing (unet3d.training.timing) on, or off


def _project_loop(rank: int, job: ScalingRun, device: torch.device):
    """The project's own training loop (train_one_epoch: DDP, the per-step agreement, clipping) on one batch."""
    cfg = TrainConfig(
        features=job.features, patch_size=job.patch, batch_size=job.batch, epochs=10**6,
        samples_per_epoch=job.steps * job.batch * job.world, lr=0.01, momentum=0.95, num_workers=0,
    )  # fmt: skip
    info = DistInfo(rank, rank, job.world, job.world, device)
    memory_format = resolve_memory_format("auto", device, job.amp_dtype)
    rt = Runtime(
        cfg=cfg, dist=info, amp_dtype=job.amp_dtype, memory_format=memory_format, steps_per_epoch=job.steps,
        show_progress=False,
    )  # fmt: skip
    torch.manual_seed(rank)
    model = apply_memory_format(UNet3D(1, 3, job.features).to(device), memory_format)
    plan = legacy_plan(["MRI"], job.patch, job.features)
    state = new_state(rt, model, plan, plan.model_args(1, 3), ["0", "1", "2"])
    wrapped = wrap_for_training(rt, model)
    control = StepControl(device, cfg.max_bad_steps, budget=None, started=time.time())
    control.timer.enabled = job.timing
    batch = (torch.randn(job.batch, 1, *job.patch), torch.randint(0, 3, (job.batch, *job.patch), dtype=torch.uint8))
    loss = DiceCELoss()

    def run(count: int) -> None:
        train_one_epoch(rt, state, wrapped, loss, [batch] * count, control)

    return run


def _rank(rank: int, job: ScalingRun, port: int, results) -> None:
    torch.set_num_threads(job.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if job.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work: this rank's context on its own GPU only
        torch.backends.cudnn.benchmark = True  # as training runs (a spawned process starts with the default)
    # With DDP, the project's training loop; without, bare steps that share only the barriers around the timed
    # ones: what the machine itself allows when processes run side by side, the ceiling for DDP's scaling.
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=job.world,
        timeout=timedelta(seconds=300),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        if job.ddp:
            run = _project_loop(rank, job, device)
        else:
            step = TrainStep(UNet3D(1, 3, job.features), job.patch, job.batch, job.amp_dtype, device)

            def run(count: int) -> None:
                for _ in range(count):
                    step()

        run(2)
        sync(device)
        dist.barrier()
        began = time.perf_counter()
        run(job.steps)
        sync(device)
        dist.barrier()
        if rank == 0:
            results.put(job.world * job.batch * job.steps / (time.perf_counter() - began))
    finally:
        dist.destroy_process_group()


def samples_per_s(job: ScalingRun) -> float:
    """Training samples per second of `job.world` DDP ranks (gloo on the CPU, nccl on GPUs) on random batches;
    with ddp=False, of as many independent processes."""
    if job.device_type == "cuda":
        release_gpu_memory()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, job, port, results)) for r in range(job.world)]
    for p in procs:
        p.start()
    rate = results.get(timeout=900)
    for p in procs:
        p.join()
    return rate
