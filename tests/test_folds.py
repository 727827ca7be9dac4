"""Cross-validation end to end: two folds trained with launch.sh, scored together (the cross-validation
score and the post-processing decision), then ensembled on the test split against each fold alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluate
from data.msd import Case, fold_cases
from tests.helpers import run

SYNTHETIC = ["--synthetic-cases", "8", "--synthetic-size", "32", "--num-workers", "0"]
DATA = [*SYNTHETIC, "--epochs", "1", "--samples-per-epoch", "16"]


@pytest.fixture(scope="module")
def folds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("folds")
    for fold in ("0", "1"):
        out = root / f"fold{fold}"
        args = ["--synthetic-dir", str(root / "syn"), "--cache-dir", str(root / "cache"), "--out-dir", str(out)]
        result = run(["bash", "launch.sh", "cpu:2", *args, *DATA, "--fold", fold, "--folds", "2"], timeout=240)
        assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return root


def test_folds_are_disjoint_and_cover_every_case():
    cases = [Case(f"c{i:02d}", Path(f"c{i}"), Path(f"l{i}")) for i in range(11)]
    held = [fold_cases(cases, 3, str(k), seed=0)[1] for k in range(3)]
    names = [c.name for part in held for c in part]
    assert sorted(names) == [c.name for c in cases] and sorted(len(p) for p in held) == [3, 4, 4]
    assert fold_cases(list(reversed(cases)), 3, "1", 0) == fold_cases(cases, 3, "1", 0), "by name only"
    assert fold_cases(cases, 3, "all", 0) == (sorted(cases, key=lambda c: c.name), [])


def test_each_fold_records_its_split(folds):
    splits = [torch.load(folds / f"fold{f}/checkpoints/best.pt", weights_only=True)["split"] for f in (0, 1)]
    assert set(splits[0]["val"]).isdisjoint(splits[1]["val"])
    assert sorted(splits[0]["val"] + splits[1]["val"]) == sorted(splits[0]["train"] + splits[0]["val"])


def test_cross_validation_score_and_post_processing(folds):
    checkpoints = [str(folds / f"fold{f}" / "checkpoints" / "best.pt") for f in (0, 1)]
    out = folds / "cv"
    run_ok(["--checkpoint", *checkpoints, "--split", "cv", "--out-dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_scored"] == 8 and set(summary["folds"]) == set(checkpoints)
    rules = json.loads((out / "postprocessing.json").read_text())
    assert set(rules["cross_validation_dice"]) == {"organ", "lesion"} and rules["num_cases"] == 8
    assert summary["postprocessing"] == rules
    # step 3 of the README reads the file step 2 wrote, as written
    applied = folds / "cv_applied"
    run_ok(["--checkpoint", *checkpoints, "--split", "test", "--postprocess", str(out / "postprocessing.json")]
           + ["--out-dir", str(applied)])  # fmt: skip
    used = json.loads((applied / "summary.json").read_text())["inference"]["postprocess"]
    assert used["largest_component"] == rules["largest_component"], (used, rules)
    # re-scored into the same folder with its own rules: the predictions read back are post-processed, so a
    # decision from them compared the rules with themselves and wrote an empty one over the file given
    written = (out / "postprocessing.json").read_text()
    run_ok(["--checkpoint", *checkpoints, "--split", "cv", "--postprocess", str(out / "postprocessing.json")]
           + ["--out-dir", str(out)])  # fmt: skip
    assert (out / "postprocessing.json").read_text() == written
    again = json.loads((out / "summary.json").read_text())
    assert (
        "postprocessing" not in again
        and again["inference"]["postprocess"]["largest_component"] == rules["largest_component"]
    )


def test_the_ensemble_of_the_folds_on_the_test_split(folds, capsys):
    checkpoints = [str(folds / f"fold{f}" / "checkpoints" / "best.pt") for f in (0, 1)]
    dice = {}
    for name, chosen in [("fold 0", checkpoints[:1]), ("fold 1", checkpoints[1:]), ("ensemble", checkpoints)]:
        out = folds / name.replace(" ", "")
        run_ok(["--checkpoint", *chosen, "--split", "test", "--out-dir", str(out)])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["num_scored"] == 4 and summary["inference"]["ensemble"] == len(chosen)
        dice[name] = summary["mean_dice"]
    with capsys.disabled():
        print("\ntest mean Dice: " + ", ".join(f"{k} {v:.4f}" for k, v in dice.items()))
    assert all(0 <= v <= 1 for v in dice.values())


def test_fold_all_trains_on_every_case_without_validation(folds, capsys):
    out = folds / "all"
    args = ["--synthetic-dir", str(folds / "syn"), "--cache-dir", str(folds / "cache"), "--out-dir", str(out)]
    command = ["bash", "launch.sh", "cpu:2", *args, *SYNTHETIC, "--epochs", "1", "--samples-per-epoch", "8"]
    result = run([*command, "--fold", "all"], timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert len(state["split"]["train"]) == 8 and state["split"]["val"] == []
    assert not (out / "checkpoints" / "best.pt").exists() and "val Dice" not in result.stdout
    last = str(out / "checkpoints" / "last.pt")
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", last, "--split", "val", "--device", "cpu"]) == 2
    assert f"{last} holds out no val case (trained with --fold all?)" in capsys.readouterr().err


def run_ok(args: list[str]) -> None:
    """evaluate.py in this process (its command line as a subprocess is walked by test_launch_modes)."""
    assert evaluate.main(["--device", "cpu", *args]) == 0


def test_segmenting_a_folder_with_the_folds_tta_and_post_processing_as_the_readme_says(folds):
    """The README's step 3 as a command line: the folds' ensemble with mirroring TTA and a post-processing file
    on a folder of scans, sharded over two processes (`--device cpu --workers 2` standing for `--gpu 0,1`).
    Every output is the unsharded, unprocessed ensemble's label map with only each named class's largest
    component kept, on its input's grid."""
    import nibabel as nib

    from unet3d.inference.postprocess import largest_component

    checkpoints = [str(folds / f"fold{f}" / "checkpoints" / "best.pt") for f in (0, 1)]
    (images,) = (folds / "syn").glob("*/imagesTs")
    rules = folds / "rules.json"
    rules.write_text(json.dumps({"largest_component": ["organ", "lesion"]}))
    common = [sys.executable, "evaluate.py", "--checkpoint", *checkpoints, "--images", str(images), "--tta"]
    sharded = run(
        [*common, "--postprocess", str(rules), "--out-dir", str(folds / "seg"), "--device", "cpu", "--workers", "2"],
        timeout=240,
    )
    assert sharded.returncode == 0, sharded.stdout + sharded.stderr
    run_ok([*common[2:], "--out-dir", str(folds / "seg_plain")])  # (the same, unsharded, in this process)

    summary = json.loads((folds / "seg" / "summary.json").read_text())
    assert summary["split"] == "images" and summary["num_cases"] == 4 and summary["errors"] == []
    assert summary["inference"]["tta"] is True and summary["inference"]["ensemble"] == 2
    assert summary["inference"]["postprocess"]["largest_component"] == ["organ", "lesion"]
    scans = sorted(images.glob("*.nii.gz"))
    assert len(scans) == 4
    for scan in scans:
        source = nib.load(scan)
        out = nib.load(folds / "seg" / scan.name)
        assert out.shape == source.shape and np.array_equal(out.affine, source.affine)
        raw = np.asarray(nib.load(folds / "seg_plain" / scan.name).dataobj)
        expected = largest_component(largest_component(raw, 1), 2)
        assert np.array_equal(np.asarray(out.dataobj), expected), scan.name
