"""From a trained model to segmentations of new scans: folders of any NIfTI files, cross-validation folds,
ensembles, post-processing chosen on the folds, probabilities, and cases sharded over processes."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

import evaluate
from data.plan import Plan
from tests.helpers import run
from unet3d import UNet3D
from unet3d.inference import postprocess
from unet3d.inference.cases import folder_cases

CLASSES = ["background", "organ", "lesion"]


def two_channel_checkpoint(path: Path) -> Path:
    """A format-2 checkpoint of an untrained 2-channel U-Net (geometry and files are what is tested here)."""
    torch.manual_seed(0)
    model = UNet3D(2, 3, (4, 8))
    plan = Plan(
        orientation="RAS", spacing=(1.0, 1.0, 1.0), spacing_rule="given", crop="nonzero",
        normalization=({"modality": "T1", "scheme": "zscore"}, {"modality": "T2", "scheme": "zscore"}),
        median_shape=(20, 20, 12), median_spacing=(1.0, 1.0, 1.0), patch_size=(16, 16, 8), features=(4, 8),
        kernels=((3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (2, 2, 2)),
    )  # fmt: skip
    checkpoint = {
        "format": 2,
        "model": model.state_dict(),
        "model_args": plan.model_args(2, 3),
        "config": {"patch_size": [16, 16, 8], "batch_size": 2},
        "class_names": CLASSES,
        "plan": plan.to_dict(),
    }
    torch.save(checkpoint, path)
    return path


def scan(rng, shape=(20, 18, 12), channels=2) -> np.ndarray:
    return rng.normal(100, 20, (*shape, channels)).astype(np.float32)


@pytest.fixture
def folder(tmp_path) -> Path:
    """A 4D file, a pair of nnU-Net channel files, a corrupt file and an LPS file with permuted axes."""
    rng = np.random.default_rng(0)
    images = tmp_path / "scans"
    images.mkdir()
    nib.save(nib.Nifti1Image(scan(rng), np.diag([1.0, 1.0, 1.5, 1.0])), images / "case_a.nii.gz")
    pair = scan(rng)
    for c in range(2):
        nib.save(nib.Nifti1Image(pair[..., c], np.diag([0.9, 0.9, 2.0, 1.0])), images / f"case_b_000{c}.nii.gz")
    (images / "case_c.nii.gz").write_bytes(b"not a NIfTI file at all")
    lps = np.array([[0, -0.8, 0, 10], [0, 0, -0.8, 20], [3.0, 0, 0, -5], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(scan(rng, (6, 22, 24)), lps), images / "case_d.nii.gz")
    return images


def test_a_folder_of_new_scans(folder, tmp_path, capsys):
    checkpoint = two_channel_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "seg"
    argv = ["--checkpoint", str(checkpoint), "--images", str(folder), "--out-dir", str(out), "--device", "cpu"]
    assert evaluate.main(argv) == 1, "one case failed"
    printed = capsys.readouterr()
    assert "error: case_c:" in printed.err and "case_c.nii.gz: cannot read as NIfTI" in printed.err
    written = sorted(p.name for p in out.glob("*.nii.gz"))
    assert written == ["case_a.nii.gz", "case_b.nii.gz", "case_d.nii.gz"]
    for name, source in [("case_a", "case_a"), ("case_b", "case_b_0000"), ("case_d", "case_d")]:
        pred, image = nib.load(out / f"{name}.nii.gz"), nib.load(folder / f"{source}.nii.gz")
        assert pred.shape == image.shape[:3] and np.allclose(pred.affine, image.affine), name
        assert pred.get_data_dtype() == np.uint8 and set(np.unique(np.asarray(pred.dataobj))) <= {0, 1, 2}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_cases"] == 4 and summary["errors"][0].startswith("case_c:")
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.nii.gz")}
    assert evaluate.main(argv) == 1
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.nii.gz")} == stamps, "a second run writes nothing"
    assert "0 case(s) written, 3 already there, 1 failed" in capsys.readouterr().out

    # Other settings would skip the cases written and record themselves as what made them: refused, so
    # nothing is rewritten; --overwrite segments every case again under the new settings.
    assert evaluate.main([*argv, "--tta"]) == 2
    assert f"{out} holds segmentations made with other settings (tta (then False, now True))" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.nii.gz")} == stamps
    assert evaluate.main([*argv, "--tta", "--overwrite"]) == 1
    assert "3 case(s) written, 0 already there, 1 failed" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["inference"]["tta"] is True
    assert evaluate.main([*argv, "--tta"]) == 1, "the folder is now the TTA run's"
    # the device too (--amp auto is fp32 on the CPU, bf16 or fp16 on a GPU); a record from before the device
    # was recorded is taken to match
    settings = json.loads((out / ".segmentation.json").read_text())
    assert settings["device"] == "cpu"
    (out / ".segmentation.json").write_text(json.dumps({**settings, "device": "cuda"}))
    assert evaluate.main([*argv, "--tta"]) == 2
    assert "other settings (device (then 'cuda', now 'cpu'))" in capsys.readouterr().err
    del settings["device"]
    (out / ".segmentation.json").write_text(json.dumps(settings))
    assert evaluate.main([*argv, "--tta"]) == 1


def test_scans_training_would_refuse_are_named_and_skipped(tmp_path, capsys):
    """A NaN voxel (SPM and some registration tools write them outside the field of view) would make the whole
    normalised volume NaN and the prediction background everywhere; a zero voxel size or a sheared affine has no
    world grid to resample. Each is one failed case, named with its file; the rest is segmented."""
    scans = tmp_path / "scans"
    scans.mkdir()
    rng = np.random.default_rng(0)
    nib.save(nib.Nifti1Image(scan(rng), np.eye(4)), scans / "good.nii.gz")
    holey = scan(rng)
    holey[0, 0, 0, 1] = np.nan
    nib.save(nib.Nifti1Image(holey, np.eye(4)), scans / "holey.nii.gz")
    flat = nib.Nifti1Image(scan(rng), None)
    flat.set_sform(np.diag([1.0, 1.0, 0.0, 1.0]), code=1)  # a zero voxel size: only an sform can hold one
    flat.set_qform(None, code=0)
    nib.save(flat, scans / "flat.nii.gz")
    sheared = np.eye(4)
    sheared[0, 1] = 0.5
    nib.save(nib.Nifti1Image(scan(rng), sheared), scans / "sheared.nii.gz")
    checkpoint = two_channel_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "seg"
    argv = ["--checkpoint", str(checkpoint), "--images", str(scans), "--out-dir", str(out), "--device", "cpu"]
    assert evaluate.main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: holey: {scans / 'holey.nii.gz'}: 1 NaN or infinite value(s)" in err, err
    assert f"error: flat: {scans / 'flat.nii.gz'}: voxel size" in err and "has a zero axis" in err, err
    assert f"error: sheared: {scans / 'sheared.nii.gz'}: the affine is sheared" in err, err
    assert sorted(p.name for p in out.glob("*.nii.gz")) == ["good.nii.gz"]


def test_channel_files_four_digit_names_and_hidden_files(tmp_path):
    for name in ("amos_0001", "amos_0004", "single_0000", "pair_0000", "pair_0001", "plain"):
        nib.save(nib.Nifti1Image(np.zeros((2, 2, 2), np.float32), np.eye(4)), tmp_path / f"{name}.nii.gz")
    (tmp_path / "._amos_0001.nii.gz").write_bytes(b"\x00\x05\x16\x07Mac OS X")  # AppleDouble, as in MSD's archives
    cases = {c.name: [p.name for p in c.images] for c in folder_cases(tmp_path, in_channels=1)}
    assert cases == {
        "amos_0001": ["amos_0001.nii.gz"],  # names ending in four digits, not channel 1 and 4 of "amos"
        "amos_0004": ["amos_0004.nii.gz"],
        "pair_0000": ["pair_0000.nii.gz"],
        "pair_0001": ["pair_0001.nii.gz"],
        "plain": ["plain.nii.gz"],
        "single": ["single_0000.nii.gz"],  # nnU-Net's one-channel case
    }
    two = {c.name: [p.name for p in c.images] for c in folder_cases(tmp_path, in_channels=2)}
    assert two["pair"] == ["pair_0000.nii.gz", "pair_0001.nii.gz"] and "amos_0001" in two


def test_probabilities_beside_the_labels(folder, tmp_path):
    checkpoint = two_channel_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "seg"
    argv = ["--checkpoint", str(checkpoint), "--images", str(folder), "--out-dir", str(out), "--device", "cpu"]
    evaluate.main([*argv, "--save-probabilities"])
    saved = np.load(out / "case_d.npz")
    probs, labels = saved["probabilities"], np.asarray(nib.load(out / "case_d.nii.gz").dataobj)
    assert probs.dtype == np.float16 and probs.shape == (3, *labels.shape)
    assert list(saved["class_names"]) == CLASSES
    np.testing.assert_allclose(probs.astype(np.float32).sum(0), 1.0, atol=1e-2)
    assert (probs.argmax(0) == labels).mean() > 0.99


def test_two_cpu_workers_write_the_files_one_worker_writes(folder, tmp_path):
    checkpoint = two_channel_checkpoint(tmp_path / "model.pt")
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        command = ["python", "evaluate.py", "--checkpoint", str(checkpoint), "--images", str(folder)]
        result = run([*command, "--out-dir", str(out), "--device", "cpu", "--workers", str(workers)], timeout=120)
        assert result.returncode == 1 and "case_c" in result.stderr, result.stderr
    one, two = tmp_path / "w1", tmp_path / "w2"
    assert sorted(p.name for p in two.glob("*.nii.gz")) == sorted(p.name for p in one.glob("*.nii.gz"))
    for path in one.glob("*.nii.gz"):
        a, b = nib.load(path), nib.load(two / path.name)
        assert np.array_equal(np.asarray(a.dataobj), np.asarray(b.dataobj)) and np.array_equal(a.affine, b.affine)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["inference"]["shards"] == ["cpu x 2"] and len(summary["errors"]) == 1
    assert not (two / "shards").exists(), "the shards' results are merged into summary.json"


def test_the_largest_component_rule_is_chosen_only_where_it_helps():
    ref = np.zeros((20, 20, 20), np.uint8)
    ref[2:8, 2:8, 2:8] = 1
    ref[12:18, 12:18, 12:18] = 2  # class 2 in one piece, class 1 too
    noisy = ref.copy()
    noisy[15, 3, 3] = 1  # a stray class 1 voxel far away: removing it helps
    stray = ref.copy()
    stray[14:16, 5:7, 15:17] = 2  # a stray class 2 blob beside the real one
    rules = postprocess.decide([(noisy, ref), (stray, ref)], CLASSES)
    assert rules["largest_component"] == ["organ", "lesion"]
    assert rules["cross_validation_dice"]["organ"]["with"] > rules["cross_validation_dice"]["organ"]["without"]
    two_lesions = ref.copy()
    two_lesions[2:5, 14:17, 2:5] = 2
    ref_two = two_lesions.copy()  # the reference really has two lesions: keeping one would hurt
    assert postprocess.decide([(two_lesions, ref_two)], CLASSES)["largest_component"] == []
    applied = postprocess.apply(noisy, {"largest_component": ["organ"]}, CLASSES)
    assert np.array_equal(applied, ref)


def test_the_way_back_to_each_scans_grid_asks_where_it_fits(folder, tmp_path, monkeypatch):
    """Every prediction asks `resampling_device` for its own cropped grid's voxel count (on a GPU the answer
    may be the host); the labels are the same wherever the resampling runs."""
    from unet3d.inference import sliding_window

    asked = []

    def spy(device, voxels):
        asked.append(voxels)
        return torch.device("cpu")

    monkeypatch.setattr(sliding_window, "resampling_device", spy)
    checkpoint = two_channel_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "seg"
    argv = ["--checkpoint", str(checkpoint), "--images", str(folder), "--out-dir", str(out), "--device", "cpu"]
    assert evaluate.main(argv) == 1, "the corrupt file fails, as without the spy"
    assert sorted(asked) == sorted([20 * 18 * 12, 20 * 18 * 12, 6 * 22 * 24]), "the noise is nowhere zero: no crop"


def test_scans_near_45_degrees_are_named_when_predicted(tmp_path, capsys):
    """A scan 40 degrees off the scanner's axes is predicted (on its own grid) with a warning naming it and its
    angle, since reorientation may turn it a whole axis from the training scans; one 10 degrees off is not."""
    checkpoint = two_channel_checkpoint(tmp_path / "model.pt")
    rng = np.random.default_rng(1)
    images = tmp_path / "scans"
    images.mkdir()
    for name, degrees in (("tilted", 40.0), ("straight", 10.0)):
        c, s = np.cos(np.radians(degrees)), np.sin(np.radians(degrees))
        affine = np.eye(4)
        affine[:3, :3] = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]]) @ np.diag([1.0, 1.0, 1.5])
        nib.save(nib.Nifti1Image(scan(rng), affine), images / f"{name}.nii.gz")
    out = tmp_path / "seg"
    argv = ["--checkpoint", str(checkpoint), "--images", str(images), "--out-dir", str(out), "--device", "cpu"]
    assert evaluate.main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: tilted lies 40.0 degrees off the scanner's axes" in err, err
    assert "straight" not in err
    for name in ("tilted", "straight"):
        pred, image = nib.load(out / f"{name}.nii.gz"), nib.load(images / f"{name}.nii.gz")
        assert pred.shape == image.shape[:3] and np.allclose(pred.affine, image.affine), name


def test_an_ensemble_of_models_that_cannot_share_one_input_is_refused():
    """Members must predict the same classes, read the same channels and share the preprocessing, or their
    probabilities could not be averaged on one planned image; each refusal names both files."""
    import dataclasses

    from data.plan import legacy_plan
    from unet3d import UNet3D
    from unet3d.inference.predictor import Member, check_members

    features = (4, 8)
    plan = legacy_plan(["MRI"], (16, 16, 16), features)
    names = ["background", "organ", "lesion"]

    def member(name: str, channels: int = 1) -> Member:
        return Member(name, UNet3D(channels, 3, features), {}, None)

    check_members([member("a.pt"), member("b.pt")], [plan, plan], [names, names])  # the same: accepted
    with pytest.raises(ValueError, match=r"b\.pt predicts \['background', 'organ', 'tumour'\], a\.pt \['background'"):
        check_members([member("a.pt"), member("b.pt")], [plan, plan], [names, ["background", "organ", "tumour"]])
    with pytest.raises(ValueError, match=r"b\.pt takes 2 channel\(s\), a\.pt 1"):
        check_members([member("a.pt"), member("b.pt", 2)], [plan, plan], [names, names])
    other = dataclasses.replace(plan, spacing=(1.0, 1.0, 1.5), orientation="RAS")
    with pytest.raises(ValueError, match=r"b\.pt was trained on other preprocessing than a\.pt \(plans \w+ and \w+\)"):
        check_members([member("a.pt"), member("b.pt")], [plan, other], [names, names])


def test_an_unfinished_overwrite_leaves_a_folder_only_another_overwrite_may_continue(tmp_path):
    """--overwrite records its settings before it has segmented anything again: stopped half way, the folder
    holds cases of two settings, which a run without --overwrite would skip and describe as its own."""
    from unet3d.inference.outputs import SETTINGS_FILE, claim_folder, release_folder

    folder, old, new = tmp_path / "seg", {"tta": False}, {"tta": True}
    claim_folder(folder, old, overwrite=False)
    (folder / "case_a.nii.gz").write_bytes(b"a segmentation")
    claim_folder(folder, new, overwrite=True)  # ... and stopped before it rewrote case_a
    for settings in (old, new):
        with pytest.raises(ValueError, match=f"an --overwrite run into {folder} did not finish"):
            claim_folder(folder, settings, overwrite=False)
    claim_folder(folder, new, overwrite=True)
    release_folder(folder)  # this one went through every case
    assert json.loads((folder / SETTINGS_FILE).read_text()) == new
    claim_folder(folder, new, overwrite=False)
    with pytest.raises(ValueError, match=r"other settings \(tta \(then True, now False\)\)"):
        claim_folder(folder, old, overwrite=False)


def test_a_window_larger_than_the_case_is_cut_to_it_but_never_below_the_training_patch():
    """`--window 1000` padded every case to 1000^3 (tens of GB of activations); on each axis the window is now
    cut to the case's planned size rounded up to the model's divisor, and a window of the training patch's
    size stays the patch (as validation predicts), however small the case."""
    from data.plan import legacy_plan
    from unet3d.inference.predictor import Member, Options, Predictor

    model = UNet3D(1, 3, (4, 8, 16))  # divisor 4 on every axis
    plan = legacy_plan(["MRI"], (16, 16, 8), (4, 8, 16))

    def window(given, shape, config=True):
        options = Options(window=given)
        checkpoint = {"config": {"patch_size": [16, 16, 8], "batch_size": 2}} if config else {}
        member = Member("m.pt", model, checkpoint, given or ((16, 16, 8) if config else None))
        return Predictor([member], plan, CLASSES, options, torch.device("cpu")).settings(member, shape).window

    assert window((1000, 1000, 1000), (30, 21, 9)) == (32, 24, 12), "cut to the case, rounded up to 4"
    assert window((1000, 1000, 1000), (10, 50, 3)) == (16, 52, 8), "never below the training patch"
    assert window((16, 16, 8), (5, 5, 5)) == (16, 16, 8), "the patch's own size predicts as validation"
    assert window((24, 8, 1000), (30, 21, 9)) == (24, 8, 12), "a window smaller than the case is kept"
    assert window((1000, 1000, 1000), (10, 50, 3), config=False) == (12, 52, 4), "a bare state dict: the case"
    assert window(None, (200, 200, 200)) == (16, 16, 8), "no --window: the training patch, untouched"


def test_the_overview_draws_the_prediction_as_saved_and_scored_post_processing_included():
    """With --postprocess keeping the largest organ component, a stray blob in the middle plane was drawn in
    overview.png although the saved labels and the Dice had it removed."""
    from types import SimpleNamespace

    probs = torch.zeros(2, 12, 12, 9)
    probs[0] = 1.0
    probs[:, 1:7, 1:7, 1:8] = torch.tensor([0.0, 1.0])[:, None, None, None]  # the organ, across the middle
    probs[:, 9:11, 9:11, 4] = torch.tensor([0.0, 1.0])[:, None, None]  # a stray blob on the middle plane
    plain = evaluate.shown_prediction(probs, SimpleNamespace(rules={}, class_names=["background", "organ"]))
    assert plain.shape == (12, 12) and int(plain[9, 9]) == 1 and int(plain[3, 3]) == 1
    rules = {"largest_component": ["organ"]}
    kept = evaluate.shown_prediction(probs, SimpleNamespace(rules=rules, class_names=["background", "organ"]))
    assert kept.shape == (12, 12) and kept[9, 9] == 0 and kept[3, 3] == 1, "as saved: the blob removed"
