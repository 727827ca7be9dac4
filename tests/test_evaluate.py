"""evaluate.py: loading any wrapper's weights, choosing the device, and the four outputs."""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

import evaluate
from tests.helpers import run
from unet3d import UNet3D
from unet3d.checkpoint import load_model
from unet3d.inference.devices import choose_device, mask_physical_gpu

FEATURES = (4, 8, 16)


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return UNet3D(1, 3, FEATURES).state_dict()


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "module._orig_mod."])
@pytest.mark.parametrize("wrap", [False, True])
def test_bare_state_dicts_of_every_wrapper_load_identically(weights, prefix, wrap, tmp_path):
    saved = {prefix + k: v for k, v in weights.items()}
    torch.save({"state_dict": saved} if wrap else saved, tmp_path / "w.pt")
    model, checkpoint = load_model(tmp_path / "w.pt", torch.device("cpu"))
    assert checkpoint == {} and model.features == FEATURES and not model.training, "no tensor is kept"
    loaded = model.state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_a_loaded_model_keeps_the_checkpoints_facts_not_a_second_copy_of_its_tensors(weights, tmp_path):
    """Ensemble members keep what load_model returns for as long as they predict: the weights (already in the
    model), the optimizer's moments and the scaler state would sit beside every member on its device."""
    moments = {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    facts = {"config": {"lr": 0.1}, "class_names": ["background", "organ", "lesion"], "epoch": 3}
    torch.save({"model": weights, "optimizer": moments, "scaler": {"scale": 2.0}, **facts}, tmp_path / "c.pt")
    model, checkpoint = load_model(tmp_path / "c.pt", torch.device("cpu"))
    assert checkpoint == facts
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_mismatched_weights_name_the_keys(weights, tmp_path):
    torch.save(weights, tmp_path / "w.pt")
    with pytest.raises(ValueError, match="does not fit the model") as err:
        load_model(tmp_path / "w.pt", torch.device("cpu"), {"features": [4, 8, 16, 32]})
    message = str(err.value)
    assert "missing keys: decoder.2.conv.0.weight" in message and "encoder.3.0.weight and 5 more" in message
    assert (
        "unexpected keys: none" in message
        and "decoder.0.conv.0.weight (8, 16, 3, 3, 3) vs (16, 32, 3, 3, 3)" in message
    )
    del weights["head.bias"]
    weights["extra.weight"] = torch.zeros(1)
    torch.save(weights, tmp_path / "w2.pt")
    with pytest.raises(ValueError, match=r"missing keys: head.bias; unexpected keys: extra.weight"):
        load_model(tmp_path / "w2.pt", torch.device("cpu"))


def test_prediction_keeps_shape_affine_and_labels(tmp_path):
    affine = np.array([[0, -0.7, 0, 10], [0.9, 0, 0, -5], [0, 0, 2.5, 3], [0, 0, 0, 1]])
    image = nib.Nifti1Image(np.random.default_rng(0).normal(size=(6, 5, 4, 2)).astype(np.float32), affine)
    image.header.set_slope_inter(2.0, 7.0)  # the image's scaling must not apply to the labels
    pred = np.random.default_rng(1).integers(0, 3, (6, 5, 4)).astype(np.uint8)
    evaluate.save_prediction(pred, image, tmp_path / "p.nii.gz")
    back = nib.load(tmp_path / "p.nii.gz")
    assert back.shape == (6, 5, 4) and back.get_data_dtype() == np.uint8
    np.testing.assert_allclose(back.affine, affine)
    np.testing.assert_array_equal(np.asarray(back.dataobj), pred)


def test_gpu_mask_is_set_before_cuda_and_refused_after(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    mask_physical_gpu(5)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised"):
        mask_physical_gpu(6)


def test_a_gpu_mask_that_came_after_cuda_started_is_refused_not_silently_ignored(monkeypatch):
    """CUDA started outside torch's lazy init (torch.cuda.is_initialized() still False) has read the mask of
    its start: the driver counts every GPU, and cuda:0 would be the first of them, not the one asked for."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 4, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("a GPU was bound"))
    with pytest.raises(RuntimeError, match="--gpu 5: CUDA was started before the mask and sees 4 GPUs"):
        choose_device(5, None)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert choose_device(5, None) == torch.device("cuda", 0) and bound == [torch.device("cuda", 0)]


def test_gpu_option_on_a_machine_without_that_gpu_fails_clearly(weights, tmp_path):
    torch.save(weights, tmp_path / "w.pt")
    result = run(["python", "evaluate.py", "--checkpoint", str(tmp_path / "w.pt"), "--gpu", "3"], timeout=60)
    assert result.returncode == 2
    assert "--gpu 3: no such GPU is visible (CUDA_VISIBLE_DEVICES=3, PCI bus order)" in result.stderr
    assert "Traceback" not in result.stderr


def test_outputs_for_a_bare_state_dict_on_the_test_split(weights, tiny_dataset, tmp_path, capsys):
    torch.save({"module." + k: v for k, v in weights.items()}, tmp_path / "w.pt")
    out = tmp_path / "eval"
    argv = [
        "--checkpoint",
        str(tmp_path / "w.pt"),
        "--data-dir",
        str(tiny_dataset),
        "--split",
        "test",
        "--out-dir",
        str(out),
        "--device",
        "cpu",
        "--window",
        "16",
        "--sw-batch-size",
        "3",
    ]
    assert evaluate.main(argv) == 0
    printed = capsys.readouterr().out
    assert "organ" in printed and "lesion" in printed and "mean Dice" in printed
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert {r["case"] for r in rows} == {"synth_006", "synth_007"} and len(rows) == 4
    assert {"dice", "iou", "hd95_mm", "pred_volume_ml", "ref_volume_ml"} <= rows[0].keys()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_cases"] == 2 and summary["split"] == "test" and summary["config"] is None
    assert summary["checkpoint"] == str((tmp_path / "w.pt").resolve())
    assert summary["inference"]["amp"] == "off", "fp32 on the CPU (recorded as the string 'None' before)"
    dice_means = [summary["classes"][c]["dice"]["mean"] for c in ("organ", "lesion")]
    assert summary["mean_dice"] == pytest.approx(np.mean(dice_means))
    for r in rows:
        assert 0 <= float(r["dice"]) <= 1
    for name in ("synth_006", "synth_007"):
        pred = nib.load(out / "predictions" / f"{name}.nii.gz")
        image = nib.load(tiny_dataset / "imagesTs" / f"{name}.nii.gz")
        assert pred.shape == image.shape and np.allclose(pred.affine, image.affine)
    picture = Image.open(out / "overview.png")
    assert picture.mode == "RGB" and picture.width > 3 * 16

    # bf16 and channels-last (as on a GPU, here on the CPU), one case in the overview, probabilities for a split
    other = tmp_path / "eval_bf16"
    more = ["--amp", "bf16", "--memory-format", "channels_last", "--overview-cases", "1", "--save-probabilities"]
    assert evaluate.main([*argv[:-8], "--out-dir", str(other), *argv[-6:], *more]) == 0
    summary = json.loads((other / "summary.json").read_text())
    inference = summary["inference"]
    assert (inference["amp"], inference["memory_format"]) == ("torch.bfloat16", "channels_last"), inference
    assert Image.open(other / "overview.png").height < picture.height, "one row instead of two"
    for name in ("synth_006", "synth_007"):
        with np.load(other / "predictions" / f"{name}.npz") as saved:
            probs = {k: saved[k] for k in saved.files}
        sizes = nib.load(tiny_dataset / "imagesTs" / f"{name}.nii.gz").shape
        assert any(v.dtype == np.float16 and v.shape[-3:] == sizes for v in probs.values()), (name, probs.keys())


def broken_label(array: np.ndarray, affine: np.ndarray, how: str) -> nib.Nifti1Image:
    """A test label that training would refuse: another shape, shifted 5 mm in world space, or an undeclared value."""
    if how == "shape":
        return nib.Nifti1Image(array[:-2], affine)
    if how == "shifted":
        return nib.Nifti1Image(array, affine + np.array([[0, 0, 0, 5.0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))
    return nib.Nifti1Image(np.where(array == 2, 7, array).astype(np.uint8), affine)


@pytest.mark.parametrize(
    "how, message",
    [
        ("shape", "{image} has spatial shape (24, 24, 16) but {label} has (22, 24, 16)"),
        ("shifted", "{label}: its voxels are not where those of {image} are in world space"),
        ("undeclared", "{label}: label value(s) [7] not declared in dataset.json 'labels' (0..2)"),
    ],
)
def test_a_label_training_would_refuse_is_one_failed_case_and_the_rest_is_scored(
    weights, tiny_dataset, tmp_path, capsys, how, message
):
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    label = data / "labelsTs" / "synth_007.nii.gz"
    bad = nib.load(label)
    nib.save(broken_label(np.asarray(bad.dataobj), bad.affine, how), label)
    torch.save(weights, tmp_path / "w.pt")
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(data), "--split", "test", "--out-dir", str(out)]
    assert evaluate.main([*argv, "--device", "cpu", "--window", "16"]) == 1, "the failure shows in the exit code"
    err = capsys.readouterr().err
    image = (data / "imagesTs" / "synth_007.nii.gz").resolve()
    assert "error: synth_007: " + message.format(image=image, label=label) in err, err
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert {r["case"] for r in rows} == {"synth_006"}, "the other case is still predicted and scored"
    assert not (out / "predictions" / "synth_007.nii.gz").exists()


def test_only_the_chosen_splits_files_are_needed_and_a_missing_one_is_one_failed_case(
    weights, tiny_dataset, tmp_path, capsys
):
    """dataset.json lists the test images, but a copy of the dataset often lacks them: the validation split is
    still scored. A test image that is missing fails its own case; the others are predicted and scored."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    missing = data / "imagesTs" / "synth_007.nii.gz"
    missing.unlink()
    torch.save(weights, tmp_path / "w.pt")
    common = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(data), "--device", "cpu", "--window", "16"]
    assert evaluate.main([*common, "--split", "val", "--out-dir", str(tmp_path / "val")]) == 0
    summary = json.loads((tmp_path / "val" / "summary.json").read_text())
    assert summary["split"] == "val" and summary["num_cases"] == summary["num_scored"] == 1

    capsys.readouterr()
    out = tmp_path / "test"
    assert evaluate.main([*common, "--split", "test", "--out-dir", str(out)]) == 1, "the failure shows in the exit code"
    err = capsys.readouterr().err
    assert "error: synth_007: " in err and str(missing) in err, err
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert {r["case"] for r in rows} == {"synth_006"}, "the other case is still predicted and scored"


def test_a_dataset_of_other_classes_than_the_models_is_refused(weights, tiny_dataset, tmp_path, capsys):
    """The lesion merged into the organ: scored under the model's names, the absent lesion would count as a
    perfect class. Another number of classes is refused; other names for as many classes are a warning."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    meta = json.loads((data / "dataset.json").read_text())
    trained = ["background", "organ", "lesion"]
    torch.save({"model": weights, "class_names": trained, "epoch": 1}, tmp_path / "c.pt")
    argv = ["--checkpoint", str(tmp_path / "c.pt"), "--data-dir", str(data), "--split", "test", "--device", "cpu"]
    argv += ["--window", "16", "--out-dir", str(tmp_path / "eval")]
    (data / "dataset.json").write_text(json.dumps({**meta, "labels": {"0": "background", "1": "organ"}}))
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert f"was trained on 3 classes {trained}, but {data / 'dataset.json'} declares 2: ['background', 'organ']" in err
    assert not (tmp_path / "eval" / "metrics.csv").exists()
    renamed = {"0": "background", "1": "liver", "2": "tumour"}
    (data / "dataset.json").write_text(json.dumps({**meta, "labels": renamed}))
    assert evaluate.main(argv) == 0
    assert "['background', 'liver', 'tumour']" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--window", "0"], "--window takes one positive size or three, got 0"),
        (["--window", "32", "32"], "--window takes one positive size or three, got 32 32"),
        (["--overlap", "1.0"], "--overlap must be in [0, 0.9], got 1.0"),
        (["--overlap", "nan"], "--overlap must be in [0, 0.9], got nan"),
        (["--overlap", "0.999"], "--overlap must be in [0, 0.9], got 0.999 (each voxel is predicted in"),  # a hang
        (["--sw-batch-size", "0"], "--sw-batch-size must be >= 1, got 0"),  # was silently the training batch
        (["--gpu", "abc"], "--gpu abc: give physical GPU ids as nvidia-smi numbers them"),
    ],
)
def test_option_values_every_case_would_fail_on_are_refused_before_any_case(
    weights, tiny_dataset, tmp_path, capsys, option, message
):
    torch.save(weights, tmp_path / "w.pt")
    seg = tmp_path / "seg"
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--images", str(tiny_dataset / "imagesTs"), "--out-dir", str(seg)]
    device = [] if option[0] == "--gpu" else ["--device", "cpu"]
    assert evaluate.main([*argv, *device, *option]) == 2
    assert f"evaluate.py: error: {message}" in capsys.readouterr().err
    assert not seg.exists(), "nothing is written, so the corrected command is not refused for these settings"


def test_cases_sharded_over_workers_are_scored_as_by_one_with_undefined_hd95(weights, tiny_dataset, tmp_path):
    """A model that predicts only background leaves every foreground HD95 undefined (NaN): the shards hand their
    rows over as JSON, where NaN is null, and the merged summary and metrics.csv must equal one process's."""
    weights = {**weights, "head.weight": torch.zeros_like(weights["head.weight"])}
    weights["head.bias"] = torch.tensor([10.0, -10.0, -10.0])
    torch.save(weights, tmp_path / "background.pt")
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        command = ["python", "evaluate.py", "--checkpoint", str(tmp_path / "background.pt"), "--split", "test"]
        command += ["--data-dir", str(tiny_dataset), "--out-dir", str(out), "--device", "cpu", "--window", "16"]
        result = run([*command, "--workers", str(workers)], timeout=120)
        assert result.returncode == 0, result.stderr
        rows = sorted(csv.DictReader((out / "metrics.csv").read_text().splitlines()), key=lambda r: r["case"])
        outputs[workers] = rows, json.loads((out / "summary.json").read_text())
    (rows_one, one), (rows_two, two) = outputs[1], outputs[2]
    assert len(rows_one) == 4 and all(r["hd95_mm"] == "nan" and float(r["dice"]) == 0 for r in rows_one)
    assert rows_two == rows_one
    assert two["classes"] == one["classes"] and two["classes"]["lesion"]["hd95_undefined"] == 2
    assert two["mean_dice"] == one["mean_dice"] == 0


def test_gpu_ids_shard_the_cases_one_child_per_physical_gpu(weights, tiny_dataset, tmp_path, monkeypatch):
    """`--gpu 5,7`: one real child process per physical id, in order, each given its own id and share of the
    cases, merged as one process's results. This machine has no GPU: each child's `--gpu N` (what would mask
    it to card N) is swapped for `--device cpu` as it starts, and the id it was given is recorded."""
    torch.save(weights, tmp_path / "w.pt")
    base = ["--checkpoint", str(tmp_path / "w.pt"), "--split", "test", "--data-dir", str(tiny_dataset)]
    base += ["--window", "16"]
    started, real = [], evaluate.subprocess.Popen

    def on_cpu(command, **kwargs):
        command = list(command)
        at = command.index("--gpu")
        started.append((command[at + 1], command[command.index("--shard") + 1]))
        command[at : at + 2] = ["--device", "cpu"]
        return real(command, **kwargs)

    monkeypatch.chdir(evaluate.__file__.rsplit("/", 1)[0])
    monkeypatch.setattr(evaluate.subprocess, "Popen", on_cpu)
    assert evaluate.main([*base, "--out-dir", str(tmp_path / "gpus"), "--gpu", "5,7"]) == 0
    assert started == [("5", "0/2"), ("7", "1/2")]
    monkeypatch.setattr(evaluate.subprocess, "Popen", real)
    assert evaluate.main([*base, "--out-dir", str(tmp_path / "one"), "--device", "cpu"]) == 0

    def scores(name):
        rows = csv.DictReader((tmp_path / name / "metrics.csv").read_text().splitlines())
        return sorted(rows, key=lambda r: (r["case"], r["class"])), json.loads(
            (tmp_path / name / "summary.json").read_text()
        )

    (rows, summary), (rows_one, one) = scores("gpus"), scores("one")
    assert summary["inference"]["shards"] == ["physical GPU 5", "physical GPU 7"]
    assert len(rows) == 4 and rows == rows_one and summary["mean_dice"] == one["mean_dice"]  # 2 cases, 2 classes
    predicted = sorted(p.name for p in (tmp_path / "gpus" / "predictions").iterdir())
    assert predicted == sorted(p.name for p in (tmp_path / "one" / "predictions").iterdir()) and len(predicted) == 2


def test_a_case_that_runs_out_of_memory_is_one_failed_case_and_the_rest_is_scored(
    weights, tiny_dataset, tmp_path, capsys, monkeypatch
):
    """One scan too large for the GPU must not end the evaluation without a summary (the device's memory is
    played by a predict that raises torch's OutOfMemoryError for that case)."""
    from unet3d.inference.predictor import Predictor

    real, calls = Predictor.predict, []

    def predict(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB\nmore detail")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Predictor, "predict", predict)
    torch.save(weights, tmp_path / "w.pt")
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(tiny_dataset), "--split", "test"]
    assert evaluate.main([*argv, "--out-dir", str(out), "--device", "cpu", "--window", "16"]) == 1
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_cases"] == 2 and summary["num_scored"] == 1 and len(summary["errors"]) == 1
    (failed,) = {"synth_006", "synth_007"} - {
        r["case"] for r in csv.DictReader((out / "metrics.csv").read_text().splitlines())
    }
    expected = f"{failed}: out of memory on cpu (CUDA out of memory. Tried to allocate 9.00 GiB); a smaller"
    assert summary["errors"][0].startswith(expected) and f"error: {expected}" in err, err
    assert not (out / "predictions" / f"{failed}.nii.gz").exists() and len(calls) == 2


def test_a_test_split_without_labels_writes_predictions_only_and_train_scores_the_rest_of_the_list(
    weights, tiny_dataset, tmp_path, capsys
):
    """README: `test` scores against labelsTs/ where those files exist, else writes predictions only; `train`
    takes the training list's cases that validation does not hold."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    shutil.rmtree(data / "labelsTs")
    torch.save(weights, tmp_path / "w.pt")
    common = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(data), "--device", "cpu", "--window", "16"]
    out = tmp_path / "test"
    default = [a for a in common if a not in ("--device", "cpu")]  # the default device: a GPU, else the CPU
    assert evaluate.main([*default, "--split", "test", "--out-dir", str(out)]) == 0
    device = json.loads((out / "summary.json").read_text())["inference"]["device"]
    assert device == ("cuda:0" if torch.cuda.is_available() else "cpu"), device
    assert sorted(p.name for p in (out / "predictions").glob("*.nii.gz")) == ["synth_006.nii.gz", "synth_007.nii.gz"]
    for name in ("synth_006", "synth_007"):
        pred, image = nib.load(out / "predictions" / f"{name}.nii.gz"), nib.load(data / "imagesTs" / f"{name}.nii.gz")
        assert pred.shape == image.shape[:3] and np.allclose(pred.affine, image.affine)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_cases"] == 2 and summary["num_scored"] == 0 and not summary["errors"]

    train, val = tmp_path / "train", tmp_path / "val"
    assert evaluate.main([*common, "--split", "train", "--out-dir", str(train)]) == 0
    assert evaluate.main([*common, "--split", "val", "--out-dir", str(val)]) == 0
    scored = [{r["case"] for r in csv.DictReader((d / "metrics.csv").read_text().splitlines())} for d in (train, val)]
    assert len(scored[0]) == 5 and len(scored[1]) == 1 and not scored[0] & scored[1], scored
    (held,) = scored[1]
    (data / "labelsTr" / f"{held}.nii.gz").unlink()  # a training-list label that is missing: one failed case
    assert evaluate.main([*common, "--split", "val", "--out-dir", str(tmp_path / "val2")]) == 1
    assert f"error: {held}: " in capsys.readouterr().err


def test_a_damaged_scan_is_one_failed_case_and_the_rest_is_scored(weights, tiny_dataset, tmp_path, capsys):
    """An interrupted copy: the gzip stream of synth_007 ends halfway, so its header reads and its voxels do
    not. It was an EOFError that ended the run before (no metrics.csv, no summary.json)."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    damaged = data / "imagesTs" / "synth_007.nii.gz"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    torch.save(weights, tmp_path / "w.pt")
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(data), "--split", "test", "--out-dir", str(out)]
    assert evaluate.main([*argv, "--device", "cpu", "--window", "16"]) == 1
    err = capsys.readouterr().err
    assert f"error: synth_007: {damaged}: cannot read its voxels (EOFError" in err, err
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert {r["case"] for r in rows} == {"synth_006"}
    assert json.loads((out / "summary.json").read_text())["num_cases"] == 2


def test_a_folder_that_names_one_case_twice_or_is_its_own_output_is_refused(weights, tiny_dataset, tmp_path, capsys):
    """Two files of one case name (a.nii beside a.nii.gz, b.nii.gz beside b_0000.nii.gz) would both write
    NAME.nii.gz, and one of them was dropped without a word. An --out-dir that is the --images folder took
    every scan for a segmentation already written, or with --overwrite wrote each segmentation over its scan."""
    torch.save(weights, tmp_path / "w.pt")
    scans = tmp_path / "scans"
    scans.mkdir()
    source = tiny_dataset / "imagesTs" / "synth_006.nii.gz"
    for name in ("a.nii.gz", "b.nii.gz", "b_0000.nii.gz", "c.nii.gz"):
        shutil.copy(source, scans / name)
    nib.save(nib.load(source), scans / "a.nii")
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--images", str(scans), "--device", "cpu", "--window", "16"]
    assert evaluate.main([*argv, "--out-dir", str(tmp_path / "seg")]) == 2
    err = capsys.readouterr().err
    assert "files that name the same case (a: a.nii, a.nii.gz; b: b_0000.nii.gz, b.nii.gz)" in err, err
    assert not list((tmp_path / "seg").glob("*.nii.gz"))

    for name in ("a.nii", "b_0000.nii.gz"):
        (scans / name).unlink()
    before = {p.name: p.read_bytes() for p in scans.iterdir()}
    for extra in ([], ["--overwrite"]):
        assert evaluate.main([*argv, "--out-dir", str(scans), *extra]) == 2
        assert "is the --images folder" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in scans.iterdir()} == before, "the scans are untouched"
    assert evaluate.main([*argv, "--out-dir", str(tmp_path / "seg")]) == 0
    assert sorted(p.name for p in (tmp_path / "seg").glob("*.nii.gz")) == ["a.nii.gz", "b.nii.gz", "c.nii.gz"]


def test_a_shard_never_shards_again_and_options_are_never_abbreviated(weights, tiny_dataset, tmp_path, monkeypatch):
    """An abbreviated `--worker 2` reached the shards (whose parent strips --workers by its full name), and
    each shard started two more, without end."""
    torch.save(weights, tmp_path / "w.pt")
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(tiny_dataset), "--split", "test"]
    argv += ["--device", "cpu", "--window", "16", "--out-dir", str(tmp_path / "eval")]
    with pytest.raises(SystemExit) as exit_:
        evaluate.build_parser().parse_args([*argv, "--worker", "2"])
    assert exit_.value.code == 2
    monkeypatch.setattr(evaluate.subprocess, "Popen", lambda *a, **k: pytest.fail("a shard started processes"))
    assert evaluate.main([*argv, "--workers", "2", "--shard", "1/2"]) == 0
    share = json.loads((tmp_path / "eval" / "shards" / "1.json").read_text())
    assert [d["case"] for d in share["done"]] == ["synth_007"], "its own share of the two test cases"


def test_a_window_the_network_cannot_take_is_refused_before_any_case(weights, tiny_dataset, tmp_path, capsys):
    """Three levels pool twice: each window size must be divisible by 4. Every case failed on its own before."""
    torch.save(weights, tmp_path / "w.pt")
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(tiny_dataset), "--split", "test"]
    assert evaluate.main([*argv, "--device", "cpu", "--window", "15", "--out-dir", str(out)]) == 2
    assert "--window 15 15 15: each size must be divisible by 4 x 4 x 4" in capsys.readouterr().err
    assert not (out / "predictions").exists()


def test_the_device_recorded_for_a_folder_is_the_one_the_cases_are_segmented_on(monkeypatch):
    """`--workers N` shards run with --device cpu: on a GPU host the record said cuda, and a plain run there
    (bf16 or fp16 under --amp auto) was taken to match a folder segmented in fp32 on the CPU."""
    from argparse import Namespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert evaluate.device_kind(Namespace(gpu=None, workers=2, device=None)) == "cpu", "the shards run on the CPU"
    assert evaluate.device_kind(Namespace(gpu=None, workers=1, device=None)) == "cuda"
    assert evaluate.device_kind(Namespace(gpu="5,7", workers=1, device=None)) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA touched before a --gpu mask"))
    assert evaluate.device_kind(Namespace(gpu="5", workers=1, device=None)) == "cuda"


def test_a_disk_that_refuses_a_file_stops_the_run_with_the_file_named(weights, tiny_dataset, tmp_path, capsys):
    """The kernel's own refusal (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) of the first probabilities
    file: one error line naming it and exit 1, where a traceback ended the run before; no temporary file left."""
    torch.save(weights, tmp_path / "w.pt")
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tmp_path / "w.pt"), "--data-dir", str(tiny_dataset), "--split", "test"]
    argv += ["--out-dir", str(out), "--device", "cpu", "--window", "16", "--save-probabilities"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024, hard))  # a prediction fits, its probabilities do not
    try:
        code = evaluate.main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert code == 1, err
    npz = next(iter(sorted(out.rglob("*.nii.gz")))).with_name("synth_006.npz")
    assert f"evaluate.py: error: [Errno 27] File too large: '{npz}': stopped;" in err, err
    assert not [p for p in out.rglob(".*tmp*")], "the refused file's temporary copy is removed"
