"""benchmarks/geometry.py's scoring: the larger test split it can write, and the means it reads back from
evaluate.py's metrics.csv (over the default split's cases and per acquisition protocol)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from benchmarks import geometry as bench
from data.synthetic import PROTOCOLS, SINGLE_PROTOCOLS, case_acquisition


def write_metrics(path, dice: dict[tuple[int, str], float]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["case", "class", "class_name", "dice"])
    writer.writeheader()
    for (index, name), value in dice.items():
        writer.writerow({"case": f"synth_{index:03d}", "class": name, "class_name": name, "dice": value})
    path.write_text(buffer.getvalue())


def fake_evaluation(command: list[str], case: str) -> None:
    """What an evaluate.py `command` leaves in its --out-dir, for one case scoring 0.9 (no model is run)."""
    out = Path(command[command.index("--out-dir") + 1])
    out.mkdir(parents=True)
    (out / "metrics.csv").write_text(f"case,class,class_name,dice\n{case},1,organ,0.9\n")
    summary = {"mean_dice": 0.9, "num_scored": 1, "classes": {"organ": {"dice": {"mean": 0.9}}}}
    (out / "summary.json").write_text(json.dumps(summary))


def test_protocol_scores_follow_evaluate_definition(tmp_path):
    """Per class over the chosen cases, then over classes; the default split is the first four test cases."""
    rng = np.random.default_rng(0)
    cases = range(24, 33)  # nine test cases after 24 training cases: three of each mixed protocol
    dice = {(i, name): float(rng.uniform(0.5, 1.0)) for i in cases for name in ("organ", "lesion")}
    write_metrics(tmp_path / "metrics.csv", dice)
    scores = bench.protocol_scores(tmp_path / "metrics.csv", "mixed")

    def by_hand(indices) -> float:
        return np.mean([np.mean([dice[(i, name)] for i in indices]) for name in ("organ", "lesion")])

    assert scores["default_split_mean_dice"] == pytest.approx(by_hand(range(24, 28)))
    protocols = {case_acquisition("mixed", i).name for i in cases}
    assert len(protocols) == 3 and {k for k in scores if k.startswith("protocol ")} == {
        f"protocol {p}" for p in protocols
    }
    for name in protocols:
        mine = [i for i in cases if case_acquisition("mixed", i).name == name]
        assert len(mine) == 3 and scores[f"protocol {name}"] == pytest.approx(by_hand(mine))


def test_datasets_with_more_test_cases_keep_the_training_cases(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "DEFAULT_DATASET", (2, 16))
    small = bench.write_datasets(tmp_path, seed=3, test_cases=4)
    before = {g: np.asarray(nib.load(f / "imagesTr" / "synth_001.nii.gz").dataobj) for g, f in small.items()}
    large = bench.write_datasets(tmp_path, seed=3, test_cases=6)  # a folder of 4 test cases is written anew
    assert large == small
    for geometry, folder in large.items():
        meta = json.loads((folder / "dataset.json").read_text())
        assert meta["numTraining"] == 2 and meta["numTest"] == 6
        assert len(list((folder / "labelsTs").glob("*.nii.gz"))) == 6
        after = np.asarray(nib.load(folder / "imagesTr" / "synth_001.nii.gz").dataobj)
        assert np.array_equal(after, before[geometry]), "the training cases, and so the runs, are the same"


def test_noise_free_reader_scores_every_protocol(monkeypatch):
    """Overall: per class over all test cases, then over classes; each protocol the same over its own cases."""
    monkeypatch.setattr(bench, "DEFAULT_DATASET", (2, 16))
    scores = bench.noise_free_reader(seed=3, test_cases=4)
    assert set(scores) == {"uniform", "mixed"}
    names = {case_acquisition("mixed", i).name for i in range(2, 6)}
    assert {k[9:] for k in scores["mixed"] if k.startswith("protocol ")} == names and len(names) == 3
    for geometry, parts in scores.items():
        assert 0.8 < parts["mean_dice"] <= 1.0, (geometry, parts)
    counts = {name: sum(case_acquisition("mixed", i).name == name for i in range(2, 6)) for name in names}
    weighted = sum(counts[n] * scores["mixed"][f"protocol {n}"] for n in names) / 4
    assert scores["mixed"]["mean_dice"] == pytest.approx(weighted)


def test_single_protocol_datasets_hold_the_same_anatomy(tmp_path, monkeypatch):
    """--every-protocol's scans: every case of `axial` (say) is the mixed dataset's case of the same index when
    mixed acquires it axially, bit for bit, and every case of a single-protocol dataset has that protocol's grid."""
    monkeypatch.setattr(bench, "DEFAULT_DATASET", (2, 16))
    folders = bench.write_datasets(tmp_path, seed=3, test_cases=4, geometries=("mixed", *SINGLE_PROTOCOLS))

    def read(geometry: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        sub = "imagesTr" if index < 2 else "imagesTs"
        image = nib.load(folders[geometry] / sub / f"synth_{index:03d}.nii.gz")
        return np.asarray(image.dataobj), image.affine

    matched = set()
    for protocol, acquisition in zip(SINGLE_PROTOCOLS, PROTOCOLS):
        for index in range(6):
            image, affine = read(protocol, index)
            assert np.allclose(np.linalg.norm(affine[:3, :3], axis=0), acquisition.spacing), (protocol, index)
            if case_acquisition("mixed", index) == acquisition:
                mixed_image, mixed_affine = read("mixed", index)
                assert np.array_equal(image, mixed_image) and np.allclose(affine, mixed_affine)
                matched.add(protocol)
    assert matched == set(SINGLE_PROTOCOLS)


def test_routing_scores_each_mixed_scan_by_its_protocols_specialist(tmp_path):
    """--specialists: the routed mixed split takes, for every test case, the row of the specialist whose protocol
    the mixed data acquires it with, and averages as evaluate.py does (per class over cases, then over classes)."""
    rng = np.random.default_rng(1)
    cases = range(24, 33)  # three of each protocol in the mixed data
    dice = {p: {(i, n): float(rng.uniform(0.5, 1.0)) for i in cases for n in ("organ", "lesion")} for p in PROTOCOLS}
    paths = {}
    for name, acquisition in zip(SINGLE_PROTOCOLS, PROTOCOLS):
        paths[name] = tmp_path / f"{name}.csv"
        write_metrics(paths[name], dice[acquisition])  # a specialist scores every test anatomy of its protocol
    scores = bench.routed(paths)
    own = {(i, n): dice[case_acquisition("mixed", i)][(i, n)] for i in cases for n in ("organ", "lesion")}
    by_hand = np.mean([np.mean([own[(i, n)] for i in cases]) for n in ("organ", "lesion")])
    assert scores["num_cases"] == 9 and scores["mean_dice"] == pytest.approx(by_hand)
    for acquisition in PROTOCOLS:
        mine = [i for i in cases if case_acquisition("mixed", i) == acquisition]
        expected = np.mean([np.mean([dice[acquisition][(i, n)] for i in mine]) for n in ("organ", "lesion")])
        assert scores[f"protocol {acquisition.name}"] == pytest.approx(expected)


def test_label_round_trip_costs_the_mixed_scans_and_soft_targets_win_it_back(monkeypatch):
    """The uniform data is planned at its own spacing: its labels come back unchanged. The mixed data's
    thick-slice and fine in-plane scans lose boundaries as hard planned labels; the soft targets recover them."""
    monkeypatch.setattr(bench, "DEFAULT_DATASET", (3, 24))
    scores = bench.label_round_trip(seed=1, test_cases=4)
    assert scores["uniform"]["hard"]["mean_dice"] == pytest.approx(1.0)
    assert scores["uniform"]["soft"]["mean_dice"] == pytest.approx(1.0)
    hard, soft = scores["mixed"]["hard"], scores["mixed"]["soft"]
    assert hard["mean_dice"] < 0.99, hard
    assert soft["mean_dice"] > hard["mean_dice"] + 0.005, (hard, soft)
    names = {case_acquisition("mixed", i).name for i in range(3, 7)}
    assert {k[9:] for k in soft if k.startswith("protocol ")} == names


def test_train_args_reach_every_training_run(tmp_path, monkeypatch):
    """--train-args is split as a shell would and appended to each launch.sh command."""
    commands = []
    monkeypatch.setattr(bench, "logged", lambda command, log: commands.append(command))
    monkeypatch.setattr(bench, "evaluate", lambda *a, **k: {"mean_dice": 0.5})
    args = bench.argparse.Namespace(out=str(tmp_path), time_limit=5, checkpoint="last", tta=False)
    args.train_args, args.eval_args = "--label-targets hard --fg-fraction 0.5", ""
    bench.run("mixed", ["--synthetic-geometry", "mixed"], 0, tmp_path, args)
    (command,) = commands
    assert command[:3] == ["bash", "launch.sh", "cpu:2"]
    assert command[-4:] == ["--label-targets", "hard", "--fg-fraction", "0.5"]
    assert command[command.index("--synthetic-geometry") + 1] == "mixed"


def test_eval_args_reach_every_evaluation(tmp_path, monkeypatch):
    """--eval-args is split as a shell would and given to each evaluate.py command, with and without TTA."""
    commands = []

    def logged(command, log):
        commands.append(command)
        fake_evaluation(command, "synth_004")

    monkeypatch.setattr(bench, "logged", logged)
    result = bench.evaluate(tmp_path / "last.pt", tmp_path, "uniform", tmp_path / "e", tmp_path / "e.log", True,
                            ["--overlap", "0.75"])  # fmt: skip
    assert len(commands) == 2 and result["mean_dice"] == result["tta_mean_dice"] == 0.9
    for command, mirrored in zip(commands, (False, True)):
        assert command[command.index("--overlap") + 1] == "0.75" and ("--tta" in command) == mirrored


@pytest.mark.parametrize("flag", ["--train-args", "--eval-args"])
def test_unbalanced_quote_in_passed_options_stops_before_any_run(flag, tmp_path, monkeypatch, capsys):
    """A quote left open is named at once (argparse's exit status 2), before a dataset is written or a run trains."""
    monkeypatch.setattr(bench, "write_datasets", lambda *a, **k: pytest.fail("wrote a dataset"))
    monkeypatch.setattr(bench, "logged", lambda *a, **k: pytest.fail("ran a command"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--out", str(tmp_path), flag, "--overlap '0.75"])
    assert stopped.value.code == 2
    assert f'{flag} "--overlap \'0.75": No closing quotation' in capsys.readouterr().err


def test_train_cases_reach_every_run_and_the_datasets(tmp_path, monkeypatch):
    """--train-cases N writes N training cases, test cases after them, and trains every run on those N."""
    commands = []

    def logged(command, log):
        commands.append(command)
        if command[1] == "evaluate.py":
            fake_evaluation(command, "synth_003")

    monkeypatch.setattr(bench, "logged", logged)
    monkeypatch.setattr(bench, "DEFAULT_DATASET", (24, 16))  # restored after the test: main sets it
    assert bench.main(["--out", str(tmp_path), "--train-cases", "3", "--runs", "mixed", "--time-limit", "1"]) == 0
    trains = [c for c in commands if c[:2] == ["bash", "launch.sh"]]
    assert len(trains) == 2 and all(c[c.index("--synthetic-cases") + 1] == "3" for c in trains)
    folders = sorted((tmp_path / "synthetic").iterdir())
    assert [f.name.split("_")[0] for f in folders] == ["cases3", "cases3"]
    for folder in folders:
        meta = json.loads((folder / "dataset.json").read_text())
        assert meta["numTraining"] == 3 and meta["numTest"] == 4
        assert sorted(p.name for p in (folder / "imagesTs").iterdir())[0].startswith("synth_003")


@pytest.mark.parametrize("passed", ["--synthetic-cases 48", "--synthetic-size=32", "--data-dir x"])
def test_train_args_that_change_the_training_cases_are_refused(passed, tmp_path, monkeypatch, capsys):
    """Options that would train on cases other than those the test split comes after stop before any run."""
    monkeypatch.setattr(bench, "write_datasets", lambda *a, **k: pytest.fail("wrote a dataset"))
    monkeypatch.setattr(bench, "logged", lambda *a, **k: pytest.fail("ran a command"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--out", str(tmp_path), f"--train-args={passed}"])
    assert stopped.value.code == 2 and passed.split()[0].split("=")[0] in capsys.readouterr().err


def epoch_lines(epochs: int, paces: list[float], cut: int | None = None) -> str:
    """The console's epoch lines of a run of two ranks (`unet3d.training.report`), the last one cut at step `cut`."""
    lines = []
    for n, pace in zip(range(1, epochs + 1), paces):
        head = f"epoch {n}" + (f" stopped at step {cut}" if cut and n == epochs else "")
        lines.append(f"{head}: loss 0.5, lr 1e-3, 12.0 s, 10.0 samples/s, data wait 1 %, sync wait 2 % "
                     f"(compute per step {pace - 0.01:.3f}..{pace:.3f} s over ranks), val Dice 0.9")  # fmt: skip
    return "train 3/1000000: 100%|####| 16/16\n" + "\n".join(lines) + "\nstopped by the time limit (600 s)\n"


def test_each_run_reports_what_its_budget_bought_and_uneven_runs_are_flagged(tmp_path, monkeypatch, capsys):
    """The epochs each run trained and its compute per step come from its console output; a seed whose runs got
    unequal training from the same budget (the machine slowed during one) is flagged."""
    log = tmp_path / "one.log"
    log.write_text(epoch_lines(4, [0.36, 0.40, 0.52, 0.50], cut=7))
    assert bench.training_record(log) == {
        "epochs": 3,
        "last_epoch_steps": 7,
        "compute_s_per_step": {"first": 0.36, "median": 0.45, "last": 0.5},
    }
    log.write_text("epoch 1/2: loss 0.5, data wait 1 %, sync wait 0 %\nepoch 2/2: loss 0.4, data wait 1 %\n")
    assert bench.training_record(log) == {"epochs": 2, "last_epoch_steps": None, "compute_s_per_step": None}
    assert bench.training_record(tmp_path / "missing.log") is None

    def logged(command, log):
        if command[1] == "evaluate.py":
            fake_evaluation(command, "synth_003")
        else:
            slowed = command[command.index("--synthetic-geometry") + 1] == "mixed"
            log.write_text(epoch_lines(30 if slowed else 40, [0.5 if slowed else 0.36] * 40, cut=5))

    monkeypatch.setattr(bench, "logged", logged)
    monkeypatch.setattr(bench, "DEFAULT_DATASET", (24, 16))  # restored after the test: main sets it
    assert (
        bench.main(["--out", str(tmp_path / "out"), "--train-cases", "3", "--runs", "mixed", "--time-limit", "1"]) == 0
    )
    printed = capsys.readouterr().out
    assert "trained 39 epoch(s) and 5 step(s); compute per step 0.360 s (first epoch)" in printed
    assert "warning: the runs trained unequal epochs in the same budget (uniform 39, mixed 29)" in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["0"]["mixed"]["training"]["epochs"] == 29
