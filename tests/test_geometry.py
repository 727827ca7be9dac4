"""Geometry: orientation, spacing, cropping, resampling, the way back to the scanner's grid, and the plan's
spacing rule, on real arrays and affines (phantoms of data.synthetic acquired several ways)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from data.geometry import (
    affine_problems,
    canonical_ornt,
    nonzero_box,
    obliquity,
    reorient,
    resample_label,
    separate_axis,
    to_native,
    undo_reorient,
)
from data.plan import Fingerprint, Plan, PlanRequest, fingerprint_arrays, make_plan, target_spacing
from data.preprocess import preprocess
from data.synthetic import Acquisition, acquire, draw_phantom, evaluate_phantom, extent
from unet3d.inference.sliding_window import InferenceSettings, predict_probabilities

FOV = extent(48)
RAS_1MM = Acquisition("RAS 1 mm", (0, 1, 2), (1, 1, 1), (1.0, 1.0, 1.0))
LPS_3MM = Acquisition("LPS 0.8 x 0.8 x 3 mm", (0, 1, 2), (-1, -1, 1), (0.8, 0.8, 3.0))
SAGITTAL = Acquisition("RIP 3.3 x 0.9 x 0.9 mm", (0, 2, 1), (1, -1, -1), (3.3, 0.9, 0.9))
ZSCORE = ({"modality": "MRI", "scheme": "zscore"},)


def phantom(index: int = 3):
    return draw_phantom(np.random.default_rng([0, index]), FOV)


def plan(spacing=(1.0, 1.0, 1.0), orientation="RAS", crop="nonzero") -> Plan:
    return Plan(
        orientation=orientation,
        spacing=spacing,
        spacing_rule="given",
        crop=crop,
        normalization=ZSCORE,
        median_shape=(48, 48, 45),
        median_spacing=(1.0, 1.0, 1.0),
        patch_size=(48, 48, 48),
        features=(4, 8),
        kernels=((3, 3, 3), (3, 3, 3)),
        strides=((1, 1, 1), (2, 2, 2)),
    )


def world(shape, affine) -> np.ndarray:
    index = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1)
    return index @ affine[:3, :3].T + affine[:3, 3]


def sample(volume: np.ndarray, affine: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Nearest-neighbour values of `volume` (with `affine`) at world points; 0 outside it."""
    index = np.rint((points - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T).astype(int)
    inside = np.all((index >= 0) & (index < np.array(volume.shape)), axis=-1)
    index = np.clip(index, 0, np.array(volume.shape) - 1)
    return volume[index[..., 0], index[..., 1], index[..., 2]] * inside


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2 * float((a & b).sum()) / max(float(a.sum() + b.sum()), 1.0)


# --- orientation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("acquisition", [RAS_1MM, LPS_3MM, SAGITTAL])
def test_reorientation_keeps_every_voxel_where_it_is_in_the_world(acquisition):
    image, label, affine = acquire(phantom(), acquisition, FOV)
    ornt = canonical_ornt(affine)
    canonical = reorient(label, ornt)
    assert np.array_equal(undo_reorient(canonical, ornt), label), "undone exactly"
    planned = preprocess(image[None], affine, plan(spacing=None, crop="none"), label, 3)
    assert np.array_equal(planned.label, canonical)
    ras = planned.geometry.canonical_affine
    assert np.all(np.diag(ras[:3, :3]) > 0) and np.allclose(ras[:3, :3], np.diag(np.diag(ras[:3, :3])))
    points = world(canonical.shape, ras)
    np.testing.assert_array_equal(sample(label, affine, points), canonical)


def test_every_axis_order_and_direction_comes_back():
    volume = np.random.default_rng(0).normal(size=(2, 5, 6, 7))
    for order in itertools.permutations(range(3)):
        for signs in itertools.product((1, -1), repeat=3):
            affine = np.eye(4)
            affine[:3, :3] = 0
            for a, (w, s) in enumerate(zip(order, signs)):
                affine[w, a] = s * (a + 1)
            ornt = canonical_ornt(affine)
            canonical = reorient(volume, ornt)
            assert np.array_equal(undo_reorient(canonical, ornt), volume)
            assert canonical.shape[0] == 2 and sorted(canonical.shape[1:]) == [5, 6, 7]


# --- resampling ---------------------------------------------------------------------------------------


def test_resampled_labels_never_invent_a_class():
    label = np.zeros((12, 12, 4), np.uint8)
    label[2:6] = 2  # class 2 next to background: linear interpolation of the values would make class 1
    label[6:9] = 1
    out = resample_label(label, (30, 30, 12), separate_axis((1, 1, 3), (0.4, 0.4, 1)), 3)
    assert set(np.unique(out)) == {0, 1, 2}
    assert not np.any((out == 1)[:14]), "no class 1 between background and class 2"
    for k in (1, 2):
        assert abs((out == k).sum() / out.size - (label == k).sum() / label.size) < 0.02, "volumes are kept"


@pytest.mark.parametrize("acquisition", [RAS_1MM, LPS_3MM, SAGITTAL])
def test_resampling_puts_the_anatomy_where_the_planned_affine_says(acquisition):
    image, label, affine = acquire(phantom(), acquisition, FOV)
    planned = preprocess(image[None], affine, plan(), label, 3)
    geometry = planned.geometry
    thick = max(acquisition.spacing) > 1.5
    assert geometry.separate_axis == (int(np.argmax(geometry.canonical_spacing)) if thick else None)
    points = world(geometry.planned_shape, geometry.planned_affine)
    truth = evaluate_phantom(phantom(), points, FOV)[1]
    for k, least in ((1, 0.88), (2, 0.8)):
        mine, true = planned.label == k, truth == k
        assert dice(mine, true) > (0.999 if not thick else least), f"class {k}"
        offset = np.abs(points[mine].mean(0) - points[true].mean(0))
        assert offset.max() < 0.5, f"class {k} is {offset} mm from where it is in the world"


def test_crop_to_the_nonzero_box_and_back():
    image = np.zeros((1, 20, 18, 16), np.float32)
    image[0, 3:15, 4:10, 2:14] = np.random.default_rng(0).uniform(1, 2, (12, 6, 12))
    label = (image[0] > 1.5).astype(np.uint8)
    assert nonzero_box(image) == ((3, 15), (4, 10), (2, 14))
    planned = preprocess(image, np.diag([1.0, 1.0, 1.0, 1.0]), plan(spacing=(1.0, 1.0, 1.0)), label, 2)
    assert planned.image.shape == (1, 12, 6, 12) and planned.geometry.crop == ((3, 15), (4, 10), (2, 14))
    onehot = torch.from_numpy(np.stack([planned.label == 0, planned.label == 1]).astype(np.float32))
    back = to_native(onehot, planned.geometry)
    assert back.shape == label.shape and np.array_equal(back, label), "uncropped exactly, background outside"


@pytest.mark.parametrize("acquisition", [LPS_3MM, SAGITTAL])
def test_probabilities_go_back_to_the_files_own_grid(acquisition):
    image, label, affine = acquire(phantom(), acquisition, FOV)
    planned = preprocess(image[None], affine, plan(), label, 3)
    onehot = torch.from_numpy(np.stack([planned.label == k for k in range(3)]).astype(np.float32))
    back = to_native(onehot, planned.geometry)
    assert back.shape == label.shape and back.dtype == np.uint8
    for k in (1, 2):
        assert dice(back == k, label == k) > 0.9, f"class {k} after going to 1 mm and back"


def test_going_back_leaves_the_callers_probabilities_alone():
    """Without resampling (data already at the planned spacing) the first class's volume is the caller's own:
    the argmax must not write into it (the saved probabilities and the pictures use it afterwards)."""
    rng = np.random.default_rng(0)
    probs = torch.softmax(torch.from_numpy(rng.normal(size=(3, 6, 5, 4)).astype(np.float32)), dim=0)
    kept = probs.clone()
    geometry = preprocess(rng.normal(size=(1, 6, 5, 4)).astype(np.float32) + 5, np.eye(4), plan()).geometry
    assert geometry.planned_shape == geometry.cropped_shape == (6, 5, 4), "nothing to resample"
    assert np.array_equal(to_native(probs, geometry), kept.argmax(0).numpy())
    assert torch.equal(probs, kept)


# --- a prediction agrees with itself in world coordinates, however the scan is stored -------------------


class Handmade(nn.Module):
    """A fixed 'network' with spatial context and a sense of direction: bright structures, smoothed over
    5 x 5 x 5 voxels, pulled towards +x along the first array axis. Stored differently, the same anatomy
    gives the same answer only if every case is brought to one orientation and spacing first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.avg_pool3d(x, 5, stride=1, padding=2, count_include_pad=False)
        dx = torch.zeros_like(s)
        dx[:, :, 1:-1] = (s[:, :, 2:] - s[:, :, :-2]) / 2
        foreground = (s - 0.8) * 8 + 24 * dx
        return torch.cat([torch.zeros_like(foreground), foreground], dim=1)


def predict_native(image, affine, the_plan: Plan) -> np.ndarray:
    planned = preprocess(image[None], affine, the_plan)
    settings = InferenceSettings(window=planned.image.shape[1:])
    probs = predict_probabilities(Handmade(), planned.image, settings, torch.device("cpu"))
    return to_native(probs, planned.geometry)


def agreement(the_plan: Plan) -> float:
    """Dice between the predictions for the RAS 1 mm and the LPS 3 mm acquisition, on the LPS grid."""
    a_image, _, a_affine = acquire(phantom(), RAS_1MM, FOV)
    b_image, _, b_affine = acquire(phantom(), LPS_3MM, FOV)
    a, b = predict_native(a_image, a_affine, the_plan), predict_native(b_image, b_affine, the_plan)
    assert a.shape == a_image.shape and b.shape == b_image.shape, "each prediction on its input's grid"
    return dice(sample(a, a_affine, world(b.shape, b_affine)) > 0, b > 0)


def test_ras_1mm_and_lps_3mm_predictions_agree_in_world_coordinates():
    assert agreement(plan()) > 0.95
    as_stored = agreement(plan(spacing=None, orientation="none", crop="none"))
    assert as_stored < 0.9, f"without the geometry the two disagree ({as_stored:.3f}): the test can fail"


# --- bad geometry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("affine", "shape", "message"),
    [
        (np.diag([1.0, 0.0, 1.0, 1.0]), (8, 8, 8), "has a zero axis"),
        (np.diag([1.0, np.nan, 1.0, 1.0]), (8, 8, 8), "NaN or infinite"),
        (np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]]), (8, 8, 8), "singular"),
        (np.array([[1, 0.3, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]]), (8, 8, 8), "sheared"),
        (np.eye(4), (64, 64, 1), "is not a 3D volume"),
    ],
)
def test_bad_geometry_is_named(affine, shape, message):
    problems = affine_problems(affine, shape, "case.nii.gz")
    assert problems and all(p.startswith("case.nii.gz: ") for p in problems)
    assert any(message in p for p in problems), problems


def test_a_shear_is_reported_by_its_angle():
    """Axes at 73.3 degrees to each other (a shear of 0.3 along one axis) are 16.7 degrees from orthogonal."""
    sheared = np.array([[1, 0.3, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]])
    expected = 90 - np.degrees(np.arccos(0.3 / np.hypot(1, 0.3)))
    assert f"voxel axes at {expected:.1f} degrees from orthogonal" in affine_problems(sheared, (8, 8, 8), "x")[0]
    assert f"{expected:.1f}" == "16.7"


def test_oblique_scans_are_fine():
    angle = np.radians(20)
    rotation = np.array([[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag([0.8, 0.8, 3.0])
    assert affine_problems(affine, (8, 8, 8), "x") == []


def _rotation(axis: int, degrees: float) -> np.ndarray:
    a, b = [i for i in range(3) if i != axis]
    c, s = np.cos(np.radians(degrees)), np.sin(np.radians(degrees))
    r = np.eye(3)
    r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    return r


@pytest.mark.parametrize(
    ("rotation", "expected"),
    [
        (np.eye(3), 0.0),
        (np.diag([-1.0, -1.0, 1.0]), 0.0),  # LPS
        (np.array([[0, 0, 1.0], [0, 1, 0], [1, 0, 0]]), 0.0),  # the thick axis first
        (_rotation(2, 20), 20.0),
        (_rotation(0, -40), 40.0),
        (_rotation(1, 50), 40.0),  # lined up with the other axis, 40 degrees away
        (_rotation(2, 30) @ _rotation(0, 30), float(np.degrees(np.arccos(np.cos(np.radians(30)) ** 2)))),
    ],
)
def test_obliquity_is_the_largest_angle_to_the_axes_reorientation_lines_up(rotation, expected):
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag([0.8, 0.8, 3.0])
    affine[:3, 3] = (10, -20, 5)
    assert obliquity(affine) == pytest.approx(expected, abs=1e-6)


def test_obliquity_does_not_depend_on_the_voxel_order_or_directions():
    """The same scan stored with its axes permuted and flipped is as oblique: the angle is the scan's, not its
    array's."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        affine = np.eye(4)
        affine[:3, :3] = q @ np.diag(rng.uniform(0.5, 5, 3))
        stored = affine.copy()
        stored[:3, :3] = affine[:3, :3][:, rng.permutation(3)] * rng.choice([-1, 1], 3)
        assert 0 <= obliquity(affine) < 90
        assert obliquity(stored) == pytest.approx(obliquity(affine), abs=1e-9)


def test_scans_near_45_degrees_are_named_in_the_pre_flight(tiny_dataset, tmp_path, capsys):
    """Reorientation only permutes and flips, so scans near 45 degrees off the scanner's axes can end up 90
    degrees apart: the pre-flight names every training case more than 30 degrees off (with its angle), not one
    at 20 degrees, and says nothing with --orientation none. A cache whose fingerprints predate the obliquity
    is re-read, so the warning is not lost on a dataset fingerprinted before. The job still starts (exit 0)."""
    import json
    import shutil

    import nibabel as nib

    from unet3d.training.config import parse_args
    from unet3d.training.preflight import preflight

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    for name, degrees in (("synth_001", 41), ("synth_002", 20)):
        for folder in ("imagesTr", "labelsTr"):
            path = data / folder / f"{name}.nii.gz"
            nii = nib.load(path)
            affine = nii.affine.copy()
            affine[:3, :3] = _rotation(2, degrees) @ affine[:3, :3]
            nib.save(type(nii)(np.asarray(nii.dataobj), affine, nii.header), path)
    cache = tmp_path / "cache"
    args = ["--data-dir", str(data), "--cache-dir", str(cache), "--out-dir", str(tmp_path / "run"), "--prepare-only"]
    assert preflight(parse_args(args)) == 0
    out = capsys.readouterr().out
    assert "1 training case(s) lie more than 30 degrees off the scanner's axes: synth_001 (41.0 degrees)" in out, out
    assert "synth_002" not in out.split("off the scanner's axes")[1].split("\n")[0]

    files = list(cache.rglob("fingerprints/*/synth_001-*.json"))
    assert len(files) == 1, files
    old = json.loads(files[0].read_text())  # as a cache written before the obliquity was measured
    del old["obliquity"], old["stamp"]["fingerprint"]
    files[0].write_text(json.dumps(old))
    assert preflight(parse_args(args)) == 0
    assert "synth_001 (41.0 degrees)" in capsys.readouterr().out
    assert json.loads(files[0].read_text())["obliquity"] == pytest.approx(41.0)

    assert preflight(parse_args([*args, "--orientation", "none"])) == 0
    assert "off the scanner's axes" not in capsys.readouterr().out


# --- the plan --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spacings", "shapes", "expected", "rule"),
    [
        ([(1, 1, 1)] * 5, [(100, 100, 100)] * 5, (1, 1, 1), "median"),
        ([(1, 1, 1.5), (1, 1, 2), (0.9, 0.9, 2.5)], [(200, 200, 100)] * 3, (1, 1, 2), "median"),
        # strongly anisotropic in spacing and voxels: the thick axis takes its 10th percentile
        (
            [(0.8, 0.8, 5), (0.8, 0.8, 5), (0.7, 0.7, 1.5), (0.8, 0.8, 5), (0.75, 0.75, 2.5)],
            [(512, 512, 60)] * 5,
            (0.8, 0.8, float(np.percentile([5, 5, 1.5, 5, 2.5], 10))),
            "10th percentile",
        ),
        # anisotropic spacing but not fewer voxels along the thick axis: the median stays
        ([(0.8, 0.8, 5)] * 3, [(100, 100, 120)] * 3, (0.8, 0.8, 5), "median"),
        # the 10th percentile is kept above the other axes' spacing
        ([(1, 1, 5)] * 7 + [(1, 1, 0.5)] * 3, [(400, 400, 30)] * 10, (1, 1, 1 + 1e-5), "10th percentile"),
    ],
)
def test_target_spacing_follows_nnunets_rule(spacings, shapes, expected, rule):
    spacing, how = target_spacing(spacings, shapes)
    np.testing.assert_allclose(spacing, expected, rtol=1e-6)
    assert rule in how


def test_a_plan_for_thick_slices_pools_in_plane_first_and_has_dataset_ct_statistics():
    rng = np.random.default_rng(0)
    cases = []
    request = PlanRequest(patch_voxels=48 * 48 * 32, widths=(8, 64), max_levels=5)
    for i in range(4):
        label = np.zeros((60, 60, 12), np.uint8)
        label[20:40, 20:40, 4:8] = 1
        image = rng.normal(-500, 50, label.shape).astype(np.float32) + 540.0 * label  # ~40 HU foreground
        affine = np.diag([0.8, 0.8, 5.0, 1.0])
        cases.append(fingerprint_arrays(f"c{i}", image[None], affine, label, ["CT"], request))
    made = make_plan(cases, ["CT"], request)
    assert made.spacing == (0.8, 0.8, 5.0) and made.strides[1] == (2, 2, 1) and made.kernels[0] == (3, 3, 1)
    ct = made.normalization[0]
    assert ct["scheme"] == "ct" and 20 < ct["mean"] < 60 and ct["clip"][0] < ct["mean"] < ct["clip"][1]
    assert Plan.from_dict(made.to_dict()) == made and len(made.digest()) == 10
    fingerprint = Fingerprint.from_dict(cases[0].to_dict())
    assert fingerprint == cases[0]


def test_thick_slice_cases_among_fine_ones_get_an_acquisition_channel():
    """Mixed protocols planned at 1 x 0.9 x 1 mm: the thick-slice scans are resampled 3 to 3.3 times finer
    along their thick axis, so the plan adds an input channel (each planned voxel's distance to its scan's
    nearest measured plane), which preprocessing appends after the normalised images and leaves them as they
    were; a dataset of one thick protocol, planned at its own spacing, and `off` get none, and their plans'
    preprocessing (the cache key) is what it was before the channel existed."""
    from data.acquisitions import plane_distance, voxel_ratios

    request = PlanRequest(patch_voxels=32**3, widths=(4, 16), max_levels=3, acquisition_channel="auto")
    body = phantom()
    scans = {a.name: acquire(body, a, FOV) for a in (RAS_1MM, LPS_3MM, SAGITTAL)}
    prints = [fingerprint_arrays(n, im[None], aff, lb, ["MRI"], request) for n, (im, lb, aff) in scans.items()]
    made = make_plan(prints, ["MRI"], request)
    assert made.acquisition_channel and made.extra_channels == 1
    assert made.model_args(1, 3)["in_channels"] == 2
    assert made.preprocessing()["acquisition_channel"] is True and "measured planes" in made.describe()
    assert Plan.from_dict(made.to_dict()) == made
    off = make_plan(prints, ["MRI"], PlanRequest(**{**request.__dict__, "acquisition_channel": "off"}))
    assert not off.acquisition_channel and off.model_args(1, 3)["in_channels"] == 1
    assert "acquisition_channel" not in off.preprocessing(), "plans without the channel keep their cache keys"
    old = {k: v for k, v in made.to_dict().items() if k != "acquisition_channel"}  # a plan from before it
    assert Plan.from_dict(old) == off
    thick_only = [fingerprint_arrays(f"t{i}", im[None], aff, lb, ["MRI"], request) for i, (im, lb, aff) in
                  enumerate([scans[LPS_3MM.name]] * 3)]  # fmt: skip
    assert not make_plan(thick_only, ["MRI"], request).acquisition_channel, "planned at its own 3 mm"

    for name, (image, label, affine) in scans.items():
        with_channel = preprocess(image[None], affine, made, label, 3)
        without = preprocess(image[None], affine, off, label, 3)
        assert with_channel.image.shape == (2, *without.image.shape[1:])
        np.testing.assert_array_equal(with_channel.image[:1], without.image)
        np.testing.assert_array_equal(with_channel.label, without.label)
        g = with_channel.geometry
        ratio = voxel_ratios(g.canonical_spacing, made.spacing)
        expected = plane_distance(g.cropped_shape, g.planned_shape, ratio)
        np.testing.assert_array_equal(with_channel.image[1], expected)
        assert with_channel.image[1].any() == (name != RAS_1MM.name), name


def _brain(margin: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A skull-stripped MR-like case: an ellipsoid of tissue (with a dark ventricle, exactly 0 inside it) in
    a box of exact zeros, `margin` voxels of zero beyond the tissue's bounding box on every side; (image
    (1, X, Y, Z), label)."""
    n = 24 + 2 * margin
    x, y, z = np.meshgrid(*[np.arange(n) - (n - 1) / 2] * 3, indexing="ij")
    inside = (x / 11.5) ** 2 + (y / 11.5) ** 2 + (z / 11.5) ** 2 <= 1
    image = np.where(inside, rng.normal(300, 40, inside.shape), 0).astype(np.float32)
    image[(x**2 + y**2 + z**2) <= 9] = 0  # a hole inside the anatomy: anatomy, not background
    label = (inside & (x > 4)).astype(np.uint8)
    return image[None], label


def test_masked_mr_is_z_scored_inside_its_non_zero_mask_as_nnunet_does():
    """Skull-stripped MR: the crop to the non-zero box keeps under 3/4 of the volume (the box's corners are
    still exact zeros), so the plan z-scores inside the non-zero mask (holes filled) and leaves the rest 0;
    the tissue then normalises the same however much zero its box holds. Data whose crop keeps most of the
    volume (every synthetic case: noise is nowhere 0), and CT, keep their rules."""
    from data.preprocess import nonzero_mask, normalize

    rng = np.random.default_rng(0)
    request = PlanRequest(patch_voxels=16**3, widths=(4, 16), max_levels=3)
    padded = [_brain(8, rng) for _ in range(3)]
    cases = [fingerprint_arrays(f"c{i}", im, np.eye(4), lb, ["FLAIR"], request) for i, (im, lb) in enumerate(padded)]
    assert cases[0].full_shape == (40, 40, 40) and cases[0].shape == (22, 22, 22)
    plan = make_plan(cases, ["FLAIR"], request)
    assert plan.normalization == ({"modality": "FLAIR", "scheme": "zscore", "mask": True},)
    assert "FLAIR: zscore inside the non-zero mask" in plan.describe()
    assert Plan.from_dict(plan.to_dict()) == plan

    image = padded[0][0]
    tight, loose = image[:, 9:-9, 9:-9, 9:-9], image[:, 4:-4, 4:-4, 4:-4]  # one tissue, two boxes
    out_tight, out_loose = normalize(tight, plan.normalization), normalize(loose, plan.normalization)
    np.testing.assert_allclose(out_loose[:, 5:-5, 5:-5, 5:-5], out_tight, rtol=1e-5, atol=1e-5)
    assert not out_loose[:, :5].any(), "outside the mask stays 0"
    inside = out_tight[0][nonzero_mask(tight)]  # the tissue and its hole
    assert abs(inside.mean()) < 1e-4 and abs(inside.std() - 1) < 1e-3
    assert tight[0, 11, 11, 11] == 0 and out_tight[0, 11, 11, 11] != 0, "the hole is normalised with the anatomy"
    plain = {"modality": "FLAIR", "scheme": "zscore"}
    unmasked = normalize(tight, [plain]), normalize(loose, [plain])
    assert np.abs(unmasked[1][:, 5:-5, 5:-5, 5:-5] - unmasked[0]).max() > 0.1, "without the mask the box decides"

    boxed = [(image[:, 9:-9, 9:-9, 9:-9], label[9:-9, 9:-9, 9:-9]) for image, label in padded]
    full = [fingerprint_arrays(f"c{i}", im, np.eye(4), lb, ["FLAIR"], request) for i, (im, lb) in enumerate(boxed)]
    assert make_plan(full, ["FLAIR"], request).normalization == (plain,), "the crop keeps most of these"
    legacy = [Fingerprint(name=c.name, spacing=c.spacing, shape=c.shape) for c in cases]
    assert make_plan(legacy, ["FLAIR"], request).normalization == (plain,), "not measured: no mask"
    ct = [fingerprint_arrays(f"c{i}", im - 1000, np.eye(4), lb, ["CT"], request) for i, (im, lb) in enumerate(padded)]
    assert make_plan(ct, ["CT"], request).normalization[0]["scheme"] == "ct"


def test_a_resumed_run_keeps_its_plan_and_says_where_the_data_no_longer_fits(tiny_dataset, tmp_path, caplog):
    import logging
    from dataclasses import replace

    from data.prepare import DataConfig, inspect, resolve_data
    from unet3d.training.loading import choose_plan

    data = DataConfig(
        data_dir=str(tiny_dataset), synthetic_dir="", synthetic_cases=0, synthetic_size=0,
        synthetic_geometry="uniform", cache_dir=str(tmp_path / "cache"), val_fraction=0.34, seed=0,
    )  # fmt: skip
    run = resolve_data(data, lambda make: make())
    request = PlanRequest(patch_voxels=16**3, widths=(4, 16), max_levels=3)
    assert inspect(run, request) == []
    fresh = choose_plan(run, request, None)
    assert fresh.spacing == (1.0, 1.0, 1.5) and fresh.num_cases == 6
    saved = replace(fresh, spacing=(1.0, 1.0, 1.0), num_cases=5)  # as if planned on other data
    logger = logging.getLogger("unet3d")
    logger.propagate = True
    with caplog.at_level(logging.WARNING, logger="unet3d"):
        kept = choose_plan(run, request, {"plan": saved.to_dict()})
    assert kept == saved, "the checkpoint's plan, not a new one"
    assert (
        "the data no longer fits the checkpoint's plan" in caplog.text
        and "spacing planned [1.0, 1.0, 1.0]" in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unet3d"):
        old = choose_plan(run, request, {"config": {"patch_size": (16, 16, 16), "features": (4, 8)}})
    assert old.orientation == "none" and old.spacing is None and "from before plans" in caplog.text


def test_a_single_protocol_dataset_is_planned_for_its_thick_slices(tmp_path, capsys):
    """`--synthetic-geometry axial` (one of mixed's protocols for every case): the pre-flight launch.sh runs
    writes every case as LPS 0.8 x 0.8 x 3 mm and plans for it: the thick axis at its own spacing and pooled
    later than the others, with 3x3x1 kernels on the first level."""
    import nibabel as nib

    from data.synthetic import folder_name
    from unet3d.training.config import parse_args
    from unet3d.training.preflight import preflight

    args = ["--synthetic-geometry", "axial", "--synthetic-cases", "6", "--synthetic-size", "32"]
    args += ["--synthetic-dir", str(tmp_path / "syn"), "--cache-dir", str(tmp_path / "cache"), "--val-fraction", "0.34"]
    assert preflight(parse_args([*args, "--out-dir", str(tmp_path / "run"), "--prepare-only"])) == 0
    out = capsys.readouterr().out
    data = tmp_path / "syn" / folder_name(6, 32, 0, "axial")
    images = sorted(data.glob("images*/*.nii.gz"))
    assert len(images) == 10
    for path in images:
        nii = nib.load(path)
        assert nib.aff2axcodes(nii.affine) == ("L", "P", "S"), path
        np.testing.assert_allclose(nii.header.get_zooms()[:3], (0.8, 0.8, 3.0), rtol=1e-6)
    assert "spacing 0.8 x 0.8 x 3 mm (median, axis 2 at its 10th percentile" in out, out
    assert "kernels 3x3x1 " in out and "strides 2x2x1 " in out, out


def test_labels_the_crop_would_remove_are_named_in_the_pre_flight(tiny_dataset, tmp_path, capsys):
    """A case whose label reaches beyond the image's non-zero box (a mask drawn past the skull-stripping): the
    crop takes those voxels away from training, which the pre-flight says, with the case and the count; with
    `--crop none` nothing is removed and nothing is said. The job still starts (exit 0): it is the data's
    owner's call."""
    import shutil

    import nibabel as nib

    from unet3d.training.config import parse_args
    from unet3d.training.preflight import preflight

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    image_path, label_path = data / "imagesTr" / "synth_001.nii.gz", data / "labelsTr" / "synth_001.nii.gz"
    img, lbl = nib.load(image_path), nib.load(label_path)
    image, label = np.asarray(img.dataobj, dtype=np.float32).copy(), np.asarray(lbl.dataobj).copy()
    image[:, :, :4] = 0  # the first 4 planes zeroed: outside the non-zero box
    label[10:14, 10:14, :4] = 1  # 64 labelled voxels there
    nib.save(nib.Nifti1Image(image, img.affine), image_path)
    nib.save(nib.Nifti1Image(label.astype(np.uint8), lbl.affine), label_path)
    lost = int(np.count_nonzero(label[:, :, :4]))
    args = ["--data-dir", str(data), "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run")]
    assert preflight(parse_args([*args, "--prepare-only"])) == 0
    out = capsys.readouterr().out
    assert f"synth_001 ({lost} voxels)" in out and "outside the image's non-zero box" in out, out
    assert "1 training case(s)" in out, "only the damaged case"
    assert preflight(parse_args([*args, "--prepare-only", "--crop", "none"])) == 0
    assert "non-zero box" not in capsys.readouterr().out


@pytest.mark.parametrize("geometry", ["isotropic", "axial", "sagittal"])
def test_each_single_protocol_geometry_writes_every_case_in_its_protocol(geometry, tmp_path):
    """`--synthetic-geometry isotropic|axial|sagittal`: every training and test image (and its label) in the
    axis codes and voxel size its protocol's name gives."""
    import nibabel as nib

    from data.synthetic import PROTOCOLS, SINGLE_PROTOCOLS, write_synthetic_dataset

    protocol = PROTOCOLS[SINGLE_PROTOCOLS.index(geometry)]
    data = write_synthetic_dataset(tmp_path / "d", 2, 16, 0, num_test=1, geometry=geometry)
    files = sorted(data.glob("*Tr/*.nii.gz")) + sorted(data.glob("*Ts/*.nii.gz"))
    assert len(files) == 6
    for path in files:
        nii = nib.load(path)
        assert "".join(nib.aff2axcodes(nii.affine)) == protocol.name[:3], path
        np.testing.assert_allclose(nii.header.get_zooms()[:3], protocol.spacing, rtol=1e-6, err_msg=str(path))
