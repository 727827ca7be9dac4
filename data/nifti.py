"""Reading NIfTI volumes into channel-first arrays, and per-case intensity normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np


def load_image(path: str | Path) -> tuple[np.ndarray, nib.Nifti1Image]:
    """A 3D or 4D NIfTI image -> (float32 array (C, X, Y, Z), the nibabel image for affine and header).

    MSD stores several modalities as a 4D volume with the channel last; it is moved to the front.
    """
    img = _load(path)
    data = np.asarray(img.dataobj, dtype=np.float32)
    if data.ndim == 3:
        data = data[None]
    elif data.ndim == 4:
        data = np.moveaxis(data, -1, 0)
    else:
        raise ValueError(f"{path}: expected a 3D or 4D image, got shape {data.shape}")
    return np.ascontiguousarray(data), img


def load_label(path: str | Path) -> tuple[np.ndarray, nib.Nifti1Image]:
    """A 3D NIfTI label map -> (uint8 array (X, Y, Z), the nibabel image)."""
    img = _load(path)
    data = np.asarray(img.dataobj)
    if data.ndim == 4 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise ValueError(f"{path}: expected a 3D label map, got shape {data.shape}")
    if not np.isfinite(data).all():
        raise ValueError(f"{path}: label map holds NaN or infinite values")
    rounded = np.rint(data)
    if rounded.min() < 0 or rounded.max() > 255:
        raise ValueError(f"{path}: label values must lie in 0..255, got {rounded.min()}..{rounded.max()}")
    return rounded.astype(np.uint8), img


def _load(path: str | Path) -> nib.Nifti1Image:
    try:
        return nib.load(str(path))
    except FileNotFoundError:
        raise
    except Exception as e:  # nibabel raises many kinds for a damaged file
        raise ValueError(f"{path}: cannot read as NIfTI ({type(e).__name__}: {e})") from e


def spacing(img: nib.Nifti1Image) -> tuple[float, float, float]:
    """Voxel size in millimetres along the three spatial axes, from the header."""
    return tuple(float(z) for z in img.header.get_zooms()[:3])


def normalize(image: np.ndarray, modalities: Sequence[str]) -> np.ndarray:
    """Per-channel z-score of one case; CT channels are clipped to their 0.5-99.5 percentiles first.

    Args:
        image: (C, X, Y, Z) float32.
        modalities: one name per channel, as in dataset.json.

    Returns:
        (C, X, Y, Z) float32 with zero mean and unit standard deviation per channel.
    """
    if len(modalities) != image.shape[0]:
        raise ValueError(f"image has {image.shape[0]} channel(s) but dataset.json names {len(modalities)}")
    out = np.empty_like(image, dtype=np.float32)
    for c, modality in enumerate(modalities):
        channel = image[c]
        if modality.upper() == "CT":
            lo, hi = np.percentile(channel, [0.5, 99.5])
            channel = np.clip(channel, lo, hi)
        mean, std = float(channel.mean()), float(channel.std())
        out[c] = (channel - mean) / max(std, 1e-8)
    return out
