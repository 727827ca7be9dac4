"""One case into the planned space: reorient, crop, normalise, resample; the same steps for training's cache,
for validation and for evaluate.py, so the numbers they report are computed on the same arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import ndimage

from data.acquisitions import plane_distance, voxel_ratios
from data.geometry import (
    IDENTITY_ORNT,
    Geometry,
    canonical_ornt,
    nonzero_box,
    reorient,
    reoriented_spacing,
    resample_image,
    resample_label_shares,
    resampled_shape,
    separate_axis,
    spacing_of,
)
from data.plan import Plan


@dataclass(frozen=True)
class Planned:
    image: np.ndarray  # (C, *planned_shape) float32, normalised; with the plan's acquisition channel last
    label: np.ndarray | None  # (*planned_shape) uint8, when a label was given
    geometry: Geometry
    # with a label: (2, *planned_shape) uint8, per voxel the runner-up class and its share in 255ths
    # (`data.geometry.resample_label_shares`): the soft training targets
    label_share: np.ndarray | None = None


def nonzero_mask(image: np.ndarray) -> np.ndarray:
    """(X, Y, Z) bool: where any channel of `image` (C, X, Y, Z) is non-zero, with enclosed holes filled (a
    zero voxel inside the anatomy is anatomy), as nnU-Net's crop mask."""
    return ndimage.binary_fill_holes(np.any(image != 0, axis=0))


def normalize(image: np.ndarray, normalization: Sequence[dict[str, Any]]) -> np.ndarray:
    """Per channel, the plan's scheme: `zscore` (per case; with `mask`, inside `nonzero_mask` and 0 outside),
    `ct` (clip to the dataset's foreground 0.5 and 99.5 percentiles, z-score with its foreground mean and std)
    or `ct-per-case` (clip to this case's own 0.5 and 99.5 percentiles, then z-score: the rule before plans
    existed).

    Args:
        image: (C, X, Y, Z) float32, one entry of `normalization` per channel.
    """
    if len(normalization) != image.shape[0]:
        raise ValueError(f"image has {image.shape[0]} channel(s) but the plan normalises {len(normalization)}")
    out = np.empty(image.shape, dtype=np.float32)
    inside = nonzero_mask(image) if any(rule.get("mask") for rule in normalization) else None
    for c, rule in enumerate(normalization):
        channel = image[c]
        if rule.get("mask") and inside is not None and inside.any():  # zscore inside the mask, 0 outside
            values = channel[inside]
            mean, std = float(values.mean(dtype=np.float64)), float(values.std(dtype=np.float64))
            out[c] = np.where(inside, (channel - mean) / max(std, 1e-8), 0.0)
            continue
        if rule["scheme"] == "ct":
            lo, hi = rule["clip"]
            out[c] = (np.clip(channel, lo, hi) - rule["mean"]) / rule["std"]
            continue
        if rule["scheme"] == "ct-per-case":
            lo, hi = np.percentile(channel, [0.5, 99.5])
            channel = np.clip(channel, lo, hi)
        elif rule["scheme"] != "zscore":
            raise ValueError(f"unknown normalisation scheme {rule['scheme']!r}")
        mean, std = float(channel.mean(dtype=np.float64)), float(channel.std(dtype=np.float64))  # a constant: 0
        out[c] = (channel - mean) / max(std, 1e-8)
    return out


def preprocess(
    image: np.ndarray, affine: np.ndarray, plan: Plan, label: np.ndarray | None = None, num_classes: int = 0
) -> Planned:
    """`image` (C, X, Y, Z) as read from a file with `affine` (and its `label` (X, Y, Z)) into the plan's space.

    Reoriented by permutation and flips; cropped to the image's non-zero box; normalised; resampled to the
    target spacing (linear; a thick axis on its own, also linearly, which needs less memory; labels through each class's
    interpolated mask, so no class is invented). `num_classes` is needed with a label. Where the plan has an
    acquisition channel, it is appended last (`data.acquisitions.plane_distance`), after normalisation.
    """
    ornt = canonical_ornt(affine) if plan.orientation == "RAS" else IDENTITY_ORNT
    native_shape = tuple(int(s) for s in image.shape[1:])
    image = reorient(image, ornt)
    label = reorient(label, ornt) if label is not None else None
    box = nonzero_box(image) if plan.crop == "nonzero" else tuple((0, s) for s in image.shape[1:])
    crop = (slice(None), *(slice(lo, hi) for lo, hi in box))
    image = normalize(np.asarray(image[crop], dtype=np.float32), plan.normalization)
    label = np.asarray(label[crop[1:]]) if label is not None else None
    spacing = reoriented_spacing(spacing_of(affine), ornt)
    shape = resampled_shape(image.shape[1:], spacing, plan.spacing) if plan.spacing else image.shape[1:]
    axis = separate_axis(spacing, plan.spacing) if plan.spacing else None
    geometry = Geometry(
        native_shape=native_shape,
        native_affine=tuple(tuple(float(v) for v in row) for row in np.asarray(affine)),
        ornt=tuple(tuple(float(v) for v in row) for row in ornt),
        crop=box,
        canonical_spacing=spacing,
        planned_shape=tuple(int(s) for s in shape),
        separate_axis=axis,
    )
    cropped = image.shape[1:]
    image = resample_image(image, shape, axis, plan.extra_channels)
    if plan.acquisition_channel:
        image[-1] = plane_distance(cropped, shape, voxel_ratios(spacing, plan.spacing))
    share = None
    if label is not None:
        label, share = resample_label_shares(label, shape, axis, num_classes)
    return Planned(image, label, geometry, share)
