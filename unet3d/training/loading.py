"""A rank's data: the dataset checked and cached by all ranks together, the training loader, the
rank's share of the validation cases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import DataLoader

from data.cache import open_case
from data.dataset import EpochSampler, PatchDataset, ignore_stop_signals
from data.patches import PreparedCase
from data.plan import Plan, PlanRequest, crop_losses, oblique_cases, plan_differences, unoriented_cases
from data.prepare import (
    DatasetError,
    RunData,
    build,
    fingerprints,
    inspect,
    keep_split,
    plan_data,
    resolve_data,
    unique,
)
from unet3d.training import dist
from unet3d.training.checkpointing import saved_plan
from unet3d.training.config import TrainConfig, plan_request
from unet3d.training.faults import slow_data
from unet3d.training.logs import get_logger
from unet3d.training.runtime import Runtime
from unet3d.training.validation import shard


def prepare_data(cfg: TrainConfig, info: dist.DistInfo, checkpoint: dict[str, Any] | None) -> RunData:
    """The run's data, every case checked, planned and cached, the same on every rank.

    Each node's local rank 0 writes the synthetic dataset if there is none; each rank checks and
    fingerprints a share of the cases, then caches a share in the plan's space; every rank's problems are
    gathered after each stage, so that all ranks raise the same DatasetError together. The plan is rank 0's
    (made from the fingerprints, or the one `checkpoint` was trained with), handed to every rank.
    """
    run = resolve_data(cfg.data(), lambda make: dist.run_on_local_main(make, info))
    run, note = keep_split(run, (checkpoint or {}).get("split"))
    if note:
        get_logger().warning(f"warning: {note}")
    request = plan_request(cfg, info.device.type)
    _raise_gathered(run, inspect(run, request, info.local_rank, info.local_world_size))
    plan = dist.run_on_main(lambda: choose_plan(run, request, checkpoint))
    run = run.with_plan(plan)
    _raise_gathered(run, build(run, info.local_rank, info.local_world_size))
    return run


def choose_plan(run: RunData, request: PlanRequest, checkpoint: dict[str, Any] | None) -> Plan:
    """A new run's plan from its data; a resumed run's from its checkpoint, saying where the data no longer
    fits it (the run continues with the checkpoint's plan)."""
    found = fingerprints(run, request)  # read once, for the warning and the plan
    orientation = request.orientation
    for warning in (crop_losses(found), oblique_cases(found, orientation), unoriented_cases(found, orientation)):
        if warning:
            get_logger().warning(f"warning: {warning}")
    saved = saved_plan(checkpoint, run.spec) if checkpoint is not None else None
    if saved is None:
        return plan_data(run, request, found)
    if "plan" in checkpoint:
        differences = plan_differences(saved, plan_data(run, request, found))
        if differences:
            get_logger().warning(
                "the data no longer fits the checkpoint's plan (" + "; ".join(differences) + "): continuing with "
                "the checkpoint's plan"
            )
    return saved


def _raise_gathered(run: RunData, problems: list[str]) -> None:
    problems = unique([p for rank_problems in dist.all_gather_object(problems) for p in rank_problems])
    if problems:
        raise DatasetError(run.data_dir, problems)


def open_cases(run: RunData, info: dist.DistInfo) -> tuple[list[PreparedCase], list[PreparedCase]]:
    """(every training case, this rank's share of the validation cases), as memory maps of the cache."""
    train = [open_case(c, run.cache) for c in run.train]
    return train, [open_case(c, run.cache) for c in shard(run.val, info.rank, info.world_size)]


def make_loader(rt: Runtime, cases: Sequence[PreparedCase], acquisition_channel: bool = False) -> DataLoader:
    """This rank's loader of augmented patches; its EpochSampler must be told each epoch (`set_epoch`).
    `acquisition_channel`: the cases carry the plan's acquisition channel last (`Plan.acquisition_channel`)."""
    cfg = rt.cfg
    patches = PatchDataset(
        cases,
        cfg.patch_size,
        cfg.samples_per_epoch,
        cfg.fg_fraction,
        cfg.seed,
        cfg.augmentation,
        simulate_thick_slices=cfg.simulate_thick_slices == "auto",
        acquisition_channel=acquisition_channel,
        soft_labels=cfg.label_targets == "soft",
    )
    if patches.acquisitions:  # said, since `auto` alone does not tell whether the dataset has thick slices
        slabs = ", ".join(f"{'xyz'[axis]} in slabs of {t:g} planned voxels" for axis, t in patches.acquisitions)
        get_logger().info(f"simulated thick slices: a third of the fine cases' patches re-acquired as ({slabs})")
    dataset = slow_data(patches, rt.dist.rank)
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
