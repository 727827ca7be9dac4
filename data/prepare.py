"""A run's data: which dataset, its split, its preprocessing cache, and every problem with it.

Used twice: by `train_ddp.py --prepare-only`, which launch.sh runs before it starts any rank (so a bad
dataset gives one message and no torchrun restarts), and by every rank at start, where the cache is
then fresh and the check costs little.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from data.cache import build_cache
from data.check import missing_files, split_problems
from data.msd import Case, DatasetSpec, load_dataset_json, split_cases
from data.synthetic import write_synthetic_dataset


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
    cache_dir: str | None  # None: runs/cache/<dataset>-<hash>
    val_fraction: float
    seed: int

    @property
    def synthetic_path(self) -> Path:
        name = f"cases{self.synthetic_cases}_size{self.synthetic_size}_seed{self.seed}"
        return Path(self.synthetic_dir) / name


@dataclass(frozen=True)
class RunData:
    """The run's dataset, its split into training and validation cases, and its preprocessing cache."""

    data_dir: Path
    spec: DatasetSpec
    train: list[Case]
    val: list[Case]
    cache: Path


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
            write_synthetic_dataset, cfg.synthetic_path, cfg.synthetic_cases, cfg.synthetic_size, cfg.seed
        )
        data_dir = Path(run_once(make))
    spec = load_dataset_json(data_dir, require_files=False)
    train, val = split_cases(spec.training, cfg.val_fraction, cfg.seed)
    cache = Path(cfg.cache_dir) if cfg.cache_dir is not None else default_cache_dir(data_dir)
    return RunData(data_dir, spec, train, val, cache)


def dataset_problems(run: RunData, shard: int = 0, num_shards: int = 1) -> list[str]:
    """Missing files, the split, and the content of this shard's cases (building their cache on the way)."""
    present = [c for c in run.spec.training if c.image.is_file() and c.label.is_file()]
    problems = missing_files(run.spec.training) + split_problems(run.spec, len(run.val))
    return problems + build_cache(present, run.spec.modalities, run.spec.num_classes, run.cache, shard, num_shards)


def _shard_problems(args: tuple[RunData, int, int]) -> list[str]:
    return dataset_problems(*args)


def check_dataset(run: RunData, processes: int) -> list[str]:
    """Every problem of the dataset, the cases checked and cached by `processes` worker processes."""
    processes = max(1, min(processes, len(run.spec.training)))
    if processes == 1:
        return dataset_problems(run)
    with ProcessPoolExecutor(processes, mp_context=get_context("fork")) as pool:
        shards = pool.map(_shard_problems, [(run, i, processes) for i in range(processes)])
        return unique([p for shard in shards for p in shard])


def unique(items: list[str]) -> list[str]:
    """`items` without repeats, in first-seen order (every shard reports the dataset-wide problems)."""
    return list(dict.fromkeys(items))
