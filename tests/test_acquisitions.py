"""Simulated thick slices (`data.acquisitions`): against a real thick-slice acquisition of the same phantom, and
in the training dataset, where only fine cases of a dataset that has thick ones are re-acquired."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.acquisitions import (
    P_SIMULATE,
    noise_sd,
    plane_distance,
    simulate,
    simulated_distance,
    thick_acquisitions,
    thick_slices,
    voxel_ratios,
)
from data.augment import augment
from data.dataset import PatchDataset
from data.geometry import Geometry, _resize
from data.patches import PreparedCase, foreground_coords
from data.synthetic import NOISE_SD, Acquisition, acquire, draw_phantom, extent


def _noise_free(acquisition: Acquisition, seed: int = 3) -> np.ndarray:
    """The generator's phantom on `acquisition`'s grid without its noise (acquire's noise drawn again and
    taken off)."""
    fov = extent(40)
    phantom = draw_phantom(np.random.default_rng([seed, 0]), fov)
    image, label, _ = acquire(phantom, acquisition, fov)
    return image - np.random.default_rng(phantom.noise_seed).normal(0, NOISE_SD, label.shape).astype(np.float32)


def test_a_fine_scan_re_acquired_in_thick_slices_looks_like_the_thick_scan_of_the_same_phantom():
    fine = _noise_free(Acquisition("fine", (0, 1, 2), (1, 1, 1), (1.0, 1.0, 1.0)))
    thick = _noise_free(Acquisition("thick", (0, 1, 2), (1, 1, 1), (1.0, 1.0, 3.0)))
    assert thick.shape[2] * 3 == fine.shape[2]
    # the thick scan as preprocessing brings it to 1 mm: linear between the slices' centres
    planned = _resize(torch.from_numpy(thick)[None], fine.shape, 2)[0].numpy()
    # slabs of 3 fine voxels starting at the first voxel's edge, as the thick scan's slices do
    simulated = thick_slices(fine[None], axis=2, thickness=3.0, phase=0.0)[0]
    contrast = float(fine.max() - fine.min())
    assert np.abs(simulated - planned).max() < 0.03 * contrast
    assert np.abs(fine - planned).max() > 0.3 * contrast, "the fine scan alone is far from the thick one"
    shifted = thick_slices(fine[None], axis=2, thickness=3.0, phase=1.5)[0]
    assert np.abs(shifted - planned).max() > 0.1 * contrast, "another phase puts the slabs elsewhere"


def test_slabs_average_exactly_and_a_ramp_survives():
    rng = np.random.default_rng(0)
    image = rng.normal(size=(2, 9, 5, 4)).astype(np.float32)
    out = thick_slices(image, axis=0, thickness=3.0, phase=0.0)
    for j in range(3):  # slab j covers voxels 3j..3j+2, its centre is voxel 3j+1
        np.testing.assert_allclose(out[:, 3 * j + 1], image[:, 3 * j : 3 * j + 3].mean(1), atol=1e-5)
    ramp = np.broadcast_to(np.arange(20, dtype=np.float32)[None, None, None, :], (1, 3, 3, 20))
    out = thick_slices(ramp, axis=2, thickness=3.3, phase=0.7)
    # the voxels are a staircase along the line, so a slab that cuts a voxel averages it to within a few hundredths
    np.testing.assert_allclose(out[..., 3:-3], ramp[..., 3:-3], atol=0.05)
    assert out.dtype == np.float32 and out.shape == ramp.shape
    with pytest.raises(ValueError, match="thicker than one voxel"):
        thick_slices(image, 0, 1.0, 0.0)


def test_slabs_keep_a_voxels_noise_when_asked():
    rng = np.random.default_rng(1)
    image = rng.normal(0, 0.4, (1, 40, 40, 36)).astype(np.float32)
    assert noise_sd(image, 2)[0] == pytest.approx(0.4, rel=0.05)
    centres = (slice(None), slice(None), slice(None), slice(1, None, 3))
    plain = thick_slices(image, 2, 3.0, 0.0)[centres]
    noisy = thick_slices(image, 2, 3.0, 0.0, np.random.default_rng(2))[centres]
    assert plain.std() == pytest.approx(0.4 / np.sqrt(3), rel=0.05)
    assert noisy.std() == pytest.approx(0.4, rel=0.05)


def test_the_dataset_s_thick_acquisitions():
    iso, axial, sagittal = np.array([1, 1.11, 1]), np.array([0.8, 0.89, 3.0]), np.array([3.3, 1.0, 0.9])
    assert thick_acquisitions([iso, axial, sagittal, axial]) == ((0, 3.3), (2, 3.0))
    assert thick_acquisitions([iso, iso]) == ()
    np.testing.assert_allclose(voxel_ratios((3.0, 0.8, 0.8), (1.0, 0.9, 1.0)), [3.0, 0.8 / 0.9, 0.8])


def test_only_fine_cases_of_a_dataset_with_thick_ones_are_re_acquired_and_nothing_else_draws():
    image = np.random.default_rng(0).normal(size=(1, 8, 8, 9)).astype(np.float32)
    acquisitions = ((2, 3.0),)
    for ratio, acq in ((np.ones(3), ()), (np.array([1.0, 1.0, 3.0]), acquisitions)):
        rng = np.random.default_rng(5)
        before = rng.bit_generator.state
        assert simulate(image, ratio, acq, rng) is image
        assert rng.bit_generator.state == before, "no draw: the sample's other augmentation stays as it was"
    changed = [
        simulate(image, np.ones(3), acquisitions, np.random.default_rng([7, s])) is not image for s in range(1000)
    ]
    assert abs(np.mean(changed) - P_SIMULATE) < 0.05


def _case(name: str, spacing: tuple[float, float, float], image: np.ndarray, label: np.ndarray) -> PreparedCase:
    """A case already in a 1 mm planned space, acquired with `spacing`."""
    shape = tuple(int(round(n / s)) for n, s in zip(label.shape, spacing))
    geometry = Geometry(
        native_shape=shape,
        native_affine=tuple(tuple(r) for r in np.diag([*spacing, 1.0])),
        ornt=((0, 1), (1, 1), (2, 1)),
        crop=tuple((0, s) for s in shape),
        canonical_spacing=spacing,
        planned_shape=label.shape,
        separate_axis=None,
    )
    return PreparedCase(name, image, label, foreground_coords(label), geometry=geometry)


def test_the_patch_dataset_re_acquires_fine_cases_only_and_leaves_a_one_acquisition_dataset_alone(monkeypatch):
    rng = np.random.default_rng(0)
    label = np.zeros((12, 12, 12), np.uint8)
    label[3:9, 3:9, 3:9] = 1
    image = (label[None] * 2.0 + rng.normal(0, 0.3, (1, 12, 12, 12))).astype(np.float32)
    fine, thick = _case("fine", (1.0, 1.0, 1.0), image, label), _case("thick", (1.0, 1.0, 3.0), image, label)
    mixed = PatchDataset([fine, thick], (8, 8, 8), samples_per_epoch=96, seed=1)
    assert mixed.acquisitions == ((2, 3.0),)
    assert PatchDataset([fine, fine], (8, 8, 8), samples_per_epoch=8).acquisitions == ()
    changed = {"fine": [], "thick": []}

    def spy(patch, ratio, acquisitions, generator, **kw):
        out = simulate(patch, ratio, acquisitions, generator, **kw)
        changed["fine" if ratio[2] < 2 else "thick"].append(out is not patch)
        return out

    monkeypatch.setattr("data.dataset.simulate", spy)
    for i in range(len(mixed)):
        mixed[(0, i)]
    assert len(changed["fine"]) == len(changed["thick"]) == 48
    assert not any(changed["thick"]), "a thick case is not re-acquired"
    assert 0.15 < np.mean(changed["fine"]) < 0.55


def _distance_in_mm(source: int, planned: int, spacing: float) -> np.ndarray:
    """Each planned plane's distance to the nearest measured one, over half the spacing, worked out in
    millimetres: `source` planes `spacing` apart resampled to `planned` planes over the same extent."""
    extent = source * spacing
    centres = (np.arange(planned) + 0.5) * extent / planned
    measured = (np.arange(source) + 0.5) * spacing
    centres = np.clip(centres, measured[0], measured[-1])  # beyond the outermost plane: that plane's value
    return np.abs(centres[:, None] - measured[None, :]).min(1) / (spacing / 2)


@pytest.mark.parametrize("source, planned, spacing", [(20, 60, 3.0), (19, 63, 3.3), (11, 50, 4.5)])
def test_the_acquisition_channel_is_each_planes_distance_to_the_nearest_measured_one(source, planned, spacing):
    ratio = (planned / source, 1.0, 0.9)  # planned voxels per own voxel, thick axis first; the others fine
    channel = plane_distance((source, 40, 30), (planned, 40, 33), ratio)
    assert channel.shape == (planned, 40, 33) and channel.dtype == np.float32
    np.testing.assert_allclose(channel[:, 7, 5], _distance_in_mm(source, planned, spacing), atol=1e-5)
    assert (channel == channel[:, :1, :1]).all(), "constant across the measured planes"
    assert channel.min() == 0 and channel.max() > 0.5
    assert not plane_distance((20, 40, 30), (22, 40, 33), (1.8, 1.0, 0.9)).any(), "a fine case: 0 everywhere"


def test_a_simulated_thick_patch_gets_the_distances_of_its_own_slabs():
    rng = np.random.default_rng(3)
    image = rng.normal(size=(1, 5, 4, 13)).astype(np.float32)
    phase, thickness = 2.0, 3.0  # slabs centred on planes 0, 3, 6, 9, 12
    out = thick_slices(image, 2, thickness, phase)
    distance = simulated_distance(image.shape[1:], 2, thickness, phase)
    np.testing.assert_allclose(distance[0, 0], [0, 2 / 3, 2 / 3] * 4 + [0], atol=1e-6)
    centres = np.flatnonzero(distance[0, 0] == 0)
    for c in centres[1:-1]:  # a measured plane holds its slab's mean
        np.testing.assert_allclose(out[0, ..., c], image[0, ..., c - 1 : c + 2].mean(-1), atol=1e-5)
    between = simulated_distance((2, 2, 8), 2, 4.0, 0.0)[0, 0]  # centres at -2.5, 1.5, 5.5: no plane on one
    np.testing.assert_allclose(between, [0.75, 0.25, 0.25, 0.75] * 2, atol=1e-6)


def test_with_an_acquisition_channel_simulation_sets_it_and_augmentation_only_mirrors_it():
    rng = np.random.default_rng(0)
    data = rng.normal(size=(2, 8, 8, 9)).astype(np.float32)
    with_channel = np.concatenate([data, np.zeros((1, 8, 8, 9), np.float32)])
    acquisitions = ((2, 3.0),)
    simulated = 0
    for s in range(40):
        a = simulate(data, np.ones(3), acquisitions, np.random.default_rng([7, s]))
        b = simulate(with_channel, np.ones(3), acquisitions, np.random.default_rng([7, s]), channel=True)
        np.testing.assert_array_equal(b[:-1], a, "the images' own channels as without the channel")
        if a is not data:
            simulated += 1
            replay = np.random.default_rng([7, s])  # simulate's draws: whether, which acquisition, the phase
            replay.random(), replay.integers(1)
            expected = simulated_distance((8, 8, 9), 2, 3.0, float(replay.uniform(0, 3.0)))
            np.testing.assert_array_equal(b[-1], expected)
        else:
            assert not b[-1].any()
    assert simulated > 5
    label = (data[0] > 0).astype(np.uint8)
    marker = np.arange(8 * 8 * 9, dtype=np.float32).reshape(1, 8, 8, 9)  # tells every voxel where it went
    for s in range(30):  # nnU-Net's augmentation: noise, blur, contrast, low resolution, gamma, flips
        plain, plain_label = augment(data, label, np.random.default_rng(s), "nnunet")
        both, both_label = augment(np.concatenate([data, marker]), label, np.random.default_rng(s), "nnunet", fixed=1)
        np.testing.assert_allclose(both[:-1], plain, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(both_label, plain_label)
        assert sorted(both[-1].ravel()) == sorted(marker.ravel()), "the channel's values are only moved"
        corner = int(both[-1][0, 0, 0])  # the voxel now in the corner tells which axes were mirrored
        flips = [a for a, n in enumerate((8 * 9, 9, 1)) if (corner // n) % (8, 8, 9)[a] != 0]
        expected = np.flip(marker[0], flips) if flips else marker[0]
        np.testing.assert_array_equal(both[-1], expected)


@pytest.mark.parametrize(
    ("options", "thick", "soft", "fg"),
    [
        ([], ((2, 3.0),), True, 1 / 3),
        (["--simulate-thick-slices", "off", "--label-targets", "hard", "--fg-fraction", "0.8"], (), False, 0.8),
    ],
    ids=["defaults", "off-hard-0.8"],
)
def test_the_training_options_of_the_patches_reach_the_loader(options, thick, soft, fg):
    """`--simulate-thick-slices`, `--label-targets` and `--fg-fraction` on the command line, through the
    rank's loader (`make_loader`) to the patch dataset its workers draw from."""
    from types import SimpleNamespace

    from unet3d.training.config import parse_args
    from unet3d.training.loading import make_loader

    label = np.zeros((12, 12, 12), np.uint8)
    label[3:9, 3:9, 3:9] = 1
    image = label[None].astype(np.float32)
    cases = [_case("fine", (1.0, 1.0, 1.0), image, label), _case("thick", (1.0, 1.0, 3.0), image, label)]
    cfg = parse_args(
        [
            "--patch-size",
            "8",
            "--num-workers",
            "0",
            "--samples-per-epoch",
            "8",
            "--augmentation",
            "nnunet",
            "--batch-size",
            "2",
            *options,
        ]
    )
    rt = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(rank=0), world_size=1, device=torch.device("cpu"))
    dataset = make_loader(rt, cases).dataset
    assert (dataset.acquisitions, dataset.soft_labels, dataset.fg_fraction) == (thick, soft, fg)
