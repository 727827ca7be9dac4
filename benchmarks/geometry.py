"""Does the geometry handling pay? The same synthetic anatomy, acquired uniformly and with mixed spacings and
orientations, trained for the same wall-clock budget with `bash launch.sh cpu:2 --time-limit T`, then scored
on the test split, each prediction on its own image's grid (`evaluate.py --split test`):

    python benchmarks/geometry.py --time-limit 240 --seeds 0 1   # six runs of 4 minutes on 2 CPU cores
    python benchmarks/geometry.py --time-limit 240 --seeds 0 1 --tta   # and every model scored with TTA too

1. uniform: every case at 1 x 1 x 1.5 mm in RAS order (the default synthetic data);
2. mixed: the same cases as isotropic RAS, thick-slice LPS and sagittal thick-axis-first scans, planned as
   usual (RAS, nnU-Net's target spacing, crop);
3. mixed, geometry off: the same mixed scans used as stored (--orientation none --spacing none --crop none).

Every run is scored with its final weights, `last.pt` (`--checkpoint best` scores `best.pt` instead): the
learning rate anneals to zero over the budget, and the best of some thirty validations of 5 cases is often
the luckiest epoch rather than the best model (on the mixed data one run's `best.pt` came from epoch 12 of
30 and scored 0.909 on 24 test cases, its `last.pt` 0.952). Each seed is another draw of the anatomy (and of
the validation split). Prints the test mean Dice of each run,
the gaps to the uniform run of the same seed, and two cross-evaluations that tell a weaker model from harder
scans: the mixed-trained model on the uniform test scans, and the uniform-trained model on the mixed ones.
Each run starts from an empty folder (a rerun replaces the last one's runs); its output is kept in
OUT/NAME-seedS.train.log and .eval.log. Under each run: the epochs its budget bought and its compute per step
(`training_record`), and a warning when one seed's runs trained unequal epochs (`uneven_training`).

The default dataset's test split has 4 cases (two isotropic, one thick-slice axial, one sagittal scan in the
mixed data), so one case's lesion decides a tenth of the mean. `--test-cases N` writes the datasets with N
test cases instead (the training cases, and so the runs, are the same: test cases come after them), and
every line then gives the mean over all N, over the default split's 4 (the first 4), and per protocol.
`--train-cases N` draws N training anatomies instead of the default 24 (`--synthetic-cases N` for every run;
the test anatomies come after them, so none is one a model trained on): does the gap close with more data?
`--noise-free-reader` trains nothing and prints what each acquisition can show at best (`noise_free_reader`).
`--label-round-trip` trains nothing and prints what the planned space costs each test label, taken there and
back as a prediction is, with hard targets and with `--label-targets soft`'s (`label_round_trip`).
`--train-args "..."` passes more options to every training run (`--train-args="--label-targets hard"` trains
on the planned labels alone, the control of the soft targets).

`--every-protocol` tells what the geometry handling recovers from what the acquisitions lose: the test anatomies
are also written acquired by each protocol of the mixed data alone (`--synthetic-geometry isotropic`, `axial`,
`sagittal`), and the mixed-trained and uniform-trained models are scored on each. The mixed-trained model on
the isotropic scans of every test anatomy against the uniform model on the uniform scans is the handling's
part of the gap; its thick-slice scores against its isotropic one are what the thick slices cost that model.

`--specialists` tells what the acquisitions allow at the budget: one model per protocol of the mixed data,
trained (same command, same budget) on that protocol's acquisitions of the same training anatomies and planned
for them by nnU-Net's rule, scores that protocol's test scans. Routing every mixed test scan to the specialist
of its protocol gives the mixed test split's mean Dice when the handling has nothing to reconcile: the gap
that is left is what the thick slices lose, not what mixing them costs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from data.geometry import to_native  # noqa: E402
from data.plan import Plan, target_spacing  # noqa: E402
from data.preprocess import preprocess  # noqa: E402
from data.synthetic import (  # noqa: E402
    LABELS,
    PROTOCOLS,
    SINGLE_PROTOCOLS,
    case_acquisition,
    class_fractions,
    draw_phantom,
    extent,
    folder_name,
    generate_case,
    grid,
    write_synthetic_dataset,
)
from unet3d.inference.metrics import confusion_counts, dice_from_counts  # noqa: E402
from unet3d.loss import target_probabilities  # noqa: E402
from unet3d.training.config import TrainConfig  # noqa: E402

DEFAULT = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
DEFAULT_DATASET = (DEFAULT["synthetic_cases"], DEFAULT["synthetic_size"])  # (training cases, size); --train-cases
RUNS = {
    "uniform": ["--synthetic-geometry", "uniform"],
    "mixed": ["--synthetic-geometry", "mixed"],
    "mixed, geometry off": ["--synthetic-geometry", "mixed", "--orientation", "none", "--spacing", "none"]
    + ["--crop", "none"],
}
SHORT = {"mixed": "mixed", "off": "mixed, geometry off"}  # --runs
DEFAULT_TEST = 4  # the default dataset's test cases (write_synthetic_dataset's num_test)


def write_datasets(
    out: Path, seed: int, test_cases: int, geometries: tuple[str, ...] = ("uniform", "mixed")
) -> dict[str, Path]:
    """The seed's anatomy acquired with each of `geometries` under OUT/synthetic, where the runs find them, with
    `test_cases` test cases (a folder written with another number is written anew)."""
    cases, size = DEFAULT_DATASET
    folders = {}
    for geometry in geometries:
        folder = out / "synthetic" / folder_name(cases, size, seed, geometry)
        meta = folder / "dataset.json"
        if meta.is_file() and json.loads(meta.read_text())["numTest"] != test_cases:
            shutil.rmtree(folder)
        folders[geometry] = write_synthetic_dataset(folder, cases, size, seed, test_cases, geometry)
    return folders


def read_rows(metrics: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(metrics.read_text().splitlines()))


def case_index(row: dict[str, str]) -> int:
    return int(row["case"].split("_")[-1])


def mean_dice(rows: list[dict[str, str]], keep=lambda i: True) -> float | None:
    """evaluate.py's mean Dice of the kept cases' rows: per class over cases, then over classes."""
    by_class: dict[str, list[float]] = {}
    for r in rows:
        if keep(case_index(r)):
            by_class.setdefault(r["class_name"], []).append(float(r["dice"]))
    return statistics.mean(statistics.mean(v) for v in by_class.values()) if by_class else None


def protocol_scores(metrics: Path | list[dict[str, str]], geometry: str) -> dict[str, float]:
    """From evaluate.py's metrics.csv (or its rows): the mean Dice (evaluate.py's definition: per class over
    cases, then over classes) of the default split's first DEFAULT_TEST test cases, and of each acquisition
    protocol's cases."""
    rows = read_rows(metrics) if isinstance(metrics, Path) else metrics
    first = min(case_index(r) for r in rows)
    scores = {"default_split_mean_dice": mean_dice(rows, lambda i: i < first + DEFAULT_TEST)}
    protocols = sorted({case_acquisition(geometry, case_index(r)).name for r in rows})
    for name in protocols:
        scores[f"protocol {name}"] = mean_dice(rows, lambda i, n=name: case_acquisition(geometry, i).name == n)
    return scores


def routed(metrics: dict[str, Path]) -> dict[str, float]:
    """The mixed test split scored by routing each scan to the specialist of its protocol: from each specialist's
    metrics.csv (protocol -> path, on its own protocol's test scans, which hold the mixed dataset's scans of that
    protocol bit for bit), the rows of the cases the mixed data acquires with that protocol; their mean Dice
    overall (evaluate.py's definition), over the default split and per protocol, as `protocol_scores` gives."""
    rows = []
    for protocol, path in metrics.items():
        acquisition = PROTOCOLS[SINGLE_PROTOCOLS.index(protocol)]
        rows += [r for r in read_rows(path) if case_acquisition("mixed", case_index(r)) == acquisition]
    return {"mean_dice": mean_dice(rows), "num_cases": len({r["case"] for r in rows}), **protocol_scores(rows, "mixed")}


EPOCH_LINE = re.compile(r"^epoch (\d+)(?:/\d+)?(?: stopped at step (\d+))?: (.*)$", re.M)
PACE = re.compile(r"compute per step ([\d.]+)\.\.([\d.]+) s")  # over the ranks, in a run of several
UNEVEN = 1.1  # runs of one seed whose trained epochs differ by more than this ratio are flagged


def training_record(log: Path) -> dict | None:
    """What a run's budget bought, from its console output (the epoch lines): "epochs" completed,
    "last_epoch_steps" of the one the budget cut (None when none was cut), and the slowest rank's compute per
    step in the first, the median and the last epoch ("compute_s_per_step", None for a run of one rank), so
    that a run the machine slowed is seen for what it is. None when the log has no epoch line."""
    found = EPOCH_LINE.findall(log.read_text()) if log.is_file() else []
    if not found:
        return None
    paces = [float(pace.group(2)) for _, _, rest in found if (pace := PACE.search(rest))]
    last, stopped, _ = found[-1]
    return {
        "epochs": int(last) - (1 if stopped else 0),
        "last_epoch_steps": int(stopped) if stopped else None,
        "compute_s_per_step": {"first": paces[0], "median": statistics.median(paces), "last": paces[-1]}
        if paces
        else None,
    }


def uneven_training(runs: dict[str, dict]) -> str | None:
    """A warning when the trained runs of one seed got unequal training from the same budget (the machine ran at
    another speed during one), else None."""
    epochs = {name: r["training"]["epochs"] for name, r in runs.items() if r.get("training")}
    if len(epochs) < 2 or max(epochs.values()) <= UNEVEN * max(min(epochs.values()), 1):
        return None
    listed = ", ".join(f"{name} {n}" for name, n in epochs.items())
    return f"  warning: the runs trained unequal epochs in the same budget ({listed}): the machine's speed changed"


def logged(command: list[str], log: Path) -> None:
    """Run `command` in the repository with its output in `log`; on failure, say so with the log's end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        sys.exit(f"{' '.join(command)} failed (exit {code}); the end of {log}:\n{tail}")


def noise_free_reader(seed: int, test_cases: int) -> dict[str, dict[str, float]]:
    """What each acquisition can show at best: the test mean Dice (evaluate.py's definition) of a reader who
    knows, without noise, the share of each voxel that each class fills (`data.synthetic.class_fractions`) and
    takes the largest, scored against the labels as written; per geometry, overall and per protocol."""
    cases, size = DEFAULT_DATASET
    fov = extent(size)
    scores = {}
    for geometry in ("uniform", "mixed"):
        dice: dict[str, list[np.ndarray]] = {}  # protocol -> per case, Dice of each foreground class
        for index in range(cases, cases + test_cases):
            acquisition = case_acquisition(geometry, index)
            phantom = draw_phantom(np.random.default_rng([seed, index]), fov)
            read = class_fractions(phantom, acquisition, fov).argmax(0)
            label = generate_case(seed, index, size, geometry)[1]
            counts = confusion_counts(torch.from_numpy(read), torch.from_numpy(label), len(LABELS))
            dice.setdefault(acquisition.name, []).append(dice_from_counts(counts)[1:].numpy())
        every = np.concatenate([np.stack(v) for v in dice.values()])
        scores[geometry] = {"mean_dice": float(every.mean(0).mean())}
        scores[geometry].update({f"protocol {k}": float(np.stack(v).mean(0).mean()) for k, v in dice.items()})
    return scores


def label_round_trip(seed: int, test_cases: int) -> dict[str, dict[str, dict[str, float]]]:
    """What the planned space itself costs before any learning: each test case's label brought into the plan's
    space (nnU-Net's spacing rule over the training cases' canonical spacings and uncropped shapes),
    taken back to its own grid as a prediction is (`data.geometry.to_native`) and scored against itself. As
    "hard" the planned label alone (one-hot); as "soft" with the runner-up shares (`--label-targets soft`'s
    targets). Per geometry and target kind: the mean Dice overall and per protocol."""
    cases, size = DEFAULT_DATASET
    scores = {}
    for geometry in ("uniform", "mixed"):
        shapes, spacings = [], []
        for index in range(cases):  # the training cases' canonical spacings and shapes, as the plan sees them
            acquisition = case_acquisition(geometry, index)
            shape, _ = grid(acquisition, extent(size))
            spacings.append([acquisition.spacing[list(acquisition.axes).index(w)] for w in range(3)])
            shapes.append([shape[list(acquisition.axes).index(w)] for w in range(3)])
        spacing, rule = target_spacing(spacings, shapes)
        plan = Plan(
            orientation="RAS", spacing=spacing, spacing_rule=rule, crop="nonzero",
            normalization=({"modality": "MRI", "scheme": "zscore"},), median_shape=(size,) * 3,
            median_spacing=spacing, patch_size=(32, 32, 32), features=(8,), kernels=((3, 3, 3),),
            strides=((1, 1, 1),),
        )  # fmt: skip
        dice: dict[str, dict[str, list[np.ndarray]]] = {"hard": {}, "soft": {}}
        for index in range(cases, cases + test_cases):
            image, label, affine = generate_case(seed, index, size, geometry)
            planned = preprocess(image[None], affine, plan, label, len(LABELS))
            soft = np.concatenate([planned.label[None], planned.label_share])[None]
            for kind, target in (("hard", planned.label[None]), ("soft", soft)):
                probs = target_probabilities(torch.from_numpy(target), len(LABELS), torch.float32)[0]
                back = to_native(probs, planned.geometry)
                counts = confusion_counts(torch.from_numpy(back), torch.from_numpy(label), len(LABELS))
                dice[kind].setdefault(case_acquisition(geometry, index).name, []).append(
                    dice_from_counts(counts)[1:].numpy()
                )
        scores[geometry] = {"spacing": spacing}
        for kind, per in dice.items():
            every = np.concatenate([np.stack(v) for v in per.values()])
            scores[geometry][kind] = {"mean_dice": float(every.mean(0).mean())}
            scores[geometry][kind].update({f"protocol {k}": float(np.stack(v).mean(0).mean()) for k, v in per.items()})
    return scores


def evaluate(
    checkpoint: Path, data: Path, geometry: str, out: Path, log: Path, tta: bool = False, extra: Sequence[str] = ()
) -> dict:
    """evaluate.py --split test on `data` (acquired with `geometry`), with the options `extra`: mean Dice, per
    class, over the default split's cases and per protocol (`protocol_scores`), in a folder emptied first, so
    nothing of an earlier benchmark is left among its files; with `tta`, also the mean Dice with mirroring TTA
    (`evaluate.py --tta`, in OUT_tta) as "tta_mean_dice", and its other scores under "tta"."""
    result = {}
    for mirrored in (False, True) if tta else (False,):
        folder = out.with_name(out.name + "_tta") if mirrored else out
        shutil.rmtree(folder, ignore_errors=True)
        command = [sys.executable, "evaluate.py", "--checkpoint", str(checkpoint), "--split", "test", "--device", "cpu"]
        command += ["--out-dir", str(folder), "--data-dir", str(data), *extra] + (["--tta"] if mirrored else [])
        logged(command, log.with_name(log.stem + "_tta" + log.suffix) if mirrored else log)
        summary = json.loads((folder / "summary.json").read_text())
        parts = protocol_scores(folder / "metrics.csv", geometry)
        if mirrored:
            result["tta_mean_dice"] = summary["mean_dice"]
            result["tta"] = parts
        else:
            classes = {k: v["dice"]["mean"] for k, v in summary["classes"].items()}
            result = {"mean_dice": summary["mean_dice"], "num_cases": summary["num_scored"], **classes, **parts}
    return result


def run(name: str, extra: list[str], seed: int, data: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    out = Path(args.out) / f"{name.replace(', ', '-').replace(' ', '-')}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: launch.sh would resume the last benchmark's checkpoint
    command = ["bash", "launch.sh", "cpu:2", "--out-dir", str(out), "--time-limit", str(args.time_limit)]
    command += ["--synthetic-dir", str(Path(args.out) / "synthetic"), "--seed", str(seed), *extra]
    command += ["--synthetic-cases", str(DEFAULT_DATASET[0])]  # the cases write_datasets wrote, test ones after
    command += shlex.split(args.train_args)
    train_log = out.parent / f"{out.name}.train.log"
    logged(command, train_log)
    checkpoint = out / "checkpoints" / f"{args.checkpoint}.pt"
    geometry = extra[extra.index("--synthetic-geometry") + 1]
    log = out.parent / f"{out.name}.eval.log"
    eval_args = shlex.split(args.eval_args)
    result = evaluate(checkpoint, data, geometry, out / "eval_test", log, args.tta, eval_args)
    result["training"] = training_record(train_log)
    return checkpoint, result


def line(name: str, r: dict, base: dict | None) -> str:
    classes = ", ".join(f"{k} {r[k]:.3f}" for k in ("organ", "lesion") if k in r)
    text = f"  {name:<44} {r['mean_dice']:.4f}" + (f"  ({classes})" if classes else "")
    if base is not None:
        text += f"   gap to uniform {r['mean_dice'] - base['mean_dice']:+.3f}"
    if "tta_mean_dice" in r:
        text += f"   with TTA {r['tta_mean_dice']:.4f}"
        if base is not None:
            text += f" (gap {r['tta_mean_dice'] - base['tta_mean_dice']:+.3f})"
    if r.get("num_cases", DEFAULT_TEST) > DEFAULT_TEST:
        for label, scores in (("", r), ("with TTA ", r.get("tta"))):
            if scores is None:
                continue
            default = scores["default_split_mean_dice"]
            parts = ", ".join(f"{k[9:]} {v:.3f}" for k, v in scores.items() if k.startswith("protocol "))
            text += f"\n  {'':<44} {label}default split's {DEFAULT_TEST} cases {default:.4f}; per protocol: {parts}"
    trained = r.get("training")
    if trained:
        cut = f" and {trained['last_epoch_steps']} step(s)" if trained["last_epoch_steps"] else ""
        pace = trained["compute_s_per_step"]
        text += f"\n  {'':<44} trained {trained['epochs']} epoch(s){cut}"
        if pace:
            text += (
                f"; compute per step {pace['first']:.3f} s (first epoch), {pace['median']:.3f} (median), "
                f"{pace['last']:.3f} (last)"
            )
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time-limit", type=float, default=240, help="seconds of training per run (default 240)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="anatomy draws, one set of runs each")
    p.add_argument("--out", default="runs/geometry-benchmark", help="folder for the runs")
    p.add_argument(
        "--runs",
        nargs="+",
        choices=list(SHORT),
        default=list(SHORT),
        help="which runs besides uniform, the reference of every gap (default: mixed off; the cross-evaluations "
        "come with mixed)",
    )
    p.add_argument(
        "--train-args",
        default="",
        help='more options for every training run, one string (e.g. --train-args="--label-targets hard")',
    )
    p.add_argument(
        "--eval-args",
        default="",
        help='more options for every evaluation, one string (e.g. --eval-args="--overlap 0.75")',
    )
    p.add_argument(
        "--tta", action="store_true", help="also evaluate every model with mirroring TTA (evaluate.py --tta)"
    )
    p.add_argument(
        "--checkpoint",
        choices=("last", "best"),
        default="last",
        help="which checkpoint of every run is scored: last (the final weights, annealed to the end of the budget, "
        "as nnU-Net predicts with its final checkpoint; the default) or best (the best mean validation Dice)",
    )
    p.add_argument(
        "--test-cases",
        type=int,
        default=DEFAULT_TEST,
        help=f"test cases per dataset (default {DEFAULT_TEST}, the default dataset's); the training cases are the same",
    )
    p.add_argument(
        "--train-cases",
        type=int,
        default=DEFAULT["synthetic_cases"],
        help=f"training cases per dataset (default {DEFAULT['synthetic_cases']}); the test cases come after them",
    )
    p.add_argument(
        "--every-protocol",
        action="store_true",
        help="also score the mixed-trained and uniform-trained models on the test anatomies acquired by each "
        "protocol of the mixed data alone (needs the mixed runs)",
    )
    p.add_argument(
        "--specialists",
        action="store_true",
        help="also train one model per protocol of the mixed data on that protocol's acquisitions alone, score each "
        "on its own test scans, and the mixed test split with every scan routed to its protocol's model",
    )
    p.add_argument(
        "--noise-free-reader",
        action="store_true",
        help="train nothing: print what each acquisition can show at best (`noise_free_reader`) on the test cases",
    )
    p.add_argument(
        "--label-round-trip",
        action="store_true",
        help="train nothing: print what the planned space costs the test labels, hard and soft (`label_round_trip`)",
    )
    args = p.parse_args(argv)
    for flag, text in (("--train-args", args.train_args), ("--eval-args", args.eval_args)):
        try:  # split as every run will, so that a bad quote stops here and not after the first run's training
            shlex.split(text)
        except ValueError as err:
            p.error(f"{flag} {text!r}: {err}")
    if args.test_cases < DEFAULT_TEST:
        p.error(f"--test-cases {args.test_cases}: at least the default split's {DEFAULT_TEST}")
    if args.train_cases < 2:
        p.error(f"--train-cases {args.train_cases}: at least 2 (one to train on, one to validate)")
    passed = set(shlex.split(args.train_args))
    for flag in ("--synthetic-cases", "--synthetic-size", "--synthetic-dir", "--data-dir"):
        if flag in passed or any(o.startswith(flag + "=") for o in passed):
            p.error(f"--train-args {args.train_args!r}: {flag} would train on other cases than the test split follows"
                    + ("; use --train-cases" if flag == "--synthetic-cases" else ""))  # fmt: skip
    global DEFAULT_DATASET
    DEFAULT_DATASET = (args.train_cases, DEFAULT_DATASET[1])
    if args.noise_free_reader:
        print(f"test mean Dice of a noise-free reader of each voxel's class fractions, {args.test_cases} test cases")
        for seed in args.seeds:
            for geometry, scores in noise_free_reader(seed, args.test_cases).items():
                parts = ", ".join(f"{k[9:]} {v:.4f}" for k, v in scores.items() if k.startswith("protocol "))
                print(f"  seed {seed}, {geometry:<8} {scores['mean_dice']:.4f}  (per protocol: {parts})")
        return 0
    if args.label_round_trip:
        print(f"test labels to the planned space and back, scored against themselves, {args.test_cases} test cases")
        for seed in args.seeds:
            for geometry, scores in label_round_trip(seed, args.test_cases).items():
                spacing = " x ".join(f"{v:g}" for v in scores["spacing"])
                for kind in ("hard", "soft"):
                    r = scores[kind]
                    parts = ", ".join(f"{k[9:]} {v:.4f}" for k, v in r.items() if k.startswith("protocol "))
                    print(f"  seed {seed}, {geometry:<8} at {spacing} mm, {kind}: {r['mean_dice']:.4f}  ({parts})")
        return 0
    chosen = {n: e for n, e in RUNS.items() if n == "uniform" or any(SHORT[r] == n for r in args.runs)}
    if args.every_protocol and "mixed" not in chosen:
        p.error("--every-protocol scores the mixed-trained model: keep mixed in --runs")
    out, results = Path(args.out), {}
    print(
        f"test mean Dice of {args.checkpoint}.pt after {args.time_limit:.0f} s of training on 2 CPU ranks, scored on "
        "each image's own grid"
    )
    for seed in args.seeds:
        checkpoints, runs = {}, {}
        data = write_datasets(out, seed, args.test_cases)
        for name, extra in chosen.items():
            geometry = extra[extra.index("--synthetic-geometry") + 1]
            checkpoints[name], runs[name] = run(name, extra, seed, data[geometry], args)
        cross = {}  # name -> (checkpoint, geometry of the scans, their dataset, the folder's tag)
        if "mixed" in checkpoints:
            cross = {
                "mixed-trained model, uniform test scans": (checkpoints["mixed"], "uniform", data["uniform"], "mixed"),
                "uniform-trained model, mixed test scans": (checkpoints["uniform"], "mixed", data["mixed"], "uniform"),
            }
        if args.every_protocol:
            scans = write_datasets(out, seed, args.test_cases, SINGLE_PROTOCOLS)
            for model in ("mixed", "uniform"):
                for protocol in SINGLE_PROTOCOLS:
                    name = f"{model}-trained model, {protocol} test scans"
                    cross[name] = (checkpoints[model], protocol, scans[protocol], f"{model}-{protocol}")
        for name, (checkpoint, geometry, scans, tag) in cross.items():
            folder = f"cross-{tag}-model-seed{seed}" if tag in ("mixed", "uniform") else f"cross-{tag}-seed{seed}"
            log = out / f"{folder}.log"
            runs[name] = evaluate(checkpoint, scans, geometry, out / folder, log, args.tta, shlex.split(args.eval_args))
        if args.specialists:
            scans = write_datasets(out, seed, args.test_cases, SINGLE_PROTOCOLS)
            evaluated = {}
            for protocol in SINGLE_PROTOCOLS:
                name = f"{protocol} only, its own test scans"
                checkpoint, runs[name] = run(name, ["--synthetic-geometry", protocol], seed, scans[protocol], args)
                evaluated[protocol] = checkpoint.parents[1]  # the run's folder, holding its evaluations
            name = "specialists, each mixed scan to its protocol's"
            runs[name] = routed({p: folder / "eval_test" / "metrics.csv" for p, folder in evaluated.items()})
            if args.tta:
                with_tta = routed({p: folder / "eval_test_tta" / "metrics.csv" for p, folder in evaluated.items()})
                runs[name]["tta_mean_dice"], runs[name]["tta"] = with_tta.pop("mean_dice"), with_tta
        base = runs["uniform"]
        print(f"seed {seed}")
        for name, r in runs.items():
            print(line(name, r, None if name == "uniform" else base))
        warning = uneven_training(runs)
        if warning:
            print(warning)
        results[seed] = runs
    if len(args.seeds) > 1:
        for key, title in (("mean_dice", ""), ("tta_mean_dice", ", with mirroring TTA")):
            if key not in results[args.seeds[0]]["uniform"]:
                continue
            print(f"mean over seeds {args.seeds} (range){title}")
            for name in results[args.seeds[0]]:
                values = [results[s][name][key] for s in args.seeds]
                gaps = [results[s][name][key] - results[s]["uniform"][key] for s in args.seeds]
                spread = f"({min(gaps):+.3f}..{max(gaps):+.3f})"
                gap = "" if name == "uniform" else f"   gap {statistics.mean(gaps):+.3f} {spread}"
                print(f"  {name:<44} {statistics.mean(values):.4f} ({min(values):.4f}..{max(values):.4f}){gap}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
