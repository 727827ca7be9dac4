from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from data.plan import Fingerprint, make_plan
from unet3d.training.config import (
    DEVICE_DEFAULTS,
    UNTIL_TIME_LIMIT,
    TrainConfig,
    build_parser,
    default_num_workers,
    parse_args,
    plan_request,
    resolve,
)
from unet3d.training.epoch import EpochStats
from unet3d.training.report import epoch_summary
from unet3d.training.timing import EpochTiming


def test_every_field_is_an_option():
    parser = build_parser()
    options = {a.dest for a in parser._actions} - {"help"}
    assert options == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(f.metadata["help"] for f in dataclasses.fields(TrainConfig))


def test_parse_types_and_patch_forms():
    cfg = parse_args(["--patch-size", "32", "--lr", "0.02", "--epochs", "3", "--features", "4", "8", "16"])
    assert cfg.patch_size == (32, 32, 32) and cfg.lr == 0.02 and cfg.epochs == 3 and cfg.features == (4, 8, 16)
    assert parse_args(["--patch-size", "32", "16", "48"]).patch_size == (32, 16, 48)
    assert parse_args([]).resume == "auto" and parse_args([]).out_dir == "runs/default"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--patch-size", "32", "16"], "--patch-size takes one positive int or three"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--val-fraction", "1.0"], "--val-fraction must be in [0, 1), got 1.0"),
        (["--features", "8"], "--features needs at least two ints in 1..4096"),
        (["--features", "100000", "8"], "--features needs at least two ints in 1..4096, got (100000, 8)"),
        (["--lr", "-1"], "--lr must be in (0, 1000], got -1.0"),
        (["--lr", "1e300"], "--lr must be in (0, 1000], got 1e+300"),  # overflowed the float32 update
        (["--weight-decay", "nan"], "--weight-decay must be in [0, 1000], got nan"),
        (["--time-limit", "inf"], "--time-limit 'inf': give seconds or HH:MM:SS"),  # stopped after one step
        (["--time-limit", "1:2:3:4"], "--time-limit '1:2:3:4': give seconds or HH:MM:SS"),
        (["--dist-timeout", "inf"], "--dist-timeout must be 1 to 604800 seconds, got inf"),  # timedelta overflowed
        (["--setup-timeout", "0.001"], "--setup-timeout must be 1 to 604800 seconds, got 0.001"),
        (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
        (["--fold", "\u00b2"], "--fold must be all or a fold number, got '\u00b2'"),  # a digit to isdigit()
        (["--val-overlap", "0.99"], "--val-overlap must be in [0, 0.9], got 0.99 (each voxel is predicted in"),
        (["--synthetic-cases", "1"], "--synthetic-cases must be >= 2 and --synthetic-size >= 8, got 1 and 64"),
        # beyond these: failures late and obscure (10^12 samples: 8 TB for the sample order at the first epoch)
        (["--samples-per-epoch", "1000000000000"], "--samples-per-epoch must be <= 10000000, got 1000000000000"),
        (["--batch-size", "1000000000"], "--batch-size must be <= 4096, got 1000000000"),
        (["--num-workers", "100000"], "--num-workers must be <= 256, got 100000"),
        (["--synthetic-size", "1000000"], "--synthetic-size must be <= 1024, got 1000000"),
    ],
)
def test_bad_values_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_choices_are_validated():
    with pytest.raises(ValueError, match="--amp must be one of"):
        TrainConfig(amp="fp8")
    with pytest.raises(SystemExit):
        parse_args(["--loss", "focal"])


def planned(cfg: TrainConfig, device: str, shape, spacing=(1.0, 1.0, 1.0)):
    """The plan for a dataset of identical cases of this shape and spacing."""
    cases = [Fingerprint(name=f"c{i}", spacing=spacing, shape=shape) for i in range(3)]
    return make_plan(cases, ["MRI"], plan_request(cfg, device))


def test_a_target_spacing_that_would_blow_a_case_up_beyond_memory_is_refused():
    """A CT of 512 x 512 x 300 at 0.7 x 0.7 x 2.5 mm asked for 0.1 mm voxels would need 3.6e11 of them: the plan
    names the case and the option, where preprocessing would run out of memory with a traceback."""
    big = TrainConfig(spacing=(0.1, 0.1, 0.1))
    with pytest.raises(
        ValueError, match=r"0.1 x 0.1 x 0.1 mm \(given \(--spacing\)\), case c0 would be 3584x3584x7500 "
    ):
        planned(big, "cuda", (512, 512, 300), (0.7, 0.7, 2.5))
    assert planned(TrainConfig(spacing=(0.7, 0.7, 0.7)), "cuda", (512, 512, 300), (0.7, 0.7, 2.5)).median_shape == (
        512, 512, 1071,
    )  # fmt: skip


def test_resolve_fills_device_defaults():
    plan = planned(TrainConfig(), "cuda", (300, 300, 300))
    cfg = resolve(TrainConfig(), plan, "cuda", world_size=3, cpu_count=48, local_world_size=3)
    assert cfg.features == DEVICE_DEFAULTS["cuda"]["features"] == (32, 64, 128, 256, 320, 320)
    assert cfg.patch_size == (128, 128, 128) and plan.strides[1:] == ((2, 2, 2),) * 5
    assert cfg.samples_per_epoch % (cfg.batch_size * 3) == 0 and cfg.samples_per_epoch >= 500
    assert cfg.num_workers == 12 and cfg.lr == 0.01 and cfg.momentum == 0.99
    cpu_plan = planned(TrainConfig(), "cpu", (64, 64, 40), (1.0, 1.0, 1.5))
    cpu = resolve(TrainConfig(), cpu_plan, "cpu", world_size=2, cpu_count=2, local_world_size=2)
    assert cpu.features == DEVICE_DEFAULTS["cpu"]["features"] and cpu.patch_size == (48, 48, 32)
    assert cpu.num_workers == 1 and cpu.momentum == 0.95
    assert resolve(TrainConfig(momentum=0.5), cpu_plan, "cpu", 1, 2, 1).momentum == 0.5
    assert cpu.epochs == DEVICE_DEFAULTS["cpu"]["epochs"] == 16


def test_a_time_limit_without_epochs_trains_until_the_budget_is_spent():
    plan = planned(TrainConfig(), "cpu", (64, 64, 40))
    timed = resolve(TrainConfig(time_limit=240), plan, "cpu", 2, 2, 2)
    assert timed.epochs == UNTIL_TIME_LIMIT, "the budget, not the device's epoch count, ends the run"
    assert resolve(TrainConfig(time_limit=240, epochs=3), plan, "cpu", 2, 2, 2).epochs == 3
    timing = EpochTiming([[0.1, 1.0, 0.1, 4, 0, 1, 1]] * 2, ["host, cpu"] * 2)
    stats = EpochStats(7, 0.5, 8, 2.0, 1e-3, 4, 0, 0, None, timing, [])
    assert epoch_summary(timed.epochs, stats, None, ["bg", "a"], False).startswith("epoch 7:")
    assert epoch_summary(16, stats, None, ["bg", "a"], False).startswith("epoch 7/16:")


def test_resolve_takes_the_planned_patch_and_keeps_explicit_values():
    plan = planned(TrainConfig(), "cuda", (40, 200, 20))
    cfg = resolve(TrainConfig(), plan, "cuda", world_size=1, cpu_count=8, local_world_size=1)
    divisor = [int(np.prod([s[a] for s in plan.strides])) for a in range(3)]
    assert cfg.patch_size == plan.patch_size and all(p % d == 0 for p, d in zip(cfg.patch_size, divisor))
    assert cfg.patch_size[0] <= 40 and cfg.patch_size[2] <= 20, "a small median case is covered, not exceeded"
    explicit = TrainConfig(patch_size=(16, 16, 8), features=(4, 8), lr=0.5, epochs=2, samples_per_epoch=5)
    cfg = resolve(
        explicit, planned(explicit, "cpu", (64, 64, 64)), "cpu", world_size=2, cpu_count=2, local_world_size=2
    )
    assert (cfg.patch_size, cfg.features, cfg.lr, cfg.epochs) == ((16, 16, 8), (4, 8), 0.5, 2)
    assert cfg.samples_per_epoch == 8  # rounded up to batch 2 x world 2
    with pytest.raises(
        ValueError, match=r"--features \[4, 8, 16, 32, 64\] asks for 5 levels, but a patch of \[24, 24, 24\]"
    ):
        planned(TrainConfig(patch_size=24, features=(4, 8, 16, 32, 64)), "cuda", (64, 64, 64))


def test_spacing_option_forms():
    assert parse_args([]).spacing == "auto" and parse_args(["--spacing", "none"]).spacing == "none"
    assert parse_args(["--spacing", "0.8", "0.8", "3"]).spacing == (0.8, 0.8, 3.0)
    for bad in (["1", "1"], ["1", "x", "1"], ["0", "1", "1"], ["fine"]):
        with pytest.raises(ValueError, match="--spacing takes auto, none or three"):
            TrainConfig(spacing=bad)


@pytest.mark.parametrize(("cpus", "local", "expected"), [(64, 8, 7), (2, 2, 1), (1, 4, 1), (128, 1, 12)])
def test_default_num_workers(cpus, local, expected):
    assert default_num_workers(cpus, local) == expected


def test_readme_documents_every_option():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [a.option_strings[0] for a in build_parser()._actions if a.option_strings[0] != "-h"]
    missing = [opt for opt in missing if f"`{opt}" not in readme]
    assert not missing, f"README.md does not document {missing}"


def test_readme_documents_every_evaluate_option_and_launcher_variable():
    """evaluate.py's options (but the hidden --shard, its own children's) and launch.sh's environment
    variables (those its --help lists) are interfaces too."""
    import argparse
    import re

    import evaluate

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    shown = [a for a in evaluate.build_parser()._actions if a.help is not argparse.SUPPRESS]
    options = [a.option_strings[0] for a in shown if a.option_strings and a.option_strings[0] != "-h"]
    assert "--overwrite" in options and "--shard" not in options
    spans = " ".join(re.findall(r"`[^`\n]+`", readme))  # the code spans: `--device cpu --workers N` names both
    missing = [opt for opt in options if not re.search(re.escape(opt) + r"(?![\w-])", spans)]
    assert not missing, f"README.md does not document evaluate.py's {missing}"
    usage = (root / "launch.sh").read_text().split("Environment", 1)[1].split("EOF", 1)[0]
    heads = re.findall(r"^  ([A-Z][A-Z_]+(?:, [A-Z][A-Z_]+)*)", usage, re.M)  # "  NNODES, NODE_RANK, ..."
    names = {name for head in heads for name in head.split(", ")}
    assert {"NNODES", "MASTER_ADDR", "NVIDIA_SMI_TIMEOUT", "PYTHON", "TORCHRUN"} <= names, names
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", readme))
    assert not missing, f"README.md does not document launch.sh's {missing}"


def test_more_levels_than_the_patch_allows_is_refused_in_plain_numbers():
    with pytest.raises(ValueError) as err:
        planned(TrainConfig(features=(8, 16, 32, 64, 128), patch_size=(40, 40, 40)), "cpu", (90, 100, 90), (2, 2, 2))
    assert "asks for 5 levels, but a patch of [40, 40, 40] at [2.0, 2.0, 2.0] mm allows 4" in str(err.value)


def test_a_median_case_too_small_for_any_downsampling_is_refused_with_its_numbers():
    """Without the check the network's constructor failed ('features needs at least two positive entries'),
    naming neither the data nor a remedy."""
    with pytest.raises(ValueError) as err:
        planned(TrainConfig(), "cpu", (6, 7, 6), (2, 2, 2))
    assert (
        "a patch of [6, 7, 6] voxels at [2.0, 2.0, 2.0] mm (the median case in the planned space is [6, 7, 6])"
        in str(err.value)
    )
    assert "give a finer --spacing or a larger --patch-size" in str(err.value)
    assert len(planned(TrainConfig(), "cpu", (8, 8, 8), (2, 2, 2)).strides) == 2, "8 voxels halve once"


def test_the_learning_rate_follows_poly_for_sgd_and_warmup_then_cosine_for_adamw():
    """SGD: lr * (1 - progress)^0.9 (nnU-Net); AdamW: a linear warm-up over the first WARMUP of training,
    then a cosine to zero; both driven by progress, which a time budget sets as epochs do."""
    import math

    import torch

    from unet3d.training.optim import WARMUP, build_schedule

    def lrs(name: str, points) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        schedule = build_schedule(optimizer, name)
        out = []
        for p in points:
            schedule.set_progress(p)
            out.append(schedule.get_last_lr()[0])
        return out

    assert lrs("sgd", [0, 0.5, 1]) == pytest.approx([0.01, 0.01 * 0.5**0.9, 0.0])
    warm = lrs("adamw", [0, WARMUP / 2, WARMUP, (1 + WARMUP) / 2, 1, 2])
    assert warm[0] < 0.001 and warm[1] == pytest.approx(0.005, rel=0.06) and warm[2] == pytest.approx(0.01)
    assert warm[3] == pytest.approx(0.005) and warm[4] == pytest.approx(0) and warm[5] == pytest.approx(0)
    assert math.isclose(lrs("adamw", [0.3])[0], 0.005 * (1 + math.cos(math.pi * (0.3 - WARMUP) / (1 - WARMUP))))


def test_validation_comes_every_val_every_epochs_and_after_the_last():
    """--val-every 2 with --epochs 5 validates after epochs 2, 4 and 5; after a stop only for the time
    limit (its budget kept room), never with --fold all."""
    from unet3d.training.control import StopReason
    from unet3d.training.validation import validation_due

    cfg = parse_args(["--val-every", "2", "--epochs", "5"])
    assert [e for e in range(1, 6) if validation_due(cfg, e, None)] == [2, 4, 5]
    assert validation_due(cfg, 1, StopReason.TIME_LIMIT) and not validation_due(cfg, 2, StopReason.SIGNAL)
    assert not any(validation_due(parse_args(["--fold", "all"]), e, None) for e in range(1, 4))


@pytest.mark.parametrize("shortened", ["--he", "--epoch"])
def test_options_are_never_abbreviated(shortened, capsys):
    """launch.sh finds --help by its full name (to print it once, not from every rank): `--he` reached the
    ranks and started the whole job. No option is taken by a prefix of its name."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([shortened, "3"] if shortened == "--epoch" else [shortened])
    assert exit_.value.code == 2 and f"unrecognized arguments: {shortened}" in capsys.readouterr().err


def test_a_samples_per_epoch_at_its_bound_survives_the_rounding_to_the_global_batch():
    """10^7 with batch 3 on two ranks resolves to 10000002: refused after the whole pre-flight before, with a
    number never given. The bound is the command line's."""
    from data.plan import legacy_plan

    cfg = parse_args(["--samples-per-epoch", "10000000", "--batch-size", "3"])
    plan = legacy_plan(["MRI"], (16, 16, 16), (4, 8))
    assert resolve(cfg, plan, "cpu", 2, 2, 2).samples_per_epoch == 10000002
