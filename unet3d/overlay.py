"""Mid-slice pictures of a case: the image, the reference over it and the prediction over it, side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
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


def overlay_row(image: np.ndarray, ref: np.ndarray | None, pred: np.ndarray) -> np.ndarray:
    """The middle slice along the last axis: image | reference overlay | prediction overlay.

    Args:
        image: (C, X, Y, Z) or (X, Y, Z); the first channel is shown.
        ref: (X, Y, Z) reference labels, or None (its panel is then the plain image).
        pred: (X, Y, Z) predicted labels.

    Returns:
        (s * Y, 3 * s * X, 3) uint8 RGB, rotated so that the first axis runs left to right, enlarged by an
        integer factor s so that small slices stay legible.
    """
    volume = image[0] if image.ndim == 4 else image
    z = volume.shape[-1] // 2
    gray = _gray(np.asarray(volume[..., z], dtype=np.float32))
    panels = [gray, _blend(gray, ref[..., z]) if ref is not None else gray, _blend(gray, pred[..., z])]
    row = np.concatenate([np.rot90(p) for p in panels], axis=1).astype(np.uint8)
    s = max(1, -(-MIN_SIDE // max(gray.shape)))
    return row.repeat(s, axis=0).repeat(s, axis=1)


def write_overview(rows: Sequence[np.ndarray], path: str | Path) -> None:
    """Stack overlay rows (each (H_i, W_i, 3) uint8) vertically, padded to one width, into a PNG file."""
    if not rows:
        raise ValueError("no rows to draw")
    width = max(r.shape[1] for r in rows)
    padded = [np.pad(r, ((0, 4), (0, width - r.shape[1]), (0, 0))) for r in rows]
    Image.fromarray(np.concatenate(padded, axis=0)).save(path)
