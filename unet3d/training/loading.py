"""A rank's data: the dataset checked and cached by all ranks together, the training loader, the
rank's share of the validation cases."""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils.data import DataLoader

from data.cache import open_case
from data.dataset import EpochSampler, PatchDataset, ignore_stop_signals
from data.patches import PreparedCase
from data.prepare import DataConfig, DatasetError, RunData, dataset_problems, resolve_data, unique
from unet3d.training import dist
from unet3d.training.runtime import Runtime
from unet3d.training.validation import shard


def prepare_data(cfg: DataConfig, info: dist.DistInfo) -> RunData:
    """The run's data, every case checked and cached: each node's local rank 0 writes the synthetic
    dataset if there is none, each rank builds a share of the cache, and every rank's problems are
    gathered, so that all ranks raise the same DatasetError together."""
    run = resolve_data(cfg, lambda make: dist.run_on_local_main(make, info))
    problems = dataset_problems(run, info.local_rank, info.local_world_size)
    problems = unique([p for rank_problems in dist.all_gather_object(problems) for p in rank_problems])
    if problems:
        raise DatasetError(run.data_dir, problems)
    return run


def open_cases(run: RunData, info: dist.DistInfo) -> tuple[list[PreparedCase], list[PreparedCase]]:
    """(every training case, this rank's share of the validation cases), as memory maps of the cache."""
    train = [open_case(c, run.cache) for c in run.train]
    return train, [open_case(c, run.cache) for c in shard(run.val, info.rank, info.world_size)]


def make_loader(rt: Runtime, cases: Sequence[PreparedCase]) -> DataLoader:
    """This rank's loader of augmented patches; its EpochSampler must be told each epoch (`set_epoch`)."""
    cfg = rt.cfg
    dataset = PatchDataset(cases, cfg.patch_size, cfg.samples_per_epoch, cfg.fg_fraction, cfg.seed)
    sampler = EpochSampler(dataset, num_replicas=rt.world_size, rank=rt.dist.rank, shuffle=True, seed=cfg.seed)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=rt.device.type == "cuda",
        drop_last=True,
        persistent_workers=cfg.num_workers > 0,
        worker_init_fn=ignore_stop_signals,
    )
