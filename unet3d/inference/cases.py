"""What to predict: the cases of a dataset split, or every NIfTI file of a folder of new scans.

A folder may hold 3D or 4D files under any name, and multi-channel cases as nnU-Net writes them, one file
per channel: CASE_0000.nii.gz, CASE_0001.nii.gz, ... (each 3D, on the same grid). Names that merely end in
four digits (AMOS's amos_0001.nii.gz) are cases of their own, and hidden files (the ._CASE.nii.gz that macOS
left beside every file in the Decathlon's archives) are not cases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from data.geometry import affine_problems, same_grid
from data.msd import NIFTI_SUFFIXES, case_name
from data.nifti import load_image

CHANNEL_FILE = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})$")


@dataclass(frozen=True)
class InputCase:
    """One case to predict: its image file(s), in channel order, and its reference label if there is one."""

    name: str
    images: tuple[Path, ...]  # one 3D or 4D file, or one 3D file per channel
    label: Path | None = None


def folder_cases(folder: str | Path, in_channels: int) -> list[InputCase]:
    """Every case of a folder of NIfTI files, sorted by name; nnU-Net channel files grouped into one case.

    NAME_0000, NAME_0001, ... are the channels of case NAME when NAME_0000 is among them, and for a model of
    `in_channels` 1 only a lone NAME_0000 is; other names ending in four digits are cases of their own.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--images {folder}: no such folder")
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and p.name.endswith(NIFTI_SUFFIXES) and not p.name.startswith(".")
    )
    if not files:
        raise FileNotFoundError(f"--images {folder}: no NIfTI files (.nii or .nii.gz) in it")
    groups: dict[str, list[tuple[int, Path]]] = {}
    single: dict[str, list[Path]] = {}
    for path in files:
        name = case_name(path)
        match = CHANNEL_FILE.match(name)
        if match:
            groups.setdefault(match["case"], []).append((int(match["channel"]), path))
        else:
            single.setdefault(name, []).append(path)
    cases = []
    for name, channels in groups.items():
        numbers = [n for n, _ in channels]
        if numbers == [0] or (in_channels > 1 and 0 in numbers):
            cases.append(InputCase(name, tuple(path for _, path in sorted(channels))))
        else:
            for _, path in channels:
                single.setdefault(case_name(path), []).append(path)
    grouped = {c.name: c.images for c in cases}
    clashes = [
        f"{name}: {', '.join(p.name for p in (*grouped.get(name, ()), *paths))}"
        for name, paths in sorted(single.items())
        if len(paths) + bool(grouped.get(name)) > 1
    ]
    if clashes:  # one of them would be segmented and the other silently not (both write NAME.nii.gz)
        raise ValueError(f"--images {folder}: files that name the same case ({'; '.join(clashes)}): rename or move one")
    cases += [InputCase(name, (paths[0],)) for name, paths in single.items() if name not in grouped]
    return sorted(cases, key=lambda c: c.name)


def load_case_image(case: InputCase, in_channels: int) -> tuple[np.ndarray, nib.Nifti1Image]:
    """(image (C, X, Y, Z) float32, the first file's nibabel image for its affine and header).

    Raises:
        ValueError: a file that cannot be read, channel files that are not 0000..C-1 on one grid, a
            channel count other than the model's, or what training refuses too: unusable geometry (`affine_problems`)
            and NaN or infinite intensities.
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
    files = ", ".join(map(str, case.images))
    problems = affine_problems(nii.affine, image.shape[1:], case.images[0])
    if problems:  # the geometry training refuses: a 2D image, zero or non-finite voxel sizes, a sheared affine
        raise ValueError("; ".join(problems))
    if image.shape[0] != in_channels:
        raise ValueError(f"{case.name}: {image.shape[0]} channel(s) in {files}, the model takes {in_channels}")
    non_finite = int(np.count_nonzero(~np.isfinite(image)))
    if non_finite:  # one NaN makes the whole normalised volume NaN, and the prediction background everywhere
        raise ValueError(f"{files}: {non_finite} NaN or infinite value(s)")
    return image, nii
