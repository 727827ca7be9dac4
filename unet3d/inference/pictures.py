"""Pictures of a case: the middle axial slice of the image, the reference over it and the prediction over it,
side by side, drawn in physical proportions and labelled, so a person sees at a glance what was segmented.

The volumes are in the planned space, which is RAS: the slice is the (X, Y) plane, drawn with anterior up
and the patient's right on the right (neurological convention), each pixel as wide and tall as its voxel
is in millimetres.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

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
GOLDEN = 0.618033988749895  # hue step of the colours beyond the grid's (over 176 classes)
GRID = np.arange(0, 256, 51)  # the RGB levels the colours after the palette's are taken from


@lru_cache(maxsize=1)
def _grid_order() -> np.ndarray:
    """The RGB grid's bright, coloured entries (not dark, not grey: an overlay must not look like the grey
    image under it), each next one the farthest from the palette's and those before it: with the palette,
    120 classes are at least 51 apart (golden-ratio hues at one saturation put class 17 within 11 of
    class 7)."""
    grid = [c for c in itertools.product(GRID, repeat=3) if max(c) >= 153 and max(c) - min(c) >= 102]
    grid = np.array(grid, np.float32)
    nearest = np.linalg.norm(grid[:, None] - PALETTE[None, 1:], axis=2).min(axis=1)
    order = []
    for _ in range(len(grid)):
        i = int(np.argmax(nearest))
        order.append(grid[i])
        nearest = np.minimum(nearest, np.linalg.norm(grid - grid[i], axis=1))
        nearest[i] = -1.0  # taken
    return np.stack(order)


def class_colours(num_classes: int) -> np.ndarray:
    """(num_classes, 3) float32 RGB, class k's colour the same whatever num_classes is: the palette's first,
    then the RGB grid's farthest-first (`_grid_order`), then hues spread by the golden ratio; class 0 is
    unused (transparent), and no class is black, so a dataset of 15 or 100 organs gets distinct colours."""
    grid = _grid_order()
    colours = [PALETTE[k] for k in range(min(num_classes, len(PALETTE)))]
    colours += list(grid[: max(0, num_classes - len(PALETTE))])
    for k in range(len(PALETTE) + len(grid), num_classes):
        hue = (k * GOLDEN) % 1.0
        colours.append(np.array(_hsv_to_rgb(hue, 0.75, 0.95), np.float32) * 255)
    return np.round(np.stack(colours)).astype(np.float32)


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[float, float, float]:
    i, f = int(h * 6) % 6, h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    return [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]


MIN_SIDE = 192  # small slices are enlarged to at least this many pixels on their longer side
TEXT = 14  # height of a line of text, in pixels
COLUMNS = ("image", "reference", "prediction")


@dataclass(frozen=True)
class Preview:
    """What one picture of a case needs: its middle planes, their voxel size and a caption."""

    image: np.ndarray  # (X, Y) float32, the first channel
    ref: np.ndarray | None  # (X, Y) uint8
    pred: np.ndarray  # (X, Y) uint8
    spacing: tuple[float, float]  # voxel size along X and Y, in mm
    caption: str  # e.g. "case_003  Dice 0.912"


def middle_planes(
    image: np.ndarray, ref: np.ndarray | None, pred: np.ndarray | torch.Tensor
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The middle slice along the last axis of the first image channel, the reference and the prediction.

    Args:
        image: (C, X, Y, Z) or (X, Y, Z); ref: (X, Y, Z) labels; pred: (X, Y, Z) labels or their middle plane
            (X, Y) already, a NumPy array or a tensor on any device.

    Returns:
        (X, Y) float32, uint8 or None, uint8 planes: all a picture needs, a few hundred KB at most.
    """
    volume = image[0] if image.ndim == 4 else image
    z = volume.shape[-1] // 2
    plane = pred if pred.ndim == 2 else pred[..., z]
    plane = plane.cpu().numpy() if isinstance(plane, torch.Tensor) else np.asarray(plane)
    return (
        np.asarray(volume[..., z], dtype=np.float32),
        None if ref is None else np.asarray(ref[..., z], dtype=np.uint8),
        plane.astype(np.uint8),
    )


def _gray(plane: np.ndarray) -> np.ndarray:
    """A 2D slice -> (H, W, 3) float RGB in [0, 255], windowed to its 1st-99th percentiles."""
    lo, hi = np.percentile(plane, [1, 99])
    scaled = np.clip((plane - lo) / max(hi - lo, 1e-8), 0, 1) * 255
    return np.repeat(scaled[..., None], 3, axis=-1)


def _blend(gray: np.ndarray, labels: np.ndarray) -> np.ndarray:
    colours = class_colours(int(labels.max()) + 1)[labels]
    mask = (labels > 0)[..., None]
    return np.where(mask, (1 - ALPHA) * gray + ALPHA * colours, gray)


def _physical(panel: np.ndarray, spacing: Sequence[float]) -> np.ndarray:
    """(X, Y, 3) -> (H, W, 3) uint8 with anterior up, patient's right on the right, one pixel per
    min(spacing) / s mm: a voxel of 0.8 x 3.6 mm is drawn 4.5 times as tall as it is wide."""
    picture = Image.fromarray(np.rot90(panel).astype(np.uint8))  # rows: Y from anterior down; columns: X
    step = min(spacing)
    width, height = panel.shape[0] * spacing[0] / step, panel.shape[1] * spacing[1] / step
    zoom = max(1.0, MIN_SIDE / max(width, height))
    return np.asarray(picture.resize((round(width * zoom), round(height * zoom)), Image.NEAREST))


def overlay(preview: Preview) -> np.ndarray:
    """One row: the caption, each panel's title over it, then image | reference overlay | prediction overlay,
    as (H, W, 3) uint8. The titles belong to the row: cases of other shapes have panels of other widths.

    Without a reference its panel is the plain image.
    """
    gray = _gray(preview.image)
    panels = [gray, _blend(gray, preview.ref) if preview.ref is not None else gray, _blend(gray, preview.pred)]
    drawn = [_physical(p, preview.spacing) for p in panels]
    row = np.concatenate(drawn, axis=1)
    canvas = Image.new("RGB", (row.shape[1], row.shape[0] + 2 * (TEXT + 4)))
    canvas.paste(Image.fromarray(row), (0, 2 * (TEXT + 4)))
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default()
    draw.text((4, 2), preview.caption, fill=(255, 255, 255), font=font)
    x = 0
    for title, panel in zip(COLUMNS, drawn):
        draw.text((x + 4, TEXT + 6), title, fill=(200, 200, 200), font=font)
        x += panel.shape[1]
    return np.asarray(canvas)


def legend(width: int, class_names: Sequence[str]) -> np.ndarray:
    """(H, width, 3) uint8: a swatch and the name of every foreground class, on as many lines as it needs."""
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    colours = class_colours(len(class_names))
    entries, x, line = [], 4, 0
    for k, name in enumerate(class_names[1:], start=1):
        size = 24 + int(measure.textlength(name, font=font))
        if x > 4 and x + size > width:  # the next line: a legend of many classes is never cut off
            x, line = 4, line + 1
        entries.append((x, line, tuple(int(c) for c in colours[k]), name))
        x += size
    canvas = Image.new("RGB", (width, (line + 1) * (TEXT + 4) + 4))
    draw = ImageDraw.Draw(canvas)
    for x, line, colour, name in entries:
        y = line * (TEXT + 4) + 2
        draw.rectangle((x, y + 3, x + 10, y + 11), fill=colour)
        draw.text((x + 14, y + 1), name, fill=(255, 255, 255), font=font)
    return np.asarray(canvas)


def picture(rows: Sequence[np.ndarray], class_names: Sequence[str]) -> np.ndarray:
    """(H, W, 3) uint8: the class legend over the `overlay` rows, stacked (TensorBoard's val/overlay, and
    overview.png)."""
    if not rows:
        raise ValueError("no rows to draw")
    width = max(r.shape[1] for r in rows)
    padded = [np.pad(r, ((0, 4), (0, width - r.shape[1]), (0, 0))) for r in rows]
    return np.concatenate([legend(width, class_names), *padded], axis=0)


def write_overview(rows: Sequence[np.ndarray], path: str | Path, class_names: Sequence[str]) -> None:
    """The class legend, then the `overlay` rows stacked, into a PNG file."""
    Image.fromarray(picture(rows, class_names)).save(path)
