"""Mid-slice pictures of a case: the image, the reference over it and the prediction over it, side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# Class colours (class 0, background, is left transparent).
PALETTE = np.array(
    [
        (0, 0, 0),
        (230, 25, 75),
        (60, 180, 75),
        (255, 225, 25),
        (0, 130, 200),
        (245, 130, 48),
        (145, 30, 180),
        (70, 240, 240),
        (240, 50, 230),
    ],
    dtype=np.float32,
)
ALPHA = 0.45
MIN_SIDE = 192  # small slices are enlarged (nearest neighbour) to at least this many pixels


def _gray(plane: np.ndarray) -> np.ndarray:
    """A 2D slice -> (H, W, 3) float RGB in [0, 255], windowed to its 1st-99th percentiles."""
    lo, hi = np.percentile(plane, [1, 99])
    scaled = np.clip((plane - lo) / max(hi - lo, 1e-8), 0, 1) * 255
    return np.repeat(scaled[..., None], 3, axis=-1)


def _blend(gray: np.ndarray, labels: np.ndarray) -> np.ndarray:
    colours = PALETTE[labels % len(PALETTE)]
    mask = (labels > 0)[..., None]
    return np.where(mask, (1 - ALPHA) * gray + ALPHA * colours, gray)


def middle_planes(
    image: np.ndarray, ref: np.ndarray | None, pred: np.ndarray | torch.Tensor
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The middle slice along the last axis of the first image channel, the reference and the prediction.

    Args:
        image: (C, X, Y, Z) or (X, Y, Z); ref, pred: (X, Y, Z) labels (pred may be a tensor on any device).

    Returns:
        (X, Y) float32, uint8 or None, uint8 planes: all a picture needs, a few hundred KB at most.
    """
    volume = image[0] if image.ndim == 4 else image
    z = volume.shape[-1] // 2
    plane = pred[..., z]
    plane = plane.cpu().numpy() if isinstance(plane, torch.Tensor) else np.asarray(plane)
    return (
        np.asarray(volume[..., z], dtype=np.float32),
        None if ref is None else np.asarray(ref[..., z], dtype=np.uint8),
        plane.astype(np.uint8),
    )


def overlay_planes(image: np.ndarray, ref: np.ndarray | None, pred: np.ndarray) -> np.ndarray:
    """(X, Y) planes -> image | reference overlay | prediction overlay, as (s * Y, 3 * s * X, 3) uint8 RGB.

    Rotated so that the first axis runs left to right, enlarged by an integer factor s so that small slices
    stay legible. Without a reference its panel is the plain image.
    """
    gray = _gray(image)
    panels = [gray, _blend(gray, ref) if ref is not None else gray, _blend(gray, pred)]
    row = np.concatenate([np.rot90(p) for p in panels], axis=1).astype(np.uint8)
    s = max(1, -(-MIN_SIDE // max(gray.shape)))
    return row.repeat(s, axis=0).repeat(s, axis=1)


def overlay_row(image: np.ndarray, ref: np.ndarray | None, pred: np.ndarray) -> np.ndarray:
    """`overlay_planes` of the volumes' middle slices (`middle_planes`)."""
    return overlay_planes(*middle_planes(image, ref, pred))


def write_overview(rows: Sequence[np.ndarray], path: str | Path) -> None:
    """Stack overlay rows (each (H_i, W_i, 3) uint8) vertically, padded to one width, into a PNG file."""
    if not rows:
        raise ValueError("no rows to draw")
    width = max(r.shape[1] for r in rows)
    padded = [np.pad(r, ((0, 4), (0, width - r.shape[1]), (0, 0))) for r in rows]
    Image.fromarray(np.concatenate(padded, axis=0)).save(path)
