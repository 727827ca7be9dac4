"""Drawing random patches from a prepared case, some of them centred on foreground voxels."""

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
    """Pad symmetrically (image with 0, the normalised mean; label with background) to at least `size`.

    Returns the padded image, label and the offset of the original voxel (0, 0, 0).
    """
    shape = np.array(label.shape)
    deficit = np.maximum(np.array(size) - shape, 0)
    before = deficit // 2
    pads = [(int(b), int(d - b)) for b, d in zip(before, deficit)]
    return np.pad(image, [(0, 0)] + pads), np.pad(label, pads), before


def sample_patch(
    case: PreparedCase,
    patch_size: Sequence[int],
    rng: np.random.Generator,
    force_fg: bool,
    matrix: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A random patch of `case`; with `force_fg`, centred on a voxel of a randomly chosen present class; with
    `matrix` (`data.augment.spatial_transform`), sampled on a rotated and scaled grid about the same centre.

    Returns:
        image (C, *patch_size) float32 and label (*patch_size) uint8, contiguous copies.
    """
    image, label, offset = case.image, case.label, np.zeros(3, dtype=np.int64)
    if any(s < p for s, p in zip(label.shape, patch_size)):
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
        return sample_transformed(image, label, start + (patch - 1) / 2, patch, matrix)
    sl = tuple(slice(int(s), int(s + p)) for s, p in zip(start, patch))
    return np.ascontiguousarray(image[(slice(None),) + sl]), np.ascontiguousarray(label[sl])
