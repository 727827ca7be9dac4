"""Data pipeline benchmarks: patches per second, and memory per rank, against MONAI's usual pipeline."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from torch.utils.data import DataLoader

from data.cache import build_cache, open_case
from data.dataset import EpochSampler, PatchDataset
from data.msd import DatasetSpec
from data.plan import legacy_plan


def ours_per_worker(
    cache: Path, spec: DatasetSpec, patch: Sequence[int], samples: int, augmentation: str = "basic"
) -> float:
    """Patches per second of one worker: our dataset read in-process (memory-mapped cache, augmentation)."""
    cases = [open_case(c, cache) for c in spec.training]
    dataset = PatchDataset(cases, patch, samples_per_epoch=samples, seed=1, augmentation=augmentation)
    dataset[(0, 0)]
    began = time.perf_counter()
    for i in range(samples):
        dataset[(1, i)]
    return samples / (time.perf_counter() - began)


def ours_loader(
    cache: Path, spec: DatasetSpec, patch: Sequence[int], batch: int, workers: int, world: int, batches: int
) -> float:
    """Patches per second one rank's DataLoader delivers with `workers` worker processes."""
    samples = batches * batch * world
    dataset = PatchDataset([open_case(c, cache) for c in spec.training], patch, samples_per_epoch=samples, seed=1)
    sampler = EpochSampler(dataset, num_replicas=world, rank=0, shuffle=True, seed=0)
    loader = DataLoader(
        dataset, batch_size=batch, sampler=sampler, num_workers=workers, drop_last=True, persistent_workers=workers > 0
    )
    sampler.set_epoch(0)
    for _ in loader:  # start the workers, warm the page cache
        pass
    sampler.set_epoch(1)
    began = time.perf_counter()
    count = sum(len(images) for images, _ in loader)
    return count / (time.perf_counter() - began)


def monai_transforms(patch: Sequence[int], cached: bool):
    """MONAI's usual 3D segmentation pipeline; `cached` gives only its deterministic part (what CacheDataset
    keeps in memory) or the random crop and flips that follow it."""
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        LoadImaged,
        NormalizeIntensityd,
        RandCropByPosNegLabeld,
        RandFlipd,
    )

    keys = ["image", "label"]
    deterministic = [LoadImaged(keys), EnsureChannelFirstd(keys), NormalizeIntensityd(keys="image")]
    random = [
        RandCropByPosNegLabeld(keys, label_key="label", spatial_size=list(patch), pos=1, neg=2, num_samples=1),
        RandFlipd(keys, prob=0.5, spatial_axis=0),
        RandFlipd(keys, prob=0.5, spatial_axis=1),
        RandFlipd(keys, prob=0.5, spatial_axis=2),
    ]
    return Compose(deterministic if cached else deterministic + random), Compose(random)


def monai_per_worker(spec: DatasetSpec, patch: Sequence[int], samples: int) -> float:
    """Patches per second of one worker running MONAI's uncached pipeline on the same NIfTI files."""
    transform, _ = monai_transforms(patch, cached=False)
    files = [{"image": str(c.image), "label": str(c.label)} for c in spec.training]
    transform.set_random_state(0)
    transform(files[0])
    began = time.perf_counter()
    for i in range(samples):
        transform(files[i % len(files)])
    return samples / (time.perf_counter() - began)


def _memory_kib() -> dict[str, int]:
    """Anonymous resident memory (private to the process) and proportional set size (shared pages divided
    among the processes that map them), in KiB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rollup = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return {"anon": int(status["RssAnon"].split()[0]), "pss": int(rollup["Pss"].split()[0])}


def _hold_dataset(kind: str, cache: str, spec: DatasetSpec, patch: Sequence[int], barrier, results) -> None:
    torch.set_num_threads(1)
    if kind == "monai":  # imported before the baseline: only the data is measured
        from monai.data import CacheDataset

        transform, _ = monai_transforms(patch, cached=True)
    before = _memory_kib()
    if kind == "ours":
        cases = [open_case(c, cache) for c in spec.training]
        held = [float(np.asarray(c.image).sum() + np.asarray(c.label).sum()) for c in cases]  # every page read
    else:
        files = [{"image": str(c.image), "label": str(c.label)} for c in spec.training]
        held = CacheDataset(files, transform, cache_rate=1.0, num_workers=0, progress=False)
    barrier.wait()  # both ranks hold their data now
    after = _memory_kib()
    results.put({k: after[k] - before[k] for k in after})
    barrier.wait()
    del held


def memory_per_rank(kind: str, cache: Path, spec: DatasetSpec, patch: Sequence[int], ranks: int = 2) -> dict:
    """Memory each of `ranks` fresh processes adds to hold the dataset at the same time, in MiB."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(target=_hold_dataset, args=(kind, str(cache), spec, patch, barrier, results)) for _ in range(ranks)
    ]
    for p in procs:
        p.start()
    measured = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return {k: sum(m[k] for m in measured) / len(measured) / 1024 for k in measured[0]}


def dataset_bytes(spec: DatasetSpec) -> int:
    """Bytes of the training cases as float32 images and uint8 labels."""
    return sum(int(np.prod(nib.load(c.image).shape)) * 4 + int(np.prod(nib.load(c.label).shape)) for c in spec.training)


def prepare_cache(spec: DatasetSpec, cache: Path) -> None:
    """The cases as stored (no resampling: MONAI's pipeline here reads them as they are), z-scored per case."""
    plan = legacy_plan(spec.modalities, (48, 48, 32), (8, 16, 32, 64))
    errors = build_cache(spec.training, plan, spec.num_classes, cache)
    if errors:
        raise ValueError("; ".join(errors))


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
