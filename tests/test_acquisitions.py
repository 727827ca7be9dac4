"""Simulated thick slices (`data.acquisitions`): against a real thick-slice acquisition of the same phantom, and
in the training dataset, where only fine cases of a dataset that has thick ones are re-acquired."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.acquisitions import P_SIMULATE, noise_sd, simulate, thick_acquisitions, thick_slices, voxel_ratios
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

    def spy(patch, ratio, acquisitions, generator):
        out = simulate(patch, ratio, acquisitions, generator)
        changed["fine" if ratio[2] < 2 else "thick"].append(out is not patch)
        return out

    monkeypatch.setattr("data.dataset.simulate", spy)
    for i in range(len(mixed)):
        mixed[(0, i)]
    assert len(changed["fine"]) == len(changed["thick"]) == 48
    assert not any(changed["thick"]), "a thick case is not re-acquired"
    assert 0.15 < np.mean(changed["fine"]) < 0.55
