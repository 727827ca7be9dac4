"""The training dataset: an epoch of random augmented patches, sharded over ranks by DistributedSampler.

Each sample draws from its own generator seeded by (seed, epoch, index). The sampler hands every rank
disjoint indices and every DataLoader worker disjoint batches, so no two ranks or workers draw the same
patches, and a sample is the same whatever the number of ranks or workers (which makes runs repeatable).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from data.acquisitions import simulate, thick_acquisitions, voxel_ratios
from data.augment import AUGMENTATIONS, augment, spatial_transform
from data.patches import PreparedCase, sample_patch


class PatchDataset(Dataset):
    """`samples_per_epoch` patches per epoch, cycling through the cases in a shuffled order.

    Args:
        cases: the prepared training cases.
        patch_size: (X, Y, Z) of every patch.
        samples_per_epoch: the epoch's length, independent of the number of cases.
        fg_fraction: share of patches centred on a foreground voxel (nnU-Net: one third).
        seed: base seed of every sample's generator.
        augmentation: `basic` or `nnunet` (`data.augment`).
        simulate_thick_slices: re-acquire some patches of the fine cases as the thick-slice cases among
            `cases` were acquired (`data.acquisitions`), when there are both; nothing changes otherwise.
        acquisition_channel: the cases' last channel is the plan's acquisition channel
            (`data.acquisitions.plane_distance`): simulated thick slices set it, augmentation only moves it.
        soft_labels: labels as soft targets (3, *patch_size) uint8 (`data.patches`): a case resampled to a
            coarser grid is trained on each boundary voxel's share of its two leading classes.

    Items are addressed by (epoch, index) as `EpochSampler` yields them (a bare index means epoch 0)
    and are (image (C, *patch_size) float32, label (*patch_size) uint8) tensors, the label (3, *patch_size)
    with `soft_labels`.
    """

    def __init__(
        self,
        cases: Sequence[PreparedCase],
        patch_size: Sequence[int],
        samples_per_epoch: int,
        fg_fraction: float = 1 / 3,
        seed: int = 0,
        augmentation: str = "basic",
        simulate_thick_slices: bool = True,
        acquisition_channel: bool = False,
        soft_labels: bool = False,
    ) -> None:
        if not cases:
            raise ValueError("PatchDataset needs at least one case")
        if not 0 <= fg_fraction <= 1:
            raise ValueError(f"fg_fraction must be in [0, 1], got {fg_fraction}")
        self.cases = list(cases)
        self.patch_size = tuple(int(p) for p in patch_size)
        self.samples_per_epoch = int(samples_per_epoch)
        self.fg_fraction = fg_fraction
        self.seed = seed
        if augmentation not in AUGMENTATIONS:
            raise ValueError(f"augmentation must be one of {AUGMENTATIONS}, got {augmentation!r}")
        self.augmentation = augmentation
        # each case's voxel size in planned voxels, and the dataset's thick-slice acquisitions to simulate
        self.ratios = [
            np.ones(3) if c.geometry is None else voxel_ratios(c.geometry.canonical_spacing, c.geometry.planned_spacing)
            for c in self.cases
        ]
        self.acquisitions = thick_acquisitions(self.ratios) if simulate_thick_slices else ()
        self.acquisition_channel = acquisition_channel
        self.soft_labels = soft_labels

    def __len__(self) -> int:
        return self.samples_per_epoch

    def plan(self, epoch: int, index: int) -> tuple[int, bool, np.random.Generator]:
        """(case index, whether the patch is centred on foreground, generator) of one sample."""
        rng = np.random.default_rng([self.seed, epoch, index])
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.cases))
        return int(order[index % len(self.cases)]), bool(rng.random() < self.fg_fraction), rng

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        case_idx, force_fg, rng = self.plan(epoch, index)
        matrix = spatial_transform(rng, self.patch_size) if self.augmentation == "nnunet" else None
        image, label = sample_patch(self.cases[case_idx], self.patch_size, rng, force_fg, matrix, soft=self.soft_labels)
        extra = int(self.acquisition_channel)
        image = simulate(image, self.ratios[case_idx], self.acquisitions, rng, channel=self.acquisition_channel)
        image, label = augment(image, label, rng, self.augmentation, fixed=extra)
        return torch.from_numpy(image), torch.from_numpy(label)


class EpochSampler(DistributedSampler):
    """torch's DistributedSampler, yielding (epoch, index) so a sample's randomness follows its epoch.

    Call `set_epoch(epoch)` before every epoch, as with DistributedSampler: the shuffle order changes
    with it, and persistent DataLoader workers learn the epoch from the keys they receive.
    `set_epoch(epoch, skip=n)` leaves out this rank's first n indices of the epoch: a run stopped in the
    middle of an epoch resumes where it was, with no sample trained twice or skipped.
    """

    skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        if not 0 <= skip <= self.num_samples:
            raise ValueError(f"cannot skip {skip} of this rank's {self.num_samples} samples")
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        indices = list(super().__iter__())[self.skip :]
        return ((self.epoch, int(i)) for i in indices)

    def __len__(self) -> int:
        return self.num_samples - self.skip


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that forked it ends


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: SIGINT, SIGTERM and SIGHUP are the training process's to handle.

    A Ctrl-C reaches every process of the terminal's group; workers that died of it would break the
    training process's graceful stop. They end with their parent instead: on Linux at once, by a SIGKILL
    the kernel sends when the parent dies (the loader's own watchdog looks only every 5 s, and until then a
    SIGKILLed rank's workers keep its inherited sockets open, so the other ranks, waiting for it in a
    collective, learn of its death and torchrun restarts the job 5 s late).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # torchrun passes a hangup on to each rank's process group
    die_with_parent()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no usable libc: the loader's watchdog still ends the worker
        return
    if os.getppid() != parent:  # the parent died while the request was being made
        os._exit(0)


def close_loader(loader: DataLoader) -> None:
    """Stop a DataLoader's persistent worker processes now.

    After an exception the iterator that owns them stays referenced by the traceback, and since the
    workers ignore SIGTERM (`ignore_stop_signals`), the interpreter's exit would wait for them forever.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None
