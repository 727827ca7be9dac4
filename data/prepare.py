"""A run's data: which dataset, its split, its plan, its preprocessing cache, and every problem with it.

In two stages, each sharded over processes: `inspect` checks and fingerprints every training case (and
finds missing files and an empty split), then, once the plan is made from the fingerprints, `build`
brings every case into the plan's space in the cache. Used twice: by `train_ddp.py --prepare-only`, which
launch.sh runs before it starts any rank (so a bad dataset gives one message and no torchrun restarts),
and by every rank at start, where everything is then fresh and the stages cost little.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from data.cache import build_cache, fingerprint_cases, load_fingerprints
from data.check import missing_files, split_problems
from data.msd import Case, DatasetSpec, load_dataset_json, run_split
from data.plan import Fingerprint, Plan, PlanRequest, make_plan
from data.synthetic import folder_name, write_synthetic_dataset


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message lists every problem with its file."""

    def __init__(self, root: Path, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s) with the dataset {root}:\n  " + "\n  ".join(problems))


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What chooses a run's data (the data fields of the training configuration)."""

    data_dir: str | None  # dataset in the MSD layout; None: the synthetic dataset
    synthetic_dir: str
    synthetic_cases: int
    synthetic_size: int
    synthetic_geometry: str  # uniform or mixed (`data.synthetic`)
    cache_dir: str | None  # None: runs/cache/<dataset>-<hash>
    val_fraction: float
    seed: int
    fold: str | None = None  # cross-validation: 0..folds-1 or all; None: hold out val_fraction
    folds: int = 5

    @property
    def synthetic_path(self) -> Path:
        name = folder_name(self.synthetic_cases, self.synthetic_size, self.seed, self.synthetic_geometry)
        return Path(self.synthetic_dir) / name


@dataclass(frozen=True)
class RunData:
    """The run's dataset, its split into training and validation cases, its plan (once made) and cache."""

    data_dir: Path
    spec: DatasetSpec
    train: list[Case]
    val: list[Case]
    cache_root: Path  # fingerprints, and one folder per plan
    plan: Plan | None = None
    fold_all: bool = False  # cross-validation's "all": every case trains, none validates

    @property
    def cache(self) -> Path:
        """The folder of this plan's preprocessed cases."""
        if self.plan is None:
            raise ValueError("the run has no plan yet")
        return self.cache_root / self.plan.digest()

    def with_plan(self, plan: Plan) -> RunData:
        return replace(self, plan=plan)


def keep_split(run: RunData, saved: dict[str, list[str]] | None) -> tuple[RunData, str | None]:
    """A resumed run's split: the validation cases its checkpoint validated on (`saved`, the names of its
    "train" and "val"), where the data's split now differs (a case added or removed, another --seed), and
    every other case trains; with a note naming what changed. Recomputed, the split moved cases trained on
    into validation and the other way round, and best.pt went on being chosen against a Dice measured on
    other cases. As recomputed when nothing differs, with --fold all, or when none of those cases is left."""
    if not saved or run.fold_all or "val" not in saved:
        return run, None
    by_name = {c.name: c for c in run.spec.training}
    kept = [by_name[n] for n in saved["val"] if n in by_name]
    if not kept or [c.name for c in kept] == [c.name for c in run.val] and len(kept) == len(saved["val"]):
        return run, None
    held = {c.name for c in kept}
    train = [c for c in run.spec.training if c.name not in held]
    known = set(saved.get("train", [])) | set(saved["val"])
    added = sorted(set(by_name) - known)
    gone = sorted(known - set(by_name))
    note = (
        f"the data's split differs from the checkpoint's ({', '.join(c.name for c in run.val)} would validate): "
        f"keeping its {len(kept)} validation case(s), {', '.join(sorted(held))}"
        + (f"; new case(s) {', '.join(added[:10])} train" if added else "")
        + (f"; case(s) {', '.join(gone[:10])} are gone" if gone else "")
    )
    return replace(run, train=train, val=kept), note


def default_cache_dir(data_dir: Path) -> Path:
    digest = hashlib.sha1(str(data_dir.resolve()).encode()).hexdigest()[:8]
    return Path("runs/cache") / f"{data_dir.resolve().name}-{digest}"


def resolve_data(cfg: DataConfig, run_once: Callable[[Callable[[], Path]], Path]) -> RunData:
    """The run's dataset (written by `run_once` when synthetic), its split and its cache folder.

    Raises FileNotFoundError / ValueError for a missing or malformed dataset.json; missing image files are
    left to `dataset_problems`, which reports them with everything else.
    """
    if cfg.data_dir is not None:
        data_dir = Path(cfg.data_dir)
    else:
        make = functools.partial(
            write_synthetic_dataset,
            cfg.synthetic_path,
            cfg.synthetic_cases,
            cfg.synthetic_size,
            cfg.seed,
            geometry=cfg.synthetic_geometry,
        )
        data_dir = Path(run_once(make))
    spec = load_dataset_json(data_dir, require_files=False)
    train, val = run_split(spec.training, cfg.val_fraction, cfg.seed, cfg.fold, cfg.folds)
    cache = Path(cfg.cache_dir) if cfg.cache_dir is not None else default_cache_dir(data_dir)
    return RunData(data_dir, spec, train, val, cache, fold_all=cfg.fold == "all")


def _present(run: RunData) -> list[Case]:
    return [c for c in run.spec.training if c.image.is_file() and c.label.is_file()]


def inspect(run: RunData, request: PlanRequest, shard: int = 0, num_shards: int = 1) -> list[str]:
    """Stage 1, this shard's part: missing files and the split, then every present case checked and
    fingerprinted (fingerprints are kept in the cache, so a second run reads no image)."""
    problems = missing_files(run.spec.training) + split_problems(run.spec, len(run.val), run.fold_all)
    root = run.cache_root
    return problems + fingerprint_cases(_present(run), run.spec, request, root, shard, num_shards)


def fingerprints(run: RunData, request: PlanRequest) -> list[Fingerprint]:
    """The fingerprints `inspect` left for this run's training cases."""
    return load_fingerprints(run.spec.training, request, run.cache_root)


def plan_data(run: RunData, request: PlanRequest, found: list[Fingerprint] | None = None) -> Plan:
    """The plan for this run's training cases, from their fingerprints (`found`, else read)."""
    found = fingerprints(run, request) if found is None else found
    return make_plan(found, run.spec.modalities, request)


def build(run: RunData, shard: int = 0, num_shards: int = 1) -> list[str]:
    """Stage 2, this shard's part: every case brought into the plan's space in the cache."""
    return build_cache(run.spec.training, run.plan, run.spec.num_classes, run.cache, shard, num_shards)


def _one_thread(stage: Callable[..., list[str]], args: tuple) -> list[str]:
    torch.set_num_threads(1)  # several processes share the cores: one thread each for the resampling
    return stage(*args)


def in_processes(stage: Callable[..., list[str]], run: RunData, *args: object, processes: int) -> list[str]:
    """`stage(run, *args, shard, num_shards)` over `processes` forked worker processes; every problem once."""
    processes = max(1, min(processes, len(run.spec.training), os.cpu_count() or 1))
    if processes == 1:
        return stage(run, *args)
    with ProcessPoolExecutor(processes, mp_context=get_context("fork")) as pool:
        jobs = [pool.submit(_one_thread, stage, (run, *args, i, processes)) for i in range(processes)]
        return unique([p for job in jobs for p in job.result()])


def unique(items: list[str]) -> list[str]:
    """`items` without repeats, in first-seen order (every shard reports the dataset-wide problems)."""
    return list(dict.fromkeys(items))
