from __future__ import annotations

import dataclasses
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from data.augment import augment
from data.cache import build_cache, fingerprint_cases, is_fresh, open_case
from data.dataset import EpochSampler, PatchDataset
from data.msd import load_dataset_json, split_cases
from data.nifti import load_image, load_label, spacing
from data.patches import PreparedCase, foreground_coords, sample_patch
from data.plan import PlanRequest, legacy_plan
from data.preprocess import normalize
from data.synthetic import (
    NOISE_SD,
    PROTOCOLS,
    SUBSAMPLE_MM,
    UNIFORM,
    acquire,
    class_fractions,
    draw_phantom,
    evaluate_phantom,
    extent,
    subsample_offsets,
    write_synthetic_dataset,
)
from tests.helpers import REPO


def write_msd(root: Path, cases: dict[str, tuple[np.ndarray, np.ndarray]], labels=None, modality=None) -> Path:
    """A dataset folder with the given {name: (image, label)} arrays; images may be 4D (X, Y, Z, C)."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for name, (image, label) in cases.items():
        nib.save(nib.Nifti1Image(image, np.eye(4)), root / "imagesTr" / f"{name}.nii.gz")
        nib.save(nib.Nifti1Image(label, np.eye(4)), root / "labelsTr" / f"{name}.nii.gz")
        training.append({"image": f"./imagesTr/{name}.nii.gz", "label": f"./labelsTr/{name}.nii.gz"})
    meta = {
        "labels": labels or {"0": "background", "1": "a", "2": "b"},
        "modality": modality or {"0": "MRI"},
        "training": training,
        "test": [],
    }
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


# --- dataset.json ---------------------------------------------------------------------------------------


def test_load_dataset_json(tiny_dataset):
    spec = load_dataset_json(tiny_dataset)
    assert spec.num_classes == 3 and spec.in_channels == 1
    assert spec.class_names == ["background", "organ", "lesion"]
    assert [c.name for c in spec.training] == [f"synth_{i:03d}" for i in range(6)]
    assert all(c.image.is_file() and c.label.is_file() for c in spec.training)
    assert [c.name for c in spec.test] == ["synth_006", "synth_007"]
    assert all(c.label is not None and c.label.parent.name == "labelsTs" for c in spec.test)


def test_nnunet_v2_style_labels(tmp_path):
    label = np.zeros((4, 4, 4), np.uint8)
    root = write_msd(
        tmp_path / "d",
        {"x": (np.zeros((4, 4, 4), np.float32), label)},
        labels={"background": 0, "liver": 1},
        modality={"0": "CT"},
    )
    spec = load_dataset_json(root)
    assert spec.labels == {0: "background", 1: "liver"} and spec.modality == {0: "CT"}


def test_dataset_json_errors(tmp_path, tiny_dataset):
    with pytest.raises(FileNotFoundError, match="no dataset.json in"):
        load_dataset_json(tmp_path)
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_dataset_json(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dataset, copy)
    meta = json.loads((copy / "dataset.json").read_text())
    (copy / "imagesTr" / "synth_001.nii.gz").unlink()
    (copy / "labelsTr" / "synth_004.nii.gz").unlink()
    with pytest.raises(FileNotFoundError, match="2 missing") as err:
        load_dataset_json(copy)
    assert "imagesTr/synth_001.nii.gz" in str(err.value) and "labelsTr/synth_004.nii.gz" in str(err.value)
    meta["labels"] = {"0": "background", "2": "gap"}
    (copy / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"indices must be 0..1, got \[0, 2\]"):
        load_dataset_json(copy)
    meta["labels"] = {"0": "background", "1": "x"}
    meta["training"] = [{"image": "./imagesTr/synth_000.nii.gz"}]
    (copy / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"training\[0\] must have 'image' and 'label'"):
        load_dataset_json(copy)
    # nulls, which hand-edited and converted files carry: one message naming the field, never a TypeError
    good = {"image": "./imagesTr/synth_000.nii.gz", "label": "./labelsTr/synth_000.nii.gz"}
    for training, test, message in [
        ([{**good, "label": None}], [], r"training\[0\] must give 'image' and 'label' as file paths, got .*None"),
        ([good], [None], r"test\[0\] must be an image path .*got None"),
        ([good], "imagesTs/synth_006.nii.gz", r"'test' must be a list of image paths, got 'imagesTs"),
    ]:
        (copy / "dataset.json").write_text(json.dumps({**meta, "training": training, "test": test}))
        with pytest.raises(ValueError, match=message):
            load_dataset_json(copy, require_files=False)
    (copy / "dataset.json").write_text(json.dumps({**meta, "training": [good], "test": None}))
    assert load_dataset_json(copy, require_files=False).test == (), "a null test list lists no test images"


def test_cases_are_named_by_the_listed_files_not_by_their_link_targets(tiny_dataset, tmp_path):
    store, root = tmp_path / "annex", tmp_path / "linked"
    store.mkdir()
    for folder in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        (root / folder).mkdir(parents=True)
        for i, source in enumerate(sorted((tiny_dataset / folder).iterdir())):
            target = store / f"MD5E-s{i}--{folder}{i}.nii.gz"  # as git-annex and DataLad store content
            shutil.copy(source, target)
            (root / folder / source.name).symlink_to(target)
    shutil.copy(tiny_dataset / "dataset.json", root)
    spec, plain = load_dataset_json(root), load_dataset_json(tiny_dataset)
    assert [c.name for c in spec.training] == [c.name for c in plain.training]
    assert [(c.name, c.label is not None) for c in spec.test] == [(c.name, True) for c in plain.test]
    assert spec.training[0].image == root / "imagesTr" / f"{spec.training[0].name}.nii.gz"


def test_split_is_deterministic_and_disjoint(tiny_dataset):
    cases = load_dataset_json(tiny_dataset).training
    train, val = split_cases(cases, 0.34, seed=3)
    assert len(val) == 2 and len(train) == 4
    assert {c.name for c in train}.isdisjoint(c.name for c in val)
    assert split_cases(list(reversed(cases)), 0.34, seed=3) == (train, val)
    other_seeds = {frozenset(c.name for c in split_cases(cases, 0.34, seed=s)[1]) for s in range(4, 10)}
    assert len(other_seeds) > 1, "the seed must change the split"
    with pytest.raises(ValueError, match="leaving none to train on"):
        split_cases(cases[:1], 0.5, 0)


# --- NIfTI and normalisation -----------------------------------------------------------------------------


def test_multichannel_image_is_channel_first(tmp_path):
    image = np.stack([np.full((4, 5, 6), c, np.float32) for c in range(3)], axis=-1)  # (X, Y, Z, C)
    nib.save(nib.Nifti1Image(image, np.diag([0.5, 0.7, 2.0, 1])), tmp_path / "img.nii.gz")
    loaded, img = load_image(tmp_path / "img.nii.gz")
    assert loaded.shape == (3, 4, 5, 6) and loaded.dtype == np.float32
    assert [loaded[c].mean() for c in range(3)] == [0, 1, 2]
    assert spacing(img) == pytest.approx((0.5, 0.7, 2.0))


def test_metrics_spacing_is_the_affines_where_sform_and_qform_disagree(tmp_path):
    """A tool that rewrote only the sform leaves pixdim (the qform's zooms) behind: voxel sizes come from the
    affine nibabel places the voxels by, the one preprocessing resamples by."""
    img = nib.Nifti1Image(np.zeros((4, 5, 6), np.float32), np.diag([0.8, 0.8, 3.0, 1]))
    img.set_qform(np.diag([1.0, 1.0, 1.5, 1]), code=1)
    nib.save(img, tmp_path / "img.nii.gz")
    loaded = nib.load(tmp_path / "img.nii.gz")
    assert loaded.header.get_zooms()[:3] == pytest.approx((1.0, 1.0, 1.5)), "the stand-in disagrees as meant"
    assert spacing(loaded) == pytest.approx((0.8, 0.8, 3.0))


def test_label_out_of_range_is_refused(tmp_path):
    nib.save(nib.Nifti1Image(np.full((2, 2, 2), 300, np.int16), np.eye(4)), tmp_path / "l.nii.gz")
    with pytest.raises(ValueError, match=r"l.nii.gz: label values must lie in 0..255"):
        load_label(tmp_path / "l.nii.gz")


def test_a_float_label_must_hold_integers(tmp_path):
    whole = np.zeros((2, 2, 2), np.float32)
    whole[0, 0, 0], whole[1, 1, 1] = 2.0, 1.0000001  # integers, up to rounding
    nib.save(nib.Nifti1Image(whole, np.eye(4)), tmp_path / "whole.nii.gz")
    assert load_label(tmp_path / "whole.nii.gz")[0].tolist() == [[[2, 0], [0, 0]], [[0, 0], [0, 1]]]
    interpolated = whole.copy()
    interpolated[0, 1, 0] = 0.5  # between background and class 1: rounding would pick one silently
    nib.save(nib.Nifti1Image(interpolated, np.eye(4)), tmp_path / "l.nii.gz")
    with pytest.raises(ValueError, match=r"l.nii.gz: label map holds 1 non-integer value\(s\), e.g. 0.5"):
        load_label(tmp_path / "l.nii.gz")


def test_normalize_zscore_and_ct_clipping():
    rng = np.random.default_rng(0)
    zscore, per_case = {"modality": "MRI", "scheme": "zscore"}, {"modality": "CT", "scheme": "ct-per-case"}
    mri = rng.normal(300, 40, (1, 20, 20, 20)).astype(np.float32)
    out = normalize(mri, [zscore])
    assert abs(out.mean()) < 1e-4 and abs(out.std() - 1) < 1e-3
    ct = rng.normal(40, 10, (1, 20, 20, 20)).astype(np.float32)
    ct[0, 0, 0, :5] = 3000  # metal: clipped before the z-score
    out = normalize(ct, [per_case])
    assert out.max() < 4 and abs(out.mean()) < 1e-4
    unclipped = normalize(ct, [zscore])
    assert unclipped.max() > 20
    dataset = {"modality": "CT", "scheme": "ct", "clip": [0.0, 80.0], "mean": 40.0, "std": 10.0}
    out = normalize(ct, [dataset])
    np.testing.assert_allclose(out, (np.clip(ct, 0, 80) - 40) / 10, rtol=1e-6, atol=1e-6)
    for value in (0.1, 3.3, -1024.3):  # a channel that carries nothing normalises to 0, whatever its value
        assert not normalize(np.full((1, 7, 9, 11), value, np.float32), [zscore]).any()
    assert out.max() == 4.0, "the dataset's statistics, not the case's"
    with pytest.raises(ValueError, match="1 channel"):
        normalize(ct, [per_case, zscore])


# --- patches and augmentation ----------------------------------------------------------------------------


def make_case(shape=(20, 18, 16), channels=2) -> PreparedCase:
    rng = np.random.default_rng(0)
    label = np.zeros(shape, np.uint8)
    label[2:5, 3:6, 4:7] = 1
    label[15:17, 14:16, 12:14] = 2
    image = rng.normal(size=(channels, *shape)).astype(np.float32)
    return PreparedCase("c", image, label, foreground_coords(label))


def test_patch_shape_dtype_and_forced_foreground():
    case = make_case()
    rng = np.random.default_rng(0)
    for _ in range(50):
        image, label = sample_patch(case, (8, 8, 8), rng, force_fg=True)
        assert image.shape == (2, 8, 8, 8) and image.dtype == np.float32
        assert label.shape == (8, 8, 8) and label.dtype == np.uint8
        assert label.any(), "a foreground-forced patch must contain foreground"
    random_hits = sum(sample_patch(case, (8, 8, 8), rng, force_fg=False)[1].any() for _ in range(200))
    assert random_hits < 150  # foreground is small: unforced patches often miss it


def test_patch_matches_source_voxels():
    case = make_case()
    image, label = sample_patch(case, (20, 18, 16), np.random.default_rng(1), force_fg=False)
    np.testing.assert_array_equal(image, case.image)
    np.testing.assert_array_equal(label, case.label)


def test_small_volume_is_padded():
    case = make_case(shape=(6, 10, 4), channels=1)
    case.label[:] = 0
    case.label[1, 1, 1] = 1
    case.fg_coords = foreground_coords(case.label)
    image, label = sample_patch(case, (8, 16, 8), np.random.default_rng(0), force_fg=True)
    assert image.shape == (1, 8, 16, 8) and label.shape == (8, 16, 8)
    assert label.sum() == 1 and np.count_nonzero(image) == 6 * 10 * 4


def test_augment_keeps_image_and_label_aligned():
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, (8, 8, 8)).astype(np.uint8)
    image = label[None].astype(np.float32) * 10  # image encodes the label
    flips = 0
    for seed in range(20):
        aug_image, aug_label = augment(image.copy(), label.copy(), np.random.default_rng(seed))
        assert aug_image.shape == image.shape and aug_label.dtype == np.uint8
        # intensity changes are monotonic, so voxel order by intensity still follows the label
        for cls in range(2):
            assert aug_image[0][aug_label == cls].max() < aug_image[0][aug_label == cls + 1].min()
        flips += not np.array_equal(aug_label, label)
    assert flips > 10


# --- the epoch: sharding, workers, reproducibility -------------------------------------------------------


@pytest.fixture
def dataset() -> PatchDataset:
    return PatchDataset([make_case(), make_case((16, 16, 16), 2)], (8, 8, 8), samples_per_epoch=32, seed=5)


def test_items_are_tensors_with_valid_labels(dataset):
    image, label = dataset[(0, 3)]
    assert image.shape == (2, 8, 8, 8) and image.dtype == torch.float32
    assert label.shape == (8, 8, 8) and label.dtype == torch.uint8
    assert int(label.max()) < 3
    assert torch.equal(dataset[(0, 3)][0], image), "a sample depends only on (seed, epoch, index)"
    assert not torch.equal(dataset[(1, 3)][0], image), "the same index differs in the next epoch"


def test_foreground_share(dataset):
    forced = [dataset.plan(epoch, i)[1] for epoch in range(20) for i in range(len(dataset))]
    assert abs(np.mean(forced) - 1 / 3) < 0.05
    dataset.fg_fraction = 1.0
    assert all(dataset[(0, i)][1].any() for i in range(len(dataset)))


def test_rank_shards_are_disjoint_and_cover_the_epoch(dataset):
    for epoch in (0, 1):
        shards = []
        for rank in range(2):
            sampler = EpochSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            keys = list(sampler)
            assert all(e == epoch for e, _ in keys)
            shards.append([i for _, i in keys])
        assert set(shards[0]).isdisjoint(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(len(dataset)))
    sampler = EpochSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert [i for _, i in sampler] != [i for _, i in first], "set_epoch must change the order"


def _patches(dataset, rank, num_workers) -> list[bytes]:
    sampler = EpochSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=num_workers)
    return [img.numpy().tobytes() for images, _ in loader for img in images]


def test_workers_and_ranks_draw_different_patches(dataset):
    rank0 = _patches(dataset, 0, num_workers=2)
    rank1 = _patches(dataset, 1, num_workers=2)
    assert len(rank0) == len(rank1) == 16
    assert len(set(rank0 + rank1)) == 32, "no two patches of an epoch may be the same"
    assert _patches(dataset, 0, num_workers=0) == rank0, "patches must not depend on the number of workers"


# --- synthetic data and the cache ------------------------------------------------------------------------


def test_synthetic_dataset_is_deterministic_and_rich(tmp_path):
    a = write_synthetic_dataset(tmp_path / "a", num_cases=3, size=32, seed=7, num_test=1)
    b = write_synthetic_dataset(tmp_path / "b", num_cases=3, size=32, seed=7, num_test=1)
    spec = load_dataset_json(a)
    assert len(spec.training) == 3 and len(spec.test) == 1 and spec.num_classes == 3
    for case in spec.training:
        img_a, nii = load_image(case.image)
        img_b, _ = load_image(b / "imagesTr" / case.image.name)
        np.testing.assert_array_equal(img_a, img_b)
        assert spacing(nii) == (1.0, 1.0, 1.5)
    labels = np.stack([load_label(c.label)[0] for c in spec.training])
    assert set(np.unique(labels)) == {0, 1, 2}
    c = write_synthetic_dataset(tmp_path / "c", num_cases=3, size=32, seed=8, num_test=1)
    assert not np.array_equal(load_image(c / "imagesTr/synth_000.nii.gz")[0], load_image(spec.training[0].image)[0])
    assert not any(p.name.startswith("c.tmp") for p in tmp_path.iterdir())


def test_cases_written_by_several_processes_are_those_one_process_writes(tmp_path, monkeypatch):
    """The cases are written by forked workers; each depends only on the seed and its index, so one
    process writes the same files, in the same places, with the same dataset.json. A worker's error reaches
    the caller and leaves no dataset behind."""
    import data.synthetic as synthetic

    assert synthetic._writers(5) == min(5, 8, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(synthetic, "_writers", lambda n: 2)
    several = write_synthetic_dataset(tmp_path / "several", num_cases=3, size=24, seed=3, num_test=2, geometry="mixed")
    monkeypatch.setattr(synthetic, "_writers", lambda n: 1)
    one = write_synthetic_dataset(tmp_path / "one", num_cases=3, size=24, seed=3, num_test=2, geometry="mixed")
    assert (several / "dataset.json").read_text() == (one / "dataset.json").read_text()
    files = sorted(p.relative_to(one) for p in one.rglob("*.nii.gz"))
    assert len(files) == 10 and files == sorted(p.relative_to(several) for p in several.rglob("*.nii.gz"))
    for name in files:
        a, b = nib.load(several / name), nib.load(one / name)
        np.testing.assert_array_equal(np.asarray(a.dataobj), np.asarray(b.dataobj), err_msg=str(name))
        np.testing.assert_array_equal(a.affine, b.affine)

    monkeypatch.setattr(synthetic, "_writers", lambda n: 2)
    with pytest.raises(ValueError, match="synthetic geometry must be one of"):
        write_synthetic_dataset(tmp_path / "bad", num_cases=3, size=24, seed=3, num_test=0, geometry="oblique")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "several"], "no folder of the failed write"


def test_every_voxel_integrates_its_box_finely_and_skips_only_voxels_no_boundary_crosses():
    """A voxel's intensity is the mean of the phantom over sub-samples at most SUBSAMPLE_MM apart that span its
    box (the earlier generator took one sample per mm across thick slices, 4 across 3.3 mm, and none but the
    centre across thin axes); voxels that no surface can reach take their centre's value, and that shortcut
    changes nothing: the image equals the brute-force mean over every sub-sample of each voxel (a random tenth
    of them, up to the bias field's variation inside a voxel). A noise-free reader who knows each voxel's class
    fractions (the majority class) recovers the centre labels."""
    fov = extent(40)
    for protocol in (UNIFORM, *PROTOCOLS):
        offsets = subsample_offsets(protocol)
        for axis, size in enumerate(protocol.spacing):
            steps = np.unique(np.round(offsets[:, axis], 9))
            assert len(steps) % 2 == 1 and 0.0 in steps, "odd, centred"
            assert np.diff(steps).max() * size <= SUBSAMPLE_MM + 1e-9, (protocol.name, axis)
            assert np.isclose(steps.max() - steps.min(), 1 - 1 / len(steps)), "spans the voxel"
        hits, sizes = np.zeros(3), np.zeros(3)
        for index in range(2):
            phantom = draw_phantom(np.random.default_rng([0, index]), fov)
            image, label, affine = acquire(phantom, protocol, fov)
            if index == 0:
                image -= np.random.default_rng(phantom.noise_seed).normal(0, NOISE_SD, label.shape).astype(np.float32)
                points = np.stack(np.meshgrid(*[np.arange(n, dtype=float) for n in label.shape], indexing="ij"), -1)
                some = np.random.default_rng(0).random(label.shape) < 0.1  # a tenth of the voxels, near and far
                points = points[some]
                world = [(points + o) @ affine[:3, :3].T + affine[:3, 3] for o in offsets]
                brute = np.mean([evaluate_phantom(phantom, w, fov)[0] for w in world], axis=0)
                assert np.abs(image[some] - brute).max() < 0.5, protocol.name  # intensities 20..150; bias in a voxel
            fractions = class_fractions(phantom, protocol, fov)
            assert np.allclose(fractions.sum(0), 1)
            assert ((fractions > 0) & (fractions < 1)).any(), "partial volume on every protocol"
            reader = fractions.argmax(0)
            for k in (1, 2):
                hits[k] += 2 * ((reader == k) & (label == k)).sum()
                sizes[k] += (reader == k).sum() + (label == k).sum()
        assert (hits[1:] / sizes[1:] > 0.95).all(), (protocol.name, hits[1:] / sizes[1:])


def as_stored(modalities=("MRI",)):
    """The plan that uses cases as stored (no reorientation, resampling or crop), z-scored per case."""
    return legacy_plan(list(modalities), (16, 16, 16), (4, 8))


def test_cache_round_trip_and_staleness(tiny_dataset, tmp_path):
    spec = load_dataset_json(tiny_dataset)
    cache = tmp_path / "cache"
    plan = as_stored()
    assert build_cache(spec.training, plan, 3, cache, shard=0, num_shards=2) == []
    assert build_cache(spec.training, plan, 3, cache, shard=1, num_shards=2) == []
    case = spec.training[2]
    assert is_fresh(case, plan, 3, cache)
    cached = open_case(case, cache)
    assert isinstance(cached.image, np.memmap) and not cached.image.flags.writeable
    np.testing.assert_allclose(cached.image, normalize(load_image(case.image)[0], plan.normalization))
    np.testing.assert_array_equal(cached.label, load_label(case.label)[0])
    np.testing.assert_array_equal(cached.native_label, load_label(case.label)[0])
    assert cached.geometry.planned_shape == cached.label.shape
    assert set(cached.fg_coords) == set(np.unique(cached.label)) - {0}
    for cls, coords in cached.fg_coords.items():
        assert (cached.label[tuple(coords.T)] == cls).all()
    assert not is_fresh(case, as_stored(["CT"]), 3, cache), "another normalisation is another plan"
    st = case.image.stat()
    os.utime(case.image, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert not is_fresh(case, plan, 3, cache), "a changed source file must be rebuilt"
    finally:
        os.utime(case.image, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_cache_the_disk_refuses_is_said_as_such_not_as_bad_cases(tiny_dataset, tmp_path):
    """The kernel's own refusal (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) while a cache file is written:
    an OSError that keeps its errno and names the file, never "problems with the dataset" for every case
    (ndarray.tofile's short-write error, which carries no errno, read that way); no temporary file is left."""
    spec = load_dataset_json(tiny_dataset)
    cache = tmp_path / "cache"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    try:
        with pytest.raises(OSError) as caught:
            build_cache(spec.training, as_stored(), 3, cache)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught.value.errno == errno.EFBIG and caught.value.filename.endswith("_image.npy")
    assert Path(caught.value.filename).parent == cache
    assert [p for p in cache.rglob("*") if p.is_file()] == []
    assert build_cache(spec.training, as_stored(), 3, cache) == [], "with room, the same call builds it"
    case = spec.training[0]
    np.testing.assert_array_equal(open_case(case, cache).label, load_label(case.label)[0])


def test_datasets_sharing_a_cache_keep_their_own_cases_and_a_copy_that_kept_size_and_mtime_is_seen(
    tiny_dataset, tmp_path
):
    """A corrected copy of the labels (same case names, same images) beside the original, both cached in one
    --cache-dir: each dataset opens its own labels, before and after the other one was built. Then a label
    overwritten by a copy that kept its size and mtime (`cp -p`, `rsync -a`) is rebuilt."""
    corrected = tmp_path / "corrected"
    shutil.copytree(tiny_dataset, corrected)
    case = load_dataset_json(corrected).training[2]
    label, nii = load_label(case.label)
    nib.save(nib.Nifti1Image(np.where(label == 2, 1, label).astype(np.uint8), nii.affine), case.label)
    cache, plan = tmp_path / "cache", as_stored()
    original, copy = load_dataset_json(tiny_dataset), load_dataset_json(corrected)
    for spec in (original, copy, original):  # each build after the other's
        assert build_cache(spec.training, plan, 3, cache) == []
    for spec in (original, copy):
        ours = spec.training[2]
        np.testing.assert_array_equal(open_case(ours, cache).label, load_label(ours.label)[0], err_msg=str(ours.label))
    assert 2 not in np.unique(open_case(copy.training[2], cache).label)

    before, data = case.label.stat(), bytearray(case.label.read_bytes())
    data[4:8] = (int.from_bytes(data[4:8], "little") ^ 0xFFFF).to_bytes(4, "little")  # gzip's own time stamp
    case.label.write_bytes(bytes(data))  # other bytes, the same size
    os.utime(case.label, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = case.label.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert not is_fresh(case, plan, 3, cache), "the copy kept the size and the mtime, not the bytes"


def test_checks_report_every_broken_case(tmp_path):
    good = (np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8))
    bad_shape = (np.zeros((4, 4, 4), np.float32), np.zeros((4, 4, 5), np.uint8))
    root = write_msd(tmp_path / "d", {"good": good, "bad1": bad_shape, "bad2": bad_shape})
    spec = load_dataset_json(root)
    errors = fingerprint_cases(
        spec.training, spec, PlanRequest(patch_voxels=64, widths=(4, 8), max_levels=2), tmp_path / "cache", 0, 1
    )
    assert len(errors) == 2 and all("spatial shape (4, 4, 4)" in e and "(4, 4, 5)" in e for e in errors)
    assert {e.split(":")[0] for e in errors} == {"bad1", "bad2"}


def test_a_channel_count_other_than_the_modalities_is_named_before_planning(tmp_path):
    label = np.zeros((4, 4, 4), np.uint8)
    label[1:3, 1:3, 1:3] = 1  # CT foreground to sample intensities from
    three_d = (np.full((4, 4, 4), -500, np.float32), label)
    three_channels = (np.full((4, 4, 4, 3), -500, np.float32), label)
    root = write_msd(tmp_path / "d", {"a": three_d, "b": three_channels}, modality={"0": "CT", "1": "CT"})
    spec = load_dataset_json(root)
    request = PlanRequest(patch_voxels=64, widths=(4, 8), max_levels=2)
    errors = fingerprint_cases(spec.training, spec, request, tmp_path / "cache", 0, 1)  # no IndexError
    assert sorted(errors) == [
        f"a: {root / 'imagesTr' / 'a.nii.gz'} has 1 channel(s) but dataset.json 'modality' declares 2 (CT, CT)",
        f"b: {root / 'imagesTr' / 'b.nii.gz'} has 3 channel(s) but dataset.json 'modality' declares 2 (CT, CT)",
    ]
    assert not (tmp_path / "cache" / "fingerprints").exists(), "no fingerprint of a refused case"


def test_a_class_dropped_from_dataset_json_is_checked_again(tiny_dataset, tmp_path):
    spec = load_dataset_json(tiny_dataset)
    request = PlanRequest(patch_voxels=64, widths=(4, 8), max_levels=2)
    assert fingerprint_cases(spec.training, spec, request, tmp_path / "cache", 0, 1) == []
    fewer = dataclasses.replace(spec, labels={0: "background", 1: "organ"})  # "lesion" taken out of 'labels'
    errors = fingerprint_cases(fewer.training, fewer, request, tmp_path / "cache", 0, 1)
    assert len(errors) == len(spec.training) and all("label value(s) [2] not declared" in e for e in errors)


def test_spatial_augmentation_keeps_the_label_on_the_transformed_sphere():
    """A labelled sphere, rotated and scaled with its label: the label still covers the sphere in the image."""
    from data.augment import sample_transformed, spatial_transform

    shape, radius = np.array([48, 48, 40]), 10.0
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"))
    centre = np.array([20.0, 26.0, 18.0])  # off the volume's centre
    inside = ((grid - centre.reshape(3, 1, 1, 1)) ** 2).sum(0) <= radius**2
    image, label = inside[None].astype(np.float32) * 10.0, inside.astype(np.uint8)
    transforms = [m for m in (spatial_transform(np.random.default_rng(s)) for s in range(200)) if m is not None]
    assert len(transforms) > 40, "rotations and scalings do happen"
    patch = np.array([32, 32, 24])
    for matrix in transforms[:10] + [np.diag([1.3, 1.3, 1.3]) @ _rotation(0.5)]:
        aug_image, aug_label = sample_transformed(image, label, centre + 1.5, patch, matrix)
        assert aug_image.shape == (1, *patch) and aug_label.shape == tuple(patch)
        sphere = aug_image[0] > 5
        assert sphere.sum() > 100
        overlap = 2 * (sphere & (aug_label == 1)).sum() / (sphere.sum() + (aug_label == 1).sum())
        assert overlap > 0.95, "the label moves with the image"
        # and it is where the transform puts the sphere: offset 1.5 from the centre, radius / scale
        offsets = np.stack(np.meshgrid(*[np.arange(p) - (p - 1) / 2 for p in patch], indexing="ij"))
        world = np.tensordot(matrix, offsets, axes=1) + 1.5
        expected = (world**2).sum(0) <= radius**2
        assert 2 * (expected & sphere).sum() / (expected.sum() + sphere.sum()) > 0.95


def test_an_anisotropic_patch_is_rotated_and_scaled_in_plane_only():
    """Thick slices (a patch of 40x40x8, the plan not pooling z): the thick axis maps to itself, as nnU-Net's
    in-plane augmentation; a near-isotropic patch gets out-of-plane rotations too."""
    from data.augment import spatial_transform

    thick = [m for m in (spatial_transform(np.random.default_rng(s), (40, 40, 8)) for s in range(300)) if m is not None]
    assert len(thick) > 60
    for m in thick:
        assert np.allclose(m[:, 2], [0, 0, 1]) and np.allclose(m[2, :], [0, 0, 1]), m
    assert any(abs(m[0, 1]) > 0.1 for m in thick), "in-plane rotations happen"
    assert any(abs(m[0, 0] - 1) > 0.1 and abs(m[0, 1]) < 1e-12 for m in thick), "in-plane scalings happen"
    cube = [m for m in (spatial_transform(np.random.default_rng(s), (32, 32, 24)) for s in range(300)) if m is not None]
    assert any(abs(m[2, 0]) > 0.1 or abs(m[2, 1]) > 0.1 for m in cube), "out-of-plane rotations on a cube"
    # in-plane, the whole circle as nnU-Net turns thick slices (it was +-30 degrees, the 3D range): a rotation
    # beyond 90 degrees has a negative cosine on the plane's diagonal
    turned = [m for m in thick if abs(m[0, 1]) > 1e-12]
    assert (
        any(m[0, 0] < -0.5 for m in turned) and max(abs(np.degrees(np.arctan2(m[1, 0], m[0, 0]))) for m in turned) > 150
    )


def test_simulated_low_resolution_leaves_a_thick_slice_patchs_short_axis_alone():
    """Averaging thick slices together is no acquisition's: it cut the contrast between neighbouring slices
    of a 96x96x16 patch from 1 to 0.1 (nnU-Net ignores that axis). In-plane it still blurs; a cube on all axes."""
    from data.augment import _low_resolution

    slices = np.tile((np.arange(16) % 2).astype(np.float32), (96, 96, 1))  # alternating slices along z
    low = _low_resolution(slices, 0.5)
    assert np.allclose(low, slices, atol=1e-4), "every slice kept"
    stripes = np.tile((np.arange(96) % 2).astype(np.float32)[:, None, None], (1, 96, 16))  # along x
    assert np.abs(_low_resolution(stripes, 0.5) - stripes).max() > 0.4, "in-plane detail is still lost"
    cube = np.tile((np.arange(32) % 2).astype(np.float32), (32, 32, 1))
    assert np.abs(_low_resolution(cube, 0.5) - cube).max() > 0.4, "a near-isotropic patch on every axis"


def _rotation(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def test_nnunet_intensity_augmentation_leaves_the_label_alone():
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, (16, 16, 12)).astype(np.uint8)
    image = np.stack([label.astype(np.float32), rng.normal(size=label.shape).astype(np.float32)])
    changed = 0
    for seed in range(30):
        aug_image, aug_label = augment(image.copy(), label.copy(), np.random.default_rng(seed), "nnunet")
        assert aug_image.shape == image.shape and np.isfinite(aug_image).all()
        flipped = [
            a for a in range(3) if not np.array_equal(aug_label, label) and np.array_equal(aug_label, np.flip(label, a))
        ]
        assert np.array_equal(aug_label, label) or flipped or aug_label.sum() == label.sum(), "only flips move it"
        changed += not np.allclose(aug_image, image)
    assert changed > 20


LOADER_SCRIPT = """
import os, sys, time
sys.path.insert(0, {repo!r})
from torch.utils.data import DataLoader, Dataset
from data.dataset import ignore_stop_signals

class Pids(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return os.getpid()

loader = DataLoader(Pids(), batch_size=1, num_workers=1, persistent_workers=True, worker_init_fn=ignore_stop_signals)
batches = iter(loader)
print(int(next(batches)[0]), flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie that nobody reaped (a container's PID 1 may never reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_killed_training_processs_loader_workers_die_with_it():
    """A rank killed by SIGKILL (the OOM killer, a crash) takes its DataLoader workers with it at once: they
    hold its inherited sockets, and while they live the other ranks do not learn that it died (the loader's
    own watchdog looks every 5 s)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADER_SCRIPT.format(repo=str(REPO))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker = int(proc.stdout.readline())
        assert worker != proc.pid and _alive(worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 2.0  # the watchdog alone would take up to 5 s
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(worker), "the worker outlived its killed parent"
    finally:
        proc.kill()


def test_itk_multi_component_files_are_read_as_channels(tmp_path):
    """ITK and SimpleITK write a vector image as 5D (X, Y, Z, 1, C), a label as (X, Y, Z, 1, 1)."""
    image = np.random.default_rng(0).normal(size=(5, 6, 7, 1, 2)).astype(np.float32)
    label = np.zeros((5, 6, 7, 1, 1), np.uint8)
    label[1:3, 2:4, 3:5] = 2
    nib.save(nib.Nifti1Image(image, np.diag([0.8, 0.8, 3.0, 1.0])), tmp_path / "image.nii.gz")
    nib.save(nib.Nifti1Image(label, np.diag([0.8, 0.8, 3.0, 1.0])), tmp_path / "label.nii.gz")
    channels, _ = load_image(tmp_path / "image.nii.gz")
    assert channels.shape == (2, 5, 6, 7)
    np.testing.assert_array_equal(channels[1], image[:, :, :, 0, 1])
    seg, _ = load_label(tmp_path / "label.nii.gz")
    assert seg.shape == (5, 6, 7) and int(seg.sum()) == 2 * 8
    nib.save(nib.Nifti1Image(image.reshape(5, 6, 7, 2, 1), np.eye(4)), tmp_path / "time.nii.gz")
    with pytest.raises(ValueError, match=r"time.nii.gz: expected a 3D or 4D image, got shape \(5, 6, 7, 2, 1\)"):
        load_image(tmp_path / "time.nii.gz")


def test_a_label_on_its_images_grid_in_another_voxel_order_is_brought_into_the_images_order(tiny_dataset, tmp_path):
    """A tool that wrote the label in another voxel order (axes permuted and flipped) beside its scan: the
    voxels lie at the image's world positions, so the label is reordered losslessly, not refused as a label
    whose voxels are elsewhere; a label truly elsewhere (shifted 3 mm) is still refused."""
    from unet3d.training.config import parse_args
    from unet3d.training.preflight import preflight

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    path = data / "labelsTr" / "synth_002.nii.gz"
    stored = nib.load(path)
    label = np.asarray(stored.dataobj)
    order = np.array([[2, -1], [0, 1], [1, -1]])  # z first, flipped; then x; then y, flipped
    moved = nib.orientations.apply_orientation(label, order)
    nib.save(nib.Nifti1Image(moved, stored.affine @ nib.orientations.inv_ornt_aff(order, label.shape)), path)
    image = nib.load(data / "imagesTr" / "synth_002.nii.gz")
    assert nib.load(path).shape != image.shape[:3]
    read, read_nii = load_label(path, image)
    assert np.array_equal(read, label) and np.allclose(read_nii.affine, image.affine)
    assert np.array_equal(load_label(path)[0], moved), "without its image: as stored"
    args = ["--data-dir", str(data), "--out-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]
    assert preflight(parse_args([*args, "--val-fraction", "0.5", "--prepare-only"])) == 0

    shifted = stored.affine.copy()
    shifted[:3, 3] += 3.0
    nib.save(nib.Nifti1Image(label, shifted), path)
    read, read_nii = load_label(path, image)
    assert np.array_equal(read_nii.affine, shifted), "not on the grid: returned as stored, for the check to refuse"


def test_cases_whose_header_records_no_orientation_are_named_when_reoriented(tiny_dataset, tmp_path):
    """qform_code and sform_code 0: nibabel's affine is then a guess that flips x (Analyze's convention), so
    reorienting such a case to RAS may mirror it against the others: named in a warning, not used silently."""
    from data.cache import load_fingerprints
    from data.plan import unoriented_cases

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    for folder in ("imagesTr", "labelsTr"):
        path = data / folder / "synth_003.nii.gz"
        img = nib.load(path)
        bare = nib.Nifti1Image(np.asarray(img.dataobj), None)
        bare.set_qform(None, code=0)
        bare.set_sform(None, code=0)
        nib.save(bare, path)
    spec = load_dataset_json(data)
    request = PlanRequest(patch_voxels=64, widths=(4, 8), max_levels=2)
    assert fingerprint_cases(spec.training, spec, request, tmp_path / "cache", 0, 1) == []
    found = load_fingerprints(spec.training, request, tmp_path / "cache")
    assert [f.name for f in found if f.unoriented] == ["synth_003"]
    warning = unoriented_cases(found, "RAS")
    assert warning.startswith("1 training case(s) record no orientation (qform_code and sform_code 0)")
    assert "synth_003" in warning and unoriented_cases(found, "none") is None


def test_a_resumed_run_keeps_its_checkpoints_validation_cases_when_the_data_splits_otherwise(tiny_dataset, tmp_path):
    """A case added to the dataset (or another --seed) recomputed the split: cases trained on moved into
    validation, and best.pt went on being chosen against a Dice measured on other cases."""
    from data.prepare import RunData, keep_split

    spec = load_dataset_json(tiny_dataset)
    cases = list(spec.training)
    run = RunData(tiny_dataset, spec, cases[2:], cases[:2], tmp_path)
    same = {"train": [c.name for c in cases[2:]], "val": [c.name for c in cases[:2]]}
    assert keep_split(run, same) == (run, None) and keep_split(run, None) == (run, None)
    saved = {"train": [c.name for c in cases[:1] + cases[2:4]], "val": [cases[1].name, cases[4].name]}
    kept, note = keep_split(run, saved)
    assert [c.name for c in kept.val] == [cases[1].name, cases[4].name]
    assert sorted(c.name for c in kept.train) == sorted(c.name for c in cases if c not in (cases[1], cases[4]))
    assert f"keeping its 2 validation case(s), {cases[1].name}, {cases[4].name}" in note
    assert f"new case(s) {cases[5].name} train" in note, "the case the checkpoint never saw"
