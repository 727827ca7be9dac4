"""Does the geometry handling pay? The same synthetic anatomy, acquired uniformly and with mixed spacings and
orientations, trained for the same wall-clock budget with `bash launch.sh cpu:2 --time-limit T`, then scored
on the test split, each prediction on its own image's grid (`evaluate.py --split test`):

    python benchmarks/geometry.py --time-limit 240      # three runs of 4 minutes on 2 CPU cores

1. uniform: every case at 1 x 1 x 1.5 mm in RAS order (the default synthetic data);
2. mixed: the same cases as isotropic RAS, thick-slice LPS and sagittal thick-axis-first scans, planned as
   usual (RAS, nnU-Net's target spacing, crop);
3. mixed, geometry off: the same mixed scans used as stored (--orientation none --spacing none --crop none).

Prints the test mean Dice of each and the gaps to the uniform run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "uniform": ["--synthetic-geometry", "uniform"],
    "mixed": ["--synthetic-geometry", "mixed"],
    "mixed, geometry off": ["--synthetic-geometry", "mixed", "--orientation", "none", "--spacing", "none"]
    + ["--crop", "none"],
}


def run(name: str, extra: list[str], args: argparse.Namespace) -> dict:
    out = Path(args.out) / name.replace(", ", "-").replace(" ", "-")
    command = ["bash", "launch.sh", "cpu:2", "--out-dir", str(out), "--time-limit", str(args.time_limit)]
    command += ["--synthetic-dir", str(Path(args.out) / "synthetic"), *extra]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    evaluate = [sys.executable, "evaluate.py", "--checkpoint", str(out / "checkpoints" / "best.pt")]
    subprocess.run([*evaluate, "--split", "test", "--device", "cpu", "--out-dir", str(out / "eval_test")], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    summary = json.loads((out / "eval_test" / "summary.json").read_text())
    return {"mean_dice": summary["mean_dice"], **{k: v["dice"]["mean"] for k, v in summary["classes"].items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time-limit", type=float, default=240, help="seconds of training per run (default 240)")
    p.add_argument("--out", default="runs/geometry-benchmark", help="folder for the runs")
    args = p.parse_args(argv)
    results = {name: run(name, extra, args) for name, extra in RUNS.items()}
    base = results["uniform"]["mean_dice"]
    print(f"test mean Dice after {args.time_limit:.0f} s of training on 2 CPU ranks, scored on each image's own grid")
    for name, r in results.items():
        classes = ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "mean_dice")
        gap = "" if name == "uniform" else f"   gap to uniform {r['mean_dice'] - base:+.3f}"
        print(f"  {name:<22} {r['mean_dice']:.4f}  ({classes}){gap}")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
