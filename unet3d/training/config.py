"""The training configuration: one validated dataclass, the command line built from its fields.

Fields left at None take a default that depends on where the run happens (GPU or CPU) and on the data's
plan; `resolve` fills them in and the resolved configuration is printed at start and stored in checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from data.augment import AUGMENTATIONS
from data.plan import ACQUISITION_CHANNELS, CROPS, ORIENTATIONS, Plan, PlanRequest
from data.prepare import DataConfig
from data.synthetic import GEOMETRIES
from unet3d import precision
from unet3d.inference.sliding_window import overlap_problem

MAX_FEATURES = 4096  # channels of one level: far beyond any GPU's memory for a 3D U-Net
MAX_LR = 1000.0  # above this a learning rate (or weight decay) is a typo, and overflows float32 updates
# --samples-per-epoch 10^12 was accepted and failed at the first epoch allocating 8 TB for the sample order
UPPER_BOUNDS = {
    "batch_size": 4096,
    "samples_per_epoch": 10**7,
    "epochs": 10**6,
    "val_every": 10**6,
    "max_bad_steps": 10**6,
    "num_workers": 256,
    "synthetic_cases": 10**4,
    "synthetic_size": 1024,
}
MAX_TIMEOUT_S = 7 * 86400.0  # --dist-timeout and --setup-timeout: a week (datetime.timedelta must hold it)

CHOICES = {
    "optimizer": ("sgd", "adamw"),
    "loss": ("dice", "dice_ce"),
    "amp": precision.AMP_CHOICES,
    "memory_format": precision.MEMORY_FORMAT_CHOICES,
    "orientation": ORIENTATIONS,
    "crop": CROPS,
    "synthetic_geometry": GEOMETRIES,
    "deep_supervision": ("auto", "on", "off"),
    "augmentation": ("auto", *AUGMENTATIONS),
    "simulate_thick_slices": ("auto", "off"),
    "acquisition_channel": ACQUISITION_CHANNELS,
    "label_targets": ("soft", "hard"),
}

# Defaults by device type. GPUs get nnU-Net's 3d_fullres width and a large patch; the CPU defaults are
# sized so that the quick start learns the synthetic task in a few minutes on two cores. The plan takes
# its patch's voxel count as the budget, and the first and last widths (doubling per level) with at most
# as many levels as given here; the patch follows the data (`data.plan.plan_network`).
# Epochs of a run with --time-limit and no --epochs: the budget decides how much training fits, so one
# command gives a slow CPU and a fast one each the most their time allows (the learning rate anneals over it).
UNTIL_TIME_LIMIT = 1_000_000

DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {
        "features": (32, 64, 128, 256, 320, 320),
        "patch_size": (128, 128, 128),
        "epochs": 1000,
        "samples_per_epoch": 500,
        "momentum": 0.99,
        "deep_supervision": "on",
        "augmentation": "nnunet",
    },
    "cpu": {
        "features": (8, 16, 32, 64),
        "patch_size": (48, 48, 32),
        "epochs": 16,
        "samples_per_epoch": 128,
        "momentum": 0.95,
        "deep_supervision": "off",
        "augmentation": "basic",
    },
}


class DurationError(argparse.ArgumentTypeError, ValueError):
    """A --time-limit that is not one: a ValueError at the boundary, and its message printed as it is by
    argparse (which words any other ValueError of a type function as "invalid parse_duration value")."""


def parse_duration(text: str | float) -> float:
    """'5400', '90.5' or '01:30:00' (HH:MM:SS, or MM:SS) -> seconds.

    Raises:
        DurationError: anything else, negative or non-finite parts included.
    """
    if isinstance(text, (int, float)):
        return float(text)
    problem = DurationError(f"--time-limit {text!r}: give seconds or HH:MM:SS")
    try:
        parts = [float(p) for p in str(text).split(":")]
    except ValueError as e:
        raise problem from e
    if not 1 <= len(parts) <= 3 or not all(math.isfinite(p) and p >= 0 for p in parts):
        raise problem
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + p
    return seconds


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(kw_only=True)
class TrainConfig:
    data_dir: str | None = _f(None, "dataset folder in the MSD layout; default: generate the synthetic dataset")
    out_dir: str = _f("runs/default", "run folder: checkpoints/, tensorboard/; a restarted job finds its own here")
    synthetic_dir: str = _f("runs/synthetic", "where the synthetic dataset is written (once) and reused")
    synthetic_cases: int = _f(24, "number of synthetic training cases")
    synthetic_size: int = _f(64, "in-plane size of the synthetic volumes, in mm (1 mm voxels in-plane by default)")
    synthetic_geometry: str = _f(
        "uniform",
        "synthetic acquisitions: uniform (1 x 1 x 1.5 mm, RAS), mixed (isotropic RAS, thick-slice LPS, sagittal "
        "thick-axis-first), or one of mixed's protocols for every case (isotropic, axial, sagittal); the same anatomy "
        "in world coordinates",
    )
    cache_dir: str | None = _f(None, "preprocessing cache (default: runs/cache/<dataset>-<hash>), reused across runs")
    val_fraction: float = _f(0.2, "share of the training list held out for validation (unless --fold is given)")
    fold: str | None = _f(None, "cross-validation: train fold 0..folds-1 (its validation cases held out), or all")
    folds: int = _f(5, "the number of cross-validation folds (a deterministic split by case name and seed)")
    seed: int = _f(0, "seed of the split, the initial weights and every random patch")
    orientation: str = _f(
        "RAS", "bring every case to RAS axis order and directions (by permutations and flips), or none"
    )
    spacing: str | tuple[float, ...] = _f(
        "auto",
        "target voxel spacing in mm: auto (nnU-Net's rule from the training cases), none (each case as stored), "
        "or X Y Z",
        nargs="+",
        type=str,
        metavar="auto|none|X Y Z",
    )
    crop: str = _f("nonzero", "crop every case to its image's non-zero region (nonzero), or none")
    patch_size: tuple[int, ...] | None = _f(
        None, "training patch: one int or three (default: planned from the data within the device's budget)", nargs="+"
    )
    features: tuple[int, ...] | None = _f(
        None,
        "channels per U-Net level, finest first (default: planned; their number is the number of levels)",
        nargs="+",
    )
    batch_size: int = _f(2, "patches per step per process (the global batch is this times the world size)")
    epochs: int | None = _f(
        None, "number of epochs (default: by device; with --time-limit, as many as the budget allows)"
    )
    samples_per_epoch: int | None = _f(
        None,
        "patches per epoch over all ranks (default: by device); "
        "rounded up to a multiple of batch size times world size",
    )
    optimizer: str = _f("sgd", "sgd (Nesterov momentum, poly decay, as nnU-Net) or adamw (warmup, cosine)")
    lr: float | None = _f(None, "peak learning rate (default: 0.01 for sgd, 1e-3 for adamw)")
    momentum: float | None = _f(
        None,
        "SGD momentum (default: 0.99 on GPUs as nnU-Net; 0.95 on the CPU, where 0.99 learns small classes too late)",
    )
    weight_decay: float = _f(3e-5, "weight decay")
    loss: str = _f("dice_ce", "dice or dice_ce (soft Dice plus cross-entropy)")
    amp: str = _f(
        "auto",
        "mixed precision: auto (bf16 on GPUs that support it, fp16 on older ones, bf16 on CPUs with native bf16, "
        "else off), bf16, fp16, off",
    )
    memory_format: str = _f(
        "auto",
        "layout of the model's activations: auto (channels_last when the CPU trains in fp32, where it is faster; "
        "else contiguous), channels_last, contiguous",
    )
    compile: bool = _f(False, "torch.compile the model (slow to start; faster steps on GPUs and bf16 CPUs)")
    grad_checkpoint: bool = _f(False, "recompute block activations in the backward pass: less memory, larger patches")
    deep_supervision: str = _f(
        "auto", "supervise the decoder's coarser levels too, with nnU-Net's weights: on, off, auto (by device)"
    )
    augmentation: str = _f(
        "auto",
        "patch augmentation: basic (mirroring, intensity), nnunet (plus rotation, scaling, noise, blur, "
        "contrast, low resolution), auto (by device)",
    )
    simulate_thick_slices: str = _f(
        "auto",
        "auto: where the training cases mix thick-slice and fine acquisitions, a third of the fine cases' patches "
        "are re-acquired as the thick ones (data.acquisitions), labels unchanged; off: never",
    )
    acquisition_channel: str = _f(
        "off",
        "auto: where some training case is thick-slice at the planned spacing, the network gets one more input "
        "channel, each voxel's distance to its scan's nearest measured plane (data.acquisitions); off (the "
        "default: an experiment that has not closed the geometry gap): never",
    )
    label_targets: str = _f(
        "soft",
        "soft: a case resampled to a coarser grid is trained on each boundary voxel's share of its two leading "
        "classes (data.geometry.resample_label_shares), so a prediction resampled back to the case's finer grid "
        "can place the boundary inside the planned voxel; hard: the planned label only, as nnU-Net trains",
    )
    fg_fraction: float = _f(1 / 3, "share of patches centred on a foreground voxel")
    val_every: int = _f(1, "validate every this many epochs (and after the last)")
    val_overlap: float = _f(0.5, "sliding-window overlap during validation, 0 to 0.9")
    num_workers: int | None = _f(None, "DataLoader workers per process (default: from CPUs per local rank)")
    resume: str = _f(
        "auto", "auto (OUT/checkpoints/last.pt, else previous.pt, if one exists), none, or a checkpoint path"
    )
    time_limit: float | None = _f(
        None,
        "stop gracefully before this many seconds (or HH:MM:SS); the learning rate anneals over the budget "
        "and a last validation fits in it",
        type=parse_duration,
        metavar="SECONDS|HH:MM:SS",
    )
    profile: int = _f(
        0,
        "run this many steps of the first epoch under torch.profiler on rank 0 and write a trace to "
        "OUT/profile/ (TensorBoard's profiler plugin and Perfetto open it), then go on",
    )
    profile_every_rank: bool = _f(False, "with --profile, every rank writes its own trace")
    max_bad_steps: int = _f(5, "stop after this many consecutive steps skipped for a non-finite loss or gradient")
    dist_timeout: float = _f(900.0, "seconds a collective may wait for the other ranks before the job fails")
    setup_timeout: float = _f(
        60.0, "seconds for the ranks to connect; a hung reconnection after a restart fails this fast"
    )
    prepare_only: bool = _f(
        False, "check the dataset and resume checkpoint, build the cache, then exit (launch.sh runs this first)"
    )

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, got {getattr(self, name)!r}")
        self.spacing = _spacing(self.spacing)
        if self.patch_size is not None:
            self.patch_size = _triple(self.patch_size, "patch_size")
        if self.features is not None:
            self.features = tuple(int(f) for f in self.features)
            if len(self.features) < 2 or min(self.features) < 1 or max(self.features) > MAX_FEATURES:
                raise ValueError(f"--features needs at least two ints in 1..{MAX_FEATURES}, got {self.features}")
        positive = [
            "batch_size",
            "val_every",
            "synthetic_cases",
            "synthetic_size",
            "epochs",
            "samples_per_epoch",
            "max_bad_steps",
        ]
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.lr is not None and not 0 < self.lr <= MAX_LR:
            raise ValueError(f"--lr must be in (0, {MAX_LR:g}], got {self.lr}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.weight_decay <= MAX_LR:  # (NaN fails both)
            raise ValueError(f"--weight-decay must be in [0, {MAX_LR:g}], got {self.weight_decay}")
        if self.synthetic_cases < 2 or self.synthetic_size < 8:  # the generator's smallest dataset
            raise ValueError(
                f"--synthetic-cases must be >= 2 and --synthetic-size >= 8, got {self.synthetic_cases} and "
                f"{self.synthetic_size}"
            )
        if not 0 <= self.seed < 2**32:  # numpy's and the sampler's generators take 32-bit seeds
            raise ValueError(f"--seed must be in 0..{2**32 - 1}, got {self.seed}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not 0 <= self.fg_fraction <= 1:
            raise ValueError(f"--fg-fraction must be in [0, 1], got {self.fg_fraction}")
        if problem := overlap_problem("--val-overlap", self.val_overlap):
            raise ValueError(problem)
        if self.fold is not None and self.fold != "all" and not re.fullmatch("[0-9]+", str(self.fold)):
            raise ValueError(f"--fold must be all or a fold number, got {self.fold!r}")
        if self.folds < 2:
            raise ValueError(f"--folds must be >= 2, got {self.folds}")
        if self.profile < 0:
            raise ValueError(f"--profile must be >= 0 steps, got {self.profile}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.time_limit is not None and not 0 < self.time_limit < math.inf:
            raise ValueError(f"--time-limit must be > 0 seconds, got {self.time_limit}")
        for name in ("dist_timeout", "setup_timeout"):
            if not 1 <= getattr(self, name) <= MAX_TIMEOUT_S:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be 1 to {MAX_TIMEOUT_S:.0f} seconds, got {getattr(self, name)}"
                )

    def data(self) -> DataConfig:
        """The fields that choose the run's data: its dataset, synthetic or not, its split and its cache."""
        return DataConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DataConfig)})


def _spacing(value: str | Sequence) -> str | tuple[float, float, float]:
    values = [value] if isinstance(value, str) else list(value)
    if len(values) == 1 and str(values[0]) in ("auto", "none"):
        return str(values[0])
    try:
        spacing = tuple(float(v) for v in values)
    except ValueError as e:
        raise ValueError(f"--spacing takes auto, none or three sizes in mm, got {' '.join(map(str, values))}") from e
    if len(spacing) != 3 or not all(math.isfinite(v) and v > 0 for v in spacing):
        raise ValueError(f"--spacing takes auto, none or three positive sizes in mm, got {' '.join(map(str, values))}")
    return spacing


def _triple(value: int | Sequence[int], name: str) -> tuple[int, int, int]:
    values = (value,) if isinstance(value, int) else tuple(value)
    if len(values) == 1:
        values = values * 3
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"--{name.replace('_', '-')} takes one positive int or three, got {value}")
    return tuple(int(v) for v in values)


def default_num_workers(cpu_count: int, local_world_size: int) -> int:
    """DataLoader workers per rank: the rank's share of the CPUs less one for the training loop, 1..12."""
    return max(1, min(12, cpu_count // max(local_world_size, 1) - 1))


def plan_request(cfg: TrainConfig, device_type: str) -> PlanRequest:
    """What the plan is asked for: the geometry options, and the device's budget for patch and network."""
    defaults = DEVICE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    return PlanRequest(
        orientation=cfg.orientation,
        spacing=cfg.spacing,
        crop=cfg.crop,
        patch_voxels=math.prod(defaults["patch_size"]),
        widths=(defaults["features"][0], defaults["features"][-1]),
        max_levels=len(defaults["features"]),
        patch_size=cfg.patch_size,
        features=cfg.features,
        acquisition_channel=cfg.acquisition_channel,
    )


def resolve(
    cfg: TrainConfig, plan: Plan, device_type: str, world_size: int, cpu_count: int, local_world_size: int
) -> TrainConfig:
    """A copy of `cfg` with every None replaced: the patch and widths by the plan (explicit values stay, and
    a resumed run that asks for others than its checkpoint's is refused by the compatibility check), the
    rest by this device and world."""
    defaults = DEVICE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    step = cfg.batch_size * world_size
    samples = cfg.samples_per_epoch or defaults["samples_per_epoch"]
    return dataclasses.replace(
        cfg,
        features=tuple(cfg.features or plan.features),
        patch_size=tuple(cfg.patch_size or plan.patch_size),
        epochs=cfg.epochs or (UNTIL_TIME_LIMIT if cfg.time_limit is not None else defaults["epochs"]),
        samples_per_epoch=math.ceil(samples / step) * step,
        lr=cfg.lr or (0.01 if cfg.optimizer == "sgd" else 1e-3),
        momentum=cfg.momentum if cfg.momentum is not None else defaults["momentum"],
        deep_supervision=defaults["deep_supervision"] if cfg.deep_supervision == "auto" else cfg.deep_supervision,
        augmentation=defaults["augmentation"] if cfg.augmentation == "auto" else cfg.augmentation,
        num_workers=cfg.num_workers
        if cfg.num_workers is not None
        else default_num_workers(cpu_count, local_world_size),
    )


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one --option per TrainConfig field."""
    # No abbreviations: launch.sh looks for some options by their full names (--help: once, not from every
    # rank), so `--he` started the whole job, and a shortened name would mean one thing here, another there.
    parser = argparse.ArgumentParser(
        description="Train a 3D U-Net with DistributedDataParallel (run under torchrun, or alone).",
        allow_abbrev=False,
    )
    hints = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(TrainConfig):
        shown = (
            ""
            if f.default is None or isinstance(f.default, bool)
            else f" (default: {f.default:.3g})"
            if isinstance(f.default, float)
            else (f" (default: {f.default})")
        )
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"] + shown}
        hint = str(hints[f.name])
        if "type" in f.metadata:
            kwargs.update(type=f.metadata["type"], metavar=f.metadata["metavar"])
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
        elif "nargs" in f.metadata:
            kwargs.update(nargs=f.metadata["nargs"], type=int, metavar="N")
        elif hint == "bool":
            kwargs["action"] = "store_true"
        elif f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        elif hint.startswith("int"):
            kwargs["type"] = int
        elif hint.startswith("float"):
            kwargs["type"] = float
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Command line -> validated TrainConfig; a bad value exits with argparse's usage error (code 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_upper_bounds(vars(args))
        return TrainConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
        raise  # parser.error exits; this keeps type checkers content


def check_upper_bounds(given: dict) -> None:
    """Values beyond UPPER_BOUNDS are typos that fail late and obscurely: refused as given on the command
    line (resolving may round --samples-per-epoch up to a multiple of the global batch, past the bound)."""
    for name, most in UPPER_BOUNDS.items():
        value = given.get(name)
        if value is not None and value > most:
            raise ValueError(f"--{name.replace('_', '-')} must be <= {most}, got {value}")
