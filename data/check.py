"""Checks of a dataset's content, each problem named with its file, so a bad dataset stops a run at once."""

from __future__ import annotations

from collections.abc import Sequence

import nibabel as nib
import numpy as np

from data.geometry import affine_problems, same_grid
from data.msd import Case, DatasetSpec


def case_problems(
    case: Case,
    image: np.ndarray,
    image_nii: nib.Nifti1Image,
    label: np.ndarray,
    label_nii: nib.Nifti1Image,
    num_classes: int,
    modalities: Sequence[str],
) -> list[str]:
    """Everything wrong with one case: its geometry (a 2D image, zero or non-finite voxel sizes, a singular or
    sheared affine), a channel count other than dataset.json's modalities, image and label on different grids
    (shape, or positions in world space), non-finite intensities, undeclared label values.

    Args:
        image: (C, X, Y, Z) intensities as read; label: (X, Y, Z) values as read.
        modalities: dataset.json's modality per input channel.
    """
    problems = affine_problems(image_nii.affine, image.shape[1:], case.image)
    if image.shape[0] != len(modalities):
        problems.append(
            f"{case.image} has {image.shape[0]} channel(s) but dataset.json 'modality' declares {len(modalities)} "
            f"({', '.join(modalities)})"
        )
    non_finite = int(np.count_nonzero(~np.isfinite(image)))
    if non_finite:
        problems.append(f"{case.image}: {non_finite} NaN or infinite value(s)")
    return problems + label_problems(case.image, image.shape[1:], image_nii, case.label, label, label_nii, num_classes)


def label_problems(
    image_path: object,
    image_shape: Sequence[int],
    image_nii: nib.Nifti1Image,
    label_path: object,
    label: np.ndarray,
    label_nii: nib.Nifti1Image,
    num_classes: int,
) -> list[str]:
    """A label map that is not on its image's grid (shape, or positions in world space) or holds values that
    dataset.json does not declare: training refuses the case, evaluation does not score it."""
    problems = []
    if tuple(image_shape) != label.shape:
        problems.append(f"{image_path} has spatial shape {tuple(image_shape)} but {label_path} has {label.shape}")
    elif not same_grid(image_nii.affine, label_nii.affine):
        gap = float(np.abs(image_nii.affine - label_nii.affine).max())
        problems.append(
            f"{label_path}: its voxels are not where those of {image_path} are in world space (the affines differ "
            f"by up to {gap:.4g})"
        )
    values = np.unique(label)
    undeclared = values[values >= num_classes]
    if len(undeclared):
        problems.append(
            f"{label_path}: label value(s) {undeclared.tolist()} not declared in dataset.json "
            f"'labels' (0..{num_classes - 1})"
        )
    return problems


def missing_files(cases: Sequence[Case]) -> list[str]:
    """A problem line for every listed image or label that does not exist."""
    return [f"{p}: listed in dataset.json but missing" for c in cases for p in (c.image, c.label) if not p.is_file()]


def split_problems(spec: DatasetSpec, num_val: int, fold_all: bool = False) -> list[str]:
    """Validation needs at least one case (unless cross-validation's fold "all" trains on every case);
    ranks beyond the number of cases take part with none."""
    if num_val == 0 and not fold_all:
        return [
            f"{spec.root / 'dataset.json'}: the split holds out no validation case; raise --val-fraction "
            f"above 0 (with {len(spec.training)} training case(s), 1 / {len(spec.training)} holds out one)"
        ]
    return []
