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


def test_every_class_has_its_own_colour_and_none_is_black_or_grey():
    colours = class_colours(121)  # TotalSegmentator's 104 structures, and more
    pairs = np.linalg.norm(colours[1:, None] - colours[None, 1:], axis=2) + np.eye(120) * 1e9
    assert pairs.min() >= 50, "golden-ratio hues put class 17 within 11 of class 7: the same colour to the eye"
    assert colours[1:].max(axis=1).min() > 100, "no class is drawn (nearly) black, like the background"
    assert (colours[1:].max(axis=1) - colours[1:].min(axis=1)).min() >= 100, "nor grey, like the image"
    assert (class_colours(10) == colours[:10]).all(), "a class's colour does not depend on how many there are"
    assert len({tuple(c) for c in class_colours(300)[1:]}) == 299


def test_a_legend_of_many_classes_wraps_within_the_picture(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, len(ORGANS), (40, 40)).astype(np.uint8)
    preview = Preview(rng.normal(size=(40, 40)).astype(np.float32), labels, labels, (1.0, 1.0), "amos_0001  Dice 1")
    row = overlay(preview)
    write_overview([row], tmp_path / "overview.png", ORGANS)
    picture = np.asarray(Image.open(tmp_path / "overview.png"))
    header = picture.shape[0] - row.shape[0] - 4
    assert picture.shape[1] == row.shape[1] and header >= 3 * (TEXT + 4), "the legend took several lines"
    legend = picture[:header]
    swatches = {tuple(int(v) for v in c) for c in class_colours(len(ORGANS))[1:].round()}
    seen = {tuple(int(v) for v in p) for p in legend.reshape(-1, 3)}
    assert swatches <= seen, f"{len(swatches - seen)} class colour(s) missing from the legend"


def test_each_row_titles_its_own_panels_whatever_their_width(tmp_path):
    """Cases of other shapes have panels of other widths: the column titles of the first row stood over the
    wrong panels of a wider second one. Each row now carries its titles, over its own panels."""
    rng = np.random.default_rng(1)

    def row(shape):
        labels = np.zeros(shape, np.uint8)
        return overlay(Preview(rng.normal(size=shape).astype(np.float32), labels, labels, (1.0, 1.0), "case"))

    small, large = row((20, 30)), row((300, 260))
    for r in (small, large):
        width = r.shape[1] // 3
        band = r[TEXT + 4 : 2 * (TEXT + 4)].max(axis=2)  # the titles' line
        starts = [int(np.flatnonzero(band[:, i * width : (i + 1) * width].max(axis=0))[0]) for i in range(3)]
        assert all(4 <= x <= 8 for x in starts), f"a title at the left of each of its panels: {starts}"
    write_overview([small, large], tmp_path / "overview.png", ["background", "organ"])
    picture = np.asarray(Image.open(tmp_path / "overview.png"))
    assert picture.shape[1] == large.shape[1]
    assert (picture[-large.shape[0] - 4 : -4] == large).all(), "the wide row drawn as it is, titles included"
