"""A synthetic segmentation dataset written in the MSD layout, so the default run uses the real loader.

Each case is an MR-like volume: a body of soft tissue holding one or two ellipsoidal "organs" (class 1),
some with a darker "lesion" inside (class 2), a bright vessel-like tube left unlabelled as a distractor,
a smooth multiplicative bias field (intensity inhomogeneity) and Gaussian noise. Everything follows from
the seed, and spacing is anisotropic (1 x 1 x 1.5 mm) like many clinical scans.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np

from unet3d.files import temp_path

SPACING = (1.0, 1.0, 1.5)
LABELS = {"0": "background", "1": "organ", "2": "lesion"}


def _ellipsoid(grid: tuple[np.ndarray, ...], centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) <= 1.0


def generate_case(rng: np.random.Generator, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic case.

    Returns:
        image (X, Y, Z) float32 and label (X, Y, Z) uint8 with values 0, 1, 2.
    """
    size = np.array(shape, dtype=np.float64)
    grid = np.meshgrid(*[np.arange(s, dtype=np.float32) for s in shape], indexing="ij")
    label = np.zeros(shape, np.uint8)
    image = np.full(shape, 20.0, np.float32)  # air
    body = _ellipsoid(grid, size / 2 + rng.normal(0, 1, 3), size * rng.uniform(0.42, 0.48, 3))
    image[body] = 100.0
    for _ in range(rng.integers(1, 3)):
        radii = size * rng.uniform(0.14, 0.22, 3)
        centre = size * rng.uniform(0.3, 0.7, 3)
        organ = _ellipsoid(grid, centre, radii) & body
        label[organ] = 1
        image[organ] = 150.0
        if rng.random() < 0.8:
            lesion = _ellipsoid(grid, centre + rng.normal(0, 0.2, 3) * radii, radii * rng.uniform(0.4, 0.65))
            lesion &= organ
            label[lesion] = 2
            image[lesion] = 40.0
    # A bright tube through the body, as bright as an organ but unlabelled: intensity alone won't do.
    axis, (a, b) = rng.integers(3), rng.uniform(0.3, 0.7, 2) * size[:2]
    others = [g for i, g in enumerate(grid) if i != axis]
    tube = ((others[0] - a) ** 2 + (others[1] - b) ** 2 <= (0.04 * size.min()) ** 2) & body & (label == 0)
    image[tube] = 150.0
    # Smooth multiplicative bias field, then noise.
    field = np.ones(shape, np.float32)
    for g, s in zip(grid, size):
        field += 0.15 * np.cos(2 * np.pi * (g / s) * rng.uniform(0.3, 1.0) + rng.uniform(0, 2 * np.pi))
    image = image * field + rng.normal(0, 15.0, shape).astype(np.float32)
    return image.astype(np.float32), label


def _affine() -> np.ndarray:
    return np.diag([*SPACING, 1.0])


def write_synthetic_dataset(
    root: str | Path, num_cases: int = 24, size: int = 64, seed: int = 0, num_test: int = 4
) -> Path:
    """Write `num_cases` training and `num_test` test cases (with labelsTs/) under `root`.

    The files are written to a temporary sibling folder which is then renamed to `root`, so a reader
    never sees a half-written dataset. An existing complete `root` is reused as it is.
    """
    root = Path(root)
    if (root / "dataset.json").is_file():
        return root
    if num_cases < 2 or size < 8:
        raise ValueError(f"need num_cases >= 2 and size >= 8, got {num_cases}, {size}")
    tmp = temp_path(root)  # unique per host and process: nodes may share the folder
    for sub in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        (tmp / sub).mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shape = (size, size, int(round(size / SPACING[2] * SPACING[0])) // 8 * 8 or 8)
    training, test = [], []
    for i in range(num_cases + num_test):
        image, label = generate_case(rng, shape)
        is_test = i >= num_cases
        name = f"synth_{i:03d}.nii.gz"
        img_dir, lbl_dir = ("imagesTs", "labelsTs") if is_test else ("imagesTr", "labelsTr")
        nib.save(nib.Nifti1Image(image, _affine()), tmp / img_dir / name)
        nib.save(nib.Nifti1Image(label, _affine()), tmp / lbl_dir / name)
        if is_test:
            test.append(f"./imagesTs/{name}")
        else:
            training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    meta = {
        "name": "Synthetic",
        "description": f"synthetic MR-like volumes, seed {seed}",
        "tensorImageSize": "3D",
        "modality": {"0": "MRI"},
        "labels": LABELS,
        "numTraining": len(training),
        "numTest": len(test),
        "training": training,
        "test": test,
    }
    (tmp / "dataset.json").write_text(json.dumps(meta, indent=2))
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / "dataset.json").is_file():
            raise
    return root
