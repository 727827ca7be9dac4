"""Where and how this rank computes: its place in the job, the resolved configuration, precision, layout and
the epoch's length. Built once at start, after the data is known, and never changed."""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from data.prepare import RunData
from unet3d.inference.sliding_window import InferenceSettings
from unet3d.precision import format_name, resolve_amp, resolve_memory_format
from unet3d.training import dist
from unet3d.training.config import TrainConfig, resolve
from unet3d.training.logs import get_logger


@dataclass(frozen=True, kw_only=True)
class Runtime:
    cfg: TrainConfig  # resolved: no field left at None
    dist: dist.DistInfo  # rank, local rank, world size, device
    amp_dtype: torch.dtype | None  # autocast dtype, None for full precision
    memory_format: torch.memory_format  # layout of the model's activations
    steps_per_epoch: int  # optimizer steps per epoch, the same on every rank
    where: tuple[str, ...] = ("local",)  # every rank's "host, device", in rank order (for the reports)
    show_progress: bool = True  # rank 0's progress bar (benchmarks and tests that step directly turn it off)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only rank that writes checkpoints, TensorBoard logs and the console report."""
        return self.dist.is_main

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def cpus_per_rank(self) -> float:
        """The CPUs this node has for each of its ranks (their loaders' workers included)."""
        return len(os.sched_getaffinity(0)) / max(self.dist.local_world_size, 1)

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    def inference(self) -> InferenceSettings:
        """Validation's sliding window: the training patch, --val-overlap, one window per sample of a batch."""
        return InferenceSettings(
            window=self.cfg.patch_size,
            overlap=self.cfg.val_overlap,
            sw_batch_size=self.cfg.batch_size,
            amp_dtype=self.amp_dtype,
        )


def resolve_config(cfg: TrainConfig, run: RunData, info: dist.DistInfo) -> TrainConfig:
    """Fill the device- and plan-dependent defaults; record the dataset's folder."""
    cpus = len(os.sched_getaffinity(0))
    # absolute (symlinks kept), so evaluate.py finds the dataset from any folder it is started in
    cfg = dataclasses.replace(cfg, data_dir=os.path.abspath(run.data_dir))
    return resolve(cfg, run.plan, info.device.type, info.world_size, cpus, info.local_world_size)


def make_runtime(cfg: TrainConfig, info: dist.DistInfo, run: RunData) -> Runtime:
    """The Runtime of this rank, for training on `run`'s data (planned and cached)."""
    cfg = resolve_config(cfg, run, info)
    torch.backends.cudnn.benchmark = True  # one patch size throughout: let cuDNN pick its fastest kernels
    amp_dtype, memory_format, where = agree_on_precision(cfg.amp, cfg.memory_format, info.device)
    return Runtime(
        cfg=cfg,
        dist=info,
        amp_dtype=amp_dtype,
        memory_format=memory_format,
        steps_per_epoch=cfg.samples_per_epoch // (cfg.batch_size * info.world_size),
        where=where,
    )


def agree_on_precision(
    amp: str, memory_format: str, device: torch.device
) -> tuple[torch.dtype | None, torch.memory_format, tuple[str, ...]]:
    """This rank's autocast dtype and layout, the same on every rank or refused on every rank (a collective).

    A refusal that only some ranks reach (`--amp bf16` on the V100s of a job beside A100s) is gathered, not
    raised where it arises: a rank that raised before the gather would leave the others waiting in it.

    Returns:
        (autocast dtype or None, memory format, every rank's "host, device" in rank order).
    """
    where = f"{socket.gethostname()}, {device}"
    if device.type == "cuda":
        where += f" = {torch.cuda.get_device_name(device)}"
    amp_dtype, layout, refusal = None, torch.contiguous_format, None
    try:
        amp_dtype = resolve_amp(amp, device)
        layout = resolve_memory_format(memory_format, device, amp_dtype)
    except ValueError as e:
        refusal = str(e)
    ranks = dist.all_gather_object((where, str(amp_dtype), format_name(layout), refusal))
    check_same_precision(amp, ranks)  # every rank has the same list: all raise or none
    return amp_dtype, layout, tuple(r[0] for r in ranks)


def check_same_precision(amp: str, ranks: list[tuple[str, str, str, str | None]]) -> None:
    """Refuse a job where some rank refused its precision, or whose ranks resolved `--amp` (or the memory
    format) differently: on GPUs of two kinds (V100s beside A100s) `auto` gives fp16 with loss scaling on
    some ranks and bf16 without on others, and DistributedDataParallel would average scaled with unscaled
    gradients.

    Args:
        ranks: every rank's (host and device, precision, memory format, refusal or None), in rank order.
    """
    refused = [(i, w, refusal) for i, (w, _, _, refusal) in enumerate(ranks) if refusal is not None]
    if refused:
        i, w, refusal = refused[0]
        others = f" (and {len(refused) - 1} more ranks)" if len(refused) > 1 else ""
        raise ValueError(f"rank {i} ({w}){others}: {refusal}")
    if len({(dtype, layout) for _, dtype, layout, _ in ranks}) <= 1:
        return
    listed = "; ".join(f"rank {i} ({w}): {dtype}, {layout}" for i, (w, dtype, layout, _) in enumerate(ranks))
    raise ValueError(
        f"--amp {amp} resolved differently on the ranks ({listed}): they must train in one precision and "
        "layout; give --amp fp16 (or off) and --memory-format for a job across these GPUs"
    )


def describe_run(rt: Runtime, run: RunData) -> None:
    """The start-up report: every rank's device (a collective), the batch arithmetic, the data, the config."""
    info, cfg = rt.dist, rt.cfg
    mine = f"rank {info.rank}: host {socket.gethostname()}, local rank {info.local_rank}, device {info.device}"
    if info.device.type == "cuda":
        props = torch.cuda.get_device_properties(info.device)
        uuid = getattr(props, "uuid", None)  # not on every torch this project allows
        mine += f" = {props.name}" + (f" (UUID GPU-{uuid})" if uuid is not None else "")
    mine += f", CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    devices = dist.all_gather_object(mine)
    log = get_logger()
    log.info("devices:\n  " + "\n  ".join(devices))
    if info.world_size == 1:
        log.info("running alone: one process, no process group, no DistributedDataParallel")
    log.info(
        f"world size {info.world_size}, batch {cfg.batch_size} per process, global batch "
        f"{cfg.batch_size * info.world_size}, {rt.steps_per_epoch} step(s) per epoch, "
        f"{cfg.samples_per_epoch // info.world_size} sample(s) per rank per epoch, {cfg.num_workers} DataLoader "
        f"worker(s) per process, {rt.cpus_per_rank:.3g} CPU(s) per rank on this node"
    )
    log.info(
        f"data {run.data_dir}: {len(run.train)} training, {len(run.val)} validation case(s), "
        f"classes {run.spec.class_names}, cache {run.cache}"
    )
    log.info(run.plan.describe())
    if rt.is_main:
        run.plan.write(rt.out_dir / "plan.json")
    log.info(
        f"precision {rt.amp_dtype or torch.float32}, memory format {format_name(rt.memory_format)}, deep "
        f"supervision {cfg.deep_supervision}, augmentation {cfg.augmentation}; checkpoints in "
        f"{rt.out_dir / 'checkpoints'}, TensorBoard logs in {rt.out_dir / 'tensorboard'}, per-rank logs in "
        f"{rt.out_dir / 'logs'}; configuration:\n  "
        + "\n  ".join(f"{k} = {v}" for k, v in dataclasses.asdict(cfg).items())
    )


def wrap_for_training(rt: Runtime, model: torch.nn.Module) -> torch.nn.Module:
    """What the training forward pass runs through: DDP with several ranks (the model itself alone: no
    process group, nothing to synchronise), compiled with --compile. Checkpoints and validation keep
    using the unwrapped model."""
    wrapped = model
    if dist.is_dist():
        device_ids = [rt.dist.local_rank] if rt.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return torch.compile(wrapped) if rt.cfg.compile else wrapped
