"""Pictures of many-class datasets: every class its own colour, and a legend that wraps instead of being cut."""

from __future__ import annotations

import numpy as np
from PIL import Image

from unet3d.inference.pictures import TEXT, Preview, class_colours, overlay, write_overview

ORGANS = [
    "background",
    "spleen",
    "right kidney",
    "left kidney",
    "gallbladder",
    "esophagus",
    "liver",
    "stomach",
    "aorta",
    "inferior vena cava",
    "pancreas",
    "right adrenal gland",
    "left adrenal gland",
    "duodenum",
    "bladder",
    "prostate or uterus",
]  # AMOS's 15 organs


def test_every_class_has_its_own_colour_and_none_is_black():
    colours = class_colours(105)  # TotalSegmentator's 104 structures
    distinct = {tuple(np.round(c).astype(int)) for c in colours[1:]}
    assert len(distinct) == 104
    assert colours[1:].max(axis=1).min() > 100, "no class is drawn (nearly) black, like the background"


def test_a_legend_of_many_classes_wraps_within_the_picture(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, len(ORGANS), (40, 40)).astype(np.uint8)
    preview = Preview(rng.normal(size=(40, 40)).astype(np.float32), labels, labels, (1.0, 1.0), "amos_0001  Dice 1")
    row = overlay(preview)
    write_overview([row], tmp_path / "overview.png", ORGANS)
    picture = np.asarray(Image.open(tmp_path / "overview.png"))
    header = picture.shape[0] - row.shape[0] - 4
    assert picture.shape[1] == row.shape[1] and header >= 4 * (TEXT + 4), "the legend took several lines"
    legend = picture[TEXT + 4 : header]
    swatches = {tuple(int(v) for v in c) for c in class_colours(len(ORGANS))[1:].round()}
    seen = {tuple(int(v) for v in p) for p in legend.reshape(-1, 3)}
    assert swatches <= seen, f"{len(swatches - seen)} class colour(s) missing from the legend"
