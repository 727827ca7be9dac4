"""What to predict: the cases of a dataset split, or every NIfTI file of a folder of new scans.

A folder may hold 3D or 4D files under any name, and multi-channel cases as nnU-Net writes them, one file
per channel: CASE_0000.nii.gz, CASE_0001.nii.gz, ... (each 3D, on the same grid).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from data.geometry import same_grid
from data.msd import NIFTI_SUFFIXES, case_name
from data.nifti import load_image

CHANNEL_FILE = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})$")


@dataclass(frozen=True)
class InputCase:
    """One case to predict: its image file(s), in channel order, and its reference label if there is one."""

    name: str
    images: tuple[Path, ...]  # one 3D or 4D file, or one 3D file per channel
    label: Path | None = None


def folder_cases(folder: str | Path) -> list[InputCase]:
    """Every case of a folder of NIfTI files, sorted by name; nnU-Net channel files grouped into one case."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--images {folder}: no such folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(NIFTI_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"--images {folder}: no NIfTI files (.nii or .nii.gz) in it")
    groups: dict[str, list[tuple[int, Path]]] = {}
    single: dict[str, Path] = {}
    for path in files:
        name = case_name(path)
        match = CHANNEL_FILE.match(name)
        if match:
            groups.setdefault(match["case"], []).append((int(match["channel"]), path))
        else:
            single[name] = path
    cases = [InputCase(name, (path,)) for name, path in single.items() if name not in groups]
    for name, channels in groups.items():
        cases.append(InputCase(name, tuple(path for _, path in sorted(channels))))
    return sorted(cases, key=lambda c: c.name)


def load_case_image(case: InputCase, in_channels: int) -> tuple[np.ndarray, nib.Nifti1Image]:
    """(image (C, X, Y, Z) float32, the first file's nibabel image for its affine and header).

    Raises:
        ValueError: a file that cannot be read, channel files that are not 0000..C-1 on one grid, or a
            channel count other than the model's.
    """
    if len(case.images) == 1:
        image, nii = load_image(case.images[0])
    else:
        numbers = [int(CHANNEL_FILE.match(case_name(p))["channel"]) for p in case.images]
        if numbers != list(range(len(numbers))):
            raise ValueError(f"{case.name}: channel files {numbers} are not numbered 0000..{len(numbers) - 1:04d}")
        loaded = [load_image(p) for p in case.images]
        nii = loaded[0][1]
        for path, (array, other) in zip(case.images, loaded):
            if array.shape[0] != 1:
                raise ValueError(f"{path}: a channel file must be 3D, got {array.shape[0]} channels")
            if array.shape[1:] != loaded[0][0].shape[1:] or not same_grid(other.affine, nii.affine):
                raise ValueError(f"{path}: not on the grid of {case.images[0]}")
        image = np.concatenate([array for array, _ in loaded])
    if image.shape[0] != in_channels:
        raise ValueError(
            f"{case.name}: {image.shape[0]} channel(s) in {', '.join(map(str, case.images))}, the model takes "
            f"{in_channels}"
        )
    return image, nii
