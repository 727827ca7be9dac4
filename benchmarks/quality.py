"""Segmentation quality per unit of compute, on real anatomy: the project against MONAI's DDP tutorial recipe,
the same wall-clock budget on the same ranks.

    pip install -e ".[bench]"                       # MONAI and nilearn (whose wheel carries the MNI template)
    python benchmarks/quality.py --budget 240       # two runs of 4 minutes on 2 CPU ranks, then the table

The data: the MNI ICBM152 2009c T1 template and its grey and white matter probability maps (bundled in
nilearn's wheel), at 2 mm, turned into "subjects" by random smooth deformations, intensity scaling, bias
fields and noise, labelled grey matter / white matter where their probability is the largest, and written
in the MSD layout (12 training subjects, 4 test subjects). Each recipe trains for `--budget` seconds on
`--ranks` CPU processes on the same 12 training subjects (the project with `--fold all`: MONAI's recipe
validates nothing either; `--validate` holds out 20 % for validation and scores `best.pt`, as a plain run
does), then the test subjects are scored (Dice per class, on their own grid).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

REPO = Path(__file__).resolve().parents[1]
MNI = "mni_icbm152_{}_tal_nlin_sym_09a_converted.nii.gz"


def template() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(T1, grey matter, white matter probabilities, affine) of the MNI template at 2 mm, cropped to the head."""
    from importlib.resources import files

    data = files("nilearn") / "datasets" / "data"
    images = [nib.load(str(data / MNI.format(name))) for name in ("t1", "gm", "wm")]
    arrays = [ndimage.zoom(np.asarray(i.dataobj, dtype=np.float32), 0.5, order=1) for i in images]
    affine = images[0].affine @ np.diag([2.0, 2.0, 2.0, 1.0])
    head = np.argwhere(arrays[0] > 0.05 * arrays[0].max())
    lo, hi = head.min(0), head.max(0) + 1
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    affine = affine.copy()
    affine[:3, 3] = affine[:3, :3] @ lo + affine[:3, 3]
    return (*[a[box] for a in arrays], affine)


def subject(rng: np.random.Generator, t1, gm, wm) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic subject: a smooth random deformation (up to about 4 mm), intensity scaling, a bias field,
    noise; labels 1 (grey matter) and 2 (white matter) where their deformed probability is the largest."""
    shape = t1.shape
    grid = np.meshgrid(*[np.arange(n, dtype=np.float32) for n in shape], indexing="ij")
    coords = []
    for g in grid:
        coarse = rng.normal(0, 1.0, (5, 5, 5)).astype(np.float32)
        field = ndimage.zoom(coarse, [n / 5 for n in shape], order=3)[: shape[0], : shape[1], : shape[2]]
        coords.append(g + 2.0 * field)  # voxels of 2 mm
    warped = [ndimage.map_coordinates(a, coords, order=1, mode="nearest") for a in (t1, gm, wm)]
    t1w, gmw, wmw = warped
    label = np.zeros(shape, np.uint8)
    tissue = np.stack([1 - gmw - wmw, gmw, wmw])
    label[(tissue.argmax(0) == 1) & (gmw > 0.2)] = 1
    label[(tissue.argmax(0) == 2) & (wmw > 0.2)] = 2
    bias = np.ones(shape, np.float32)
    for g, n in zip(grid, shape):
        bias *= 1 + 0.1 * np.cos(2 * np.pi * g / n * rng.uniform(0.3, 1.0) + rng.uniform(0, 2 * np.pi))
    image = t1w * rng.uniform(0.8, 1.2) * bias
    image += rng.normal(0, 0.03 * float(t1.max()), shape).astype(np.float32)
    return image.astype(np.float32), label


def write_dataset(root: Path, train: int = 12, test: int = 4, seed: int = 0) -> Path:
    if (root / "dataset.json").is_file():
        return root
    t1, gm, wm, affine = template()
    rng = np.random.default_rng(seed)
    for sub in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    training, testing = [], []
    for i in range(train + test):
        image, label = subject(rng, t1, gm, wm)
        folder = ("imagesTr", "labelsTr") if i < train else ("imagesTs", "labelsTs")
        name = f"mni_{i:03d}.nii.gz"
        nib.save(nib.Nifti1Image(image, affine), root / folder[0] / name)
        nib.save(nib.Nifti1Image(label, affine), root / folder[1] / name)
        if i < train:
            training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
        else:
            testing.append(f"./imagesTs/{name}")
    meta = {
        "name": "MNI subjects",
        "modality": {"0": "T1"},
        "labels": {"0": "background", "1": "grey_matter", "2": "white_matter"},
        "training": training,
        "test": testing,
    }
    (root / "dataset.json").write_text(json.dumps(meta, indent=2))
    return root


def ours(data: Path, out: Path, budget: float, ranks: int, extra: list[str], validate: bool) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: an earlier one's last.pt would be resumed
    command = ["bash", "launch.sh", f"cpu:{ranks}", "--data-dir", str(data), "--out-dir", str(out)]
    command += ["--time-limit", str(budget), "--cache-dir", str(out.parent / "cache"), *extra]
    if not validate:  # every training subject trains, as in MONAI's recipe, and nothing is held out
        command += ["--fold", "all"]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = out / "checkpoints" / ("best.pt" if (out / "checkpoints" / "best.pt").exists() else "last.pt")
    evaluate = [sys.executable, "evaluate.py", "--checkpoint", str(checkpoint), "--split", "test", "--device", "cpu"]
    subprocess.run([*evaluate, "--out-dir", str(out / "eval_test")], cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    summary = json.loads((out / "eval_test" / "summary.json").read_text())
    log = (out / "logs" / "rank0.log").read_text()
    per_epoch = int(log.split(" step(s) per epoch")[0].split()[-1])
    epochs = [line for line in log.splitlines() if " INFO epoch " in line]
    stopped = [int(line.split("stopped at step ")[1].split(":")[0]) for line in epochs if "stopped at step" in line]
    steps = per_epoch * (len(epochs) - len(stopped)) + sum(stopped)
    per_class = {k: v["dice"]["mean"] for k, v in summary["classes"].items()}
    return {"per_class": per_class, "mean_dice": summary["mean_dice"], "steps": steps}


def monai(data: Path, out: Path, budget: float, ranks: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = ["torchrun", "--standalone", "--nproc-per-node", str(ranks), str(REPO / "benchmarks" / "monai_recipe.py")]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // ranks)),
        "CUDA_VISIBLE_DEVICES": "",
    }
    subprocess.run([*command, "--data-dir", str(data), "--time-limit", str(budget), "--out", str(out)], cwd=REPO,
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return json.loads((out / "results.json").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=240, help="seconds of training per recipe (default 240)")
    p.add_argument("--ranks", type=int, default=2, help="CPU processes per recipe (default 2)")
    p.add_argument("--out", default="runs/quality", help="folder for the data and the runs")
    p.add_argument("--only", choices=("ours", "monai"), help="run one recipe (the other's last result is reused)")
    p.add_argument(
        "--validate",
        action="store_true",
        help="hold out 20 %% of the training subjects for validation and score best.pt, as a plain run does "
        "(the project then trains on fewer subjects than MONAI's recipe, which validates nothing)",
    )
    p.add_argument("extra", nargs="*", help="options for train_ddp.py after --, e.g. -- --features 16 32 64 128")
    args = p.parse_args(argv)
    out = Path(args.out)
    data = write_dataset(out / "data")
    results_file = out / f"results-{args.budget:.0f}.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    began = time.time()
    if args.only != "monai":
        run = out / f"ours-{'validated-' if args.validate else ''}{args.budget:.0f}"
        results["ours, validated" if args.validate else "ours"] = ours(
            data, run, args.budget, args.ranks, args.extra, args.validate
        )
    if args.only != "ours":
        results["monai"] = monai(data, out / f"monai-{args.budget:.0f}", args.budget, args.ranks)
    results_file.write_text(json.dumps(results, indent=2))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    print(f"{cpu}, {args.ranks} CPU ranks, budget {args.budget:.0f} s per recipe ({time.time() - began:.0f} s in all)")
    names = list(next(iter(results.values()))["per_class"])
    print(f"{'recipe':<18}{'steps':>8}" + "".join(f"{n:>16}" for n in names) + f"{'mean Dice':>12}")
    for recipe, r in results.items():
        cells = "".join(f"{r['per_class'][n]:>16.4f}" for n in names)
        print(f"{recipe:<18}{r['steps']:>8}{cells}{r['mean_dice']:>12.4f}")
    if {"ours", "monai"} <= results.keys():
        print(f"margin (ours - MONAI): {results['ours']['mean_dice'] - results['monai']['mean_dice']:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
