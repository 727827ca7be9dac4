"""Preprocessing one large CT-like case: ours (reorient, crop, normalise, resample image and labels) against
MONAI's `Orientationd` + `Spacingd` on the same file, each in a fresh process, timed, with its peak memory.

    python benchmarks/preprocessing.py                      # 512 x 512 x 300, about a minute on 2 cores
    python benchmarks/preprocessing.py --shape 256 256 150  # the size `benchmarks/run.py --quick` uses

Prints both measurements and their ratios; `--reference none` measures ours alone (no MONAI needed).
`benchmarks/run.py` takes the same rows into its table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np

SHAPE = (512, 512, 300)
SPACING = (0.7, 0.7, 2.5)  # thick axial slices, as many abdominal CTs
TARGET = (1.0, 1.0, 1.5)
CLASSES = 5


def write_ct(folder: Path, shape=SHAPE) -> tuple[Path, Path]:
    """An LPS CT-like volume (int16 HU: air, soft tissue, bone, organs) and its labels, written once."""
    image_path, label_path = folder / "ct.nii.gz", folder / "ct_label.nii.gz"
    if image_path.is_file() and label_path.is_file():
        return image_path, label_path
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    grid = np.ogrid[tuple(slice(0, n) for n in shape)]
    centre = [n / 2 for n in shape]
    r = sum(((g - c) / (0.45 * n)) ** 2 for g, c, n in zip(grid, centre, shape))
    image = np.where(r <= 1, 40, -1000).astype(np.int16)
    label = np.zeros(shape, np.uint8)
    for k in range(1, CLASSES):
        c = [rng.uniform(0.3, 0.7) * n for n in shape]
        rk = sum(((g - ci) / (rng.uniform(0.06, 0.12) * n)) ** 2 for g, ci, n in zip(grid, c, shape)) <= 1
        label[rk] = k
        image[rk] = 40 + 30 * k
    image += rng.normal(0, 20, shape).astype(np.int16)
    affine = np.diag([-SPACING[0], -SPACING[1], SPACING[2], 1.0])  # LPS
    nib.save(nib.Nifti1Image(image, affine), image_path)
    nib.save(nib.Nifti1Image(label, affine), label_path)
    return image_path, label_path


def _peak_mib() -> float:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmHWM"].split()[0]) / 1024


def _ours(image_path: str, label_path: str, results) -> None:
    import torch

    from data.nifti import load_image, load_label
    from data.plan import Plan
    from data.preprocess import preprocess

    torch.set_num_threads(1)  # as in the cache builders' worker processes, one per core
    plan = Plan(
        orientation="RAS", spacing=TARGET, spacing_rule="given", crop="nonzero",
        normalization=({"modality": "CT", "scheme": "ct", "clip": [-200.0, 300.0], "mean": 60.0, "std": 80.0},),
        median_shape=SHAPE, median_spacing=TARGET, patch_size=(128, 128, 128), features=(1, 1),
        kernels=((3, 3, 3),) * 2, strides=((1, 1, 1), (2, 2, 2)),
    )  # fmt: skip
    baseline = _peak_mib()  # the interpreter and PyTorch
    began = time.perf_counter()
    image, nii = load_image(image_path)
    label, _ = load_label(label_path)
    loaded = time.perf_counter()
    planned = preprocess(image, nii.affine, plan, label, CLASSES)
    done = time.perf_counter()
    results.put((done - loaded, done - began, _peak_mib() - baseline, tuple(planned.image.shape[1:])))


def _monai(image_path: str, label_path: str, results) -> None:
    import torch
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Orientationd, Spacingd

    torch.set_num_threads(1)
    keys = ("image", "label")
    baseline = _peak_mib()  # the interpreter, PyTorch and MONAI
    began = time.perf_counter()
    loaded = LoadImaged(keys)({"image": image_path, "label": label_path})
    loaded = EnsureChannelFirstd(keys)(loaded)
    after_load = time.perf_counter()
    out = Compose([Orientationd(keys, axcodes="RAS"), Spacingd(keys, pixdim=TARGET, mode=("bilinear", "nearest"))])(
        loaded
    )
    done = time.perf_counter()
    results.put((done - after_load, done - began, _peak_mib() - baseline, tuple(out["image"].shape[1:])))


def measure(which: str, image_path: Path, label_path: Path) -> tuple[float, float, float, tuple]:
    """(seconds preprocessing, seconds with loading, peak MiB above the process's own after its imports,
    output shape) in a fresh process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_ours if which == "ours" else _monai, args=(str(image_path), str(label_path), results))
    proc.start()
    value = results.get(timeout=1800)
    proc.join()
    return value


def case_mib(shape=SHAPE) -> float:
    """The case in memory as preprocessing holds it: a float32 image and a uint8 label."""
    return float(np.prod(shape)) * 5 / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", nargs=3, type=int, default=list(SHAPE), metavar=("X", "Y", "Z"))
    p.add_argument("--folder", help="where the CT is written once (default runs/cache/benchmark/XxYxZ)")
    p.add_argument("--reference", choices=("monai", "none"), default="monai", help="what ours is compared with")
    p.add_argument("--json", help="also write the measurements to this file")
    args = p.parse_args(argv)
    shape = tuple(args.shape)
    if min(shape) < 8:
        p.error(f"--shape must be at least 8 voxels per axis, got {shape}")
    if args.reference == "monai" and importlib.util.find_spec("monai") is None:
        print(
            'error: the MONAI reference needs MONAI: pip install -e ".[bench]" (or --reference none)', file=sys.stderr
        )
        return 2
    folder = Path(args.folder or Path("runs/cache/benchmark") / "x".join(map(str, shape)))
    image, label = write_ct(folder, shape)
    size = case_mib(shape)
    print(f"CT {'x'.join(map(str, shape))}, {CLASSES} classes, LPS {SPACING} mm to RAS {TARGET} mm, one thread")
    print(f"the case in memory (float32 image + uint8 label): {size:.0f} MiB")
    names = ["ours"] + (["monai"] if args.reference == "monai" else [])
    results = {}
    for which in names:
        seconds, with_loading, peak, out_shape = measure(which, image, label)
        results[which] = {"seconds": seconds, "seconds_with_loading": with_loading, "peak_mib": peak,
                          "peak_over_case": peak / size, "output_shape": list(out_shape)}  # fmt: skip
        print(
            f"  {which:5s}  {seconds:7.2f} s preprocessing ({with_loading:.2f} s with loading), peak memory added "
            f"{peak:7.0f} MiB ({peak / size:.1f}x the case), output {'x'.join(map(str, out_shape))}"
        )
    if "monai" in results:
        ours, monai = results["ours"], results["monai"]
        print(
            f"  ratio  MONAI / ours: time {monai['seconds'] / ours['seconds']:.2f}x, "
            f"peak memory {monai['peak_mib'] / ours['peak_mib']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": list(shape), "case_mib": size, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, for the workers too
    sys.exit(main())
