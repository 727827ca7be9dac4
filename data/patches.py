"""Drawing random patches from a prepared case, some of them centred on foreground voxels.

Soft targets: a patch's label can come as (3, X, Y, Z) uint8, the planned label, the runner-up class and the
runner-up's share in 255ths (`data.geometry.resample_label_shares`); `unet3d.loss.target_probabilities`
turns it into class probabilities on the device. Only a case resampled to a coarser grid has shares; for
the others the last two planes are 0 and the targets are the hard labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data.augment import sample_transformed
from data.geometry import Geometry

MAX_FG_COORDS = 20_000  # foreground voxels kept per class to draw patch centres from


@dataclass
class PreparedCase:
    """A case in the planned space, ready for patch sampling, with what validation needs to score it on the
    file's own grid."""

    name: str
    image: np.ndarray  # (C, X, Y, Z) float32, normalised; often a read-only memory map
    label: np.ndarray  # (X, Y, Z) uint8
    fg_coords: dict[int, np.ndarray]  # class -> (N, 3) int voxel coordinates of that class
    native_label: np.ndarray | None = None  # the label as stored in its file (its own shape and orientation)
    geometry: Geometry | None = None  # how the case came into the planned space (`data.geometry`)
    label_share: np.ndarray | None = None  # (2, X, Y, Z) uint8: runner-up class and share (the module's doc)


def foreground_coords(label: np.ndarray, seed: int = 0) -> dict[int, np.ndarray]:
    """Per foreground class present in `label`, up to MAX_FG_COORDS of its voxel coordinates."""
    rng = np.random.default_rng(seed)
    coords = {}
    for cls in np.unique(label):
        if cls == 0:
            continue
        where = np.argwhere(label == cls)
        if len(where) > MAX_FG_COORDS:
            where = where[rng.choice(len(where), MAX_FG_COORDS, replace=False)]
        coords[int(cls)] = where.astype(np.int32)
    return coords


def _pad_to(image: np.ndarray, label: np.ndarray, size: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pad symmetrically (image with 0, the normalised mean; label with background, and a soft label's
    runner-up and share with 0) to at least `size` along the last three axes.

    Returns the padded image, label and the offset of the original voxel (0, 0, 0).
    """
    shape = np.array(label.shape[-3:])
    deficit = np.maximum(np.array(size) - shape, 0)
    before = deficit // 2
    pads = [(int(b), int(d - b)) for b, d in zip(before, deficit)]
    lead = [(0, 0)] * (label.ndim - 3)
    return np.pad(image, [(0, 0)] + pads), np.pad(label, lead + pads), before


def sample_patch(
    case: PreparedCase,
    patch_size: Sequence[int],
    rng: np.random.Generator,
    force_fg: bool,
    matrix: np.ndarray | None = None,
    soft: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """A random patch of `case`; with `force_fg`, centred on a voxel of a randomly chosen present class; with
    `matrix` (`data.augment.spatial_transform`), sampled on a rotated and scaled grid about the same centre.
    Only the patch is read of the case's arrays (they may be memory maps).

    Returns:
        image (C, *patch_size) float32 and label (*patch_size) uint8, contiguous copies; with `soft`, the
        label is (3, *patch_size) uint8 (label, runner-up class, share: the module's soft targets).
    """
    image, label, offset = case.image, case.label, np.zeros(3, dtype=np.int64)
    share = case.label_share if soft else None
    if soft and share is None:
        share = np.zeros((2, *label.shape), np.uint8)  # hard targets: a case without shares
    if any(s < p for s, p in zip(label.shape, patch_size)):
        if share is not None:
            share = _pad_to(image[:0], share, patch_size)[1]
        image, label, offset = _pad_to(image, label, patch_size)
    patch = np.array(patch_size)
    highest = np.array(label.shape) - patch  # largest valid start per axis
    if force_fg and case.fg_coords:
        classes = sorted(case.fg_coords)
        coords = case.fg_coords[classes[rng.integers(len(classes))]]
        centre = coords[rng.integers(len(coords))] + offset
        start = np.clip(centre - patch // 2, 0, highest)
    else:
        start = np.array([rng.integers(h + 1) for h in highest])
    if matrix is not None:
        return sample_transformed(image, label, start + (patch - 1) / 2, patch, matrix, share)
    sl = tuple(slice(int(s), int(s + p)) for s, p in zip(start, patch))
    out = np.ascontiguousarray(label[sl])
    if share is not None:
        out = np.concatenate([out[None], share[(slice(None), *sl)]])
    return np.ascontiguousarray(image[(slice(None),) + sl]), out
