"""DDP equivalence: two gloo ranks with half a batch each take the same step as one process with all of it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from data.patches import PreparedCase
from tests.helpers import control_for, runtime, spawn_ranks, state_for
from unet3d import UNet3D
from unet3d.inference.metrics import case_metrics
from unet3d.inference.sliding_window import InferenceSettings, predict
from unet3d.loss import DiceCELoss
from unet3d.training import dist
from unet3d.training.epoch import train_one_epoch
from unet3d.training.validation import shard, validate

BATCH = 4


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    label = torch.randint(0, 3, (BATCH, 16, 16, 8), generator=g, dtype=torch.uint8)
    image = label[:, None].float() + torch.randn(BATCH, 1, 16, 16, 8, generator=g)
    return image, label


def sgd_steps(info: dist.DistInfo, wrapped, model: UNet3D, batch, steps: int):
    """`steps` real training steps (train_one_epoch, SGD at lr 0.1) on `batch` each time; their EpochStats."""
    rt = runtime(info, steps)
    return train_one_epoch(rt, state_for(rt, model), wrapped, DiceCELoss(), [batch] * steps, control_for(rt))


def my_share(info: dist.DistInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous share of make_batch()."""
    image, label = make_batch()
    share = BATCH // info.world_size
    mine = slice(info.rank * share, (info.rank + 1) * share)
    return image[mine], label[mine]


def one_step(info: dist.DistInfo, out: Path) -> None:
    """One real training step on this rank's share of the batch; rank 0 saves weights."""
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8, 16))
    wrapped = DDP(model) if dist.is_dist() else model
    stats = sgd_steps(info, wrapped, model, my_share(info), 1)
    if info.is_main:
        torch.save({"model": model.state_dict(), "loss": stats.loss, "samples": stats.samples}, out)


def plain_then_compiled(info: dist.DistInfo, plain: Path, compiled: Path) -> None:
    one_step(info, plain)
    one_step_compiled(info, compiled)


def test_two_ranks_half_batch_equal_one_process_whole_batch(tmp_path, alone):
    """Also through --compile's wrapping (one_step_compiled), by the same two ranks."""
    single = tmp_path / "single.pt"
    one_step(dist.setup(), single)
    spawn_ranks(plain_then_compiled, 2, tmp_path / "ddp.pt", tmp_path / "compiled.pt")
    a = torch.load(single, map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "ddp.pt", map_location="cpu", weights_only=True)
    assert b["samples"] == a["samples"] == BATCH
    assert abs(a["loss"] - b["loss"]) < 1e-6, "the epoch loss is averaged over both ranks' samples"
    torch.manual_seed(0)
    initial = UNet3D(1, 3, (4, 8, 16)).state_dict()
    moved = 0
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        moved += not torch.equal(value, initial[key])
    assert moved > len(initial) // 2, "the step must change the weights for the comparison to mean anything"
    # --compile compiles the DDP wrapper: the same step, and the weights saved (the unwrapped model's) carry
    # neither `module.` nor `_orig_mod.`
    c = torch.load(tmp_path / "compiled.pt", map_location="cpu", weights_only=True)
    assert list(c["model"]) == list(a["model"]) and abs(a["loss"] - c["loss"]) < 1e-6 and c["samples"] == BATCH
    for key, value in a["model"].items():
        torch.testing.assert_close(c["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def one_step_compiled(info: dist.DistInfo, out: Path) -> None:
    """`one_step` through what --compile trains with: `wrap_for_training`'s torch.compile of the DDP wrapper.
    Dynamo's eager backend stands in for inductor, whose C++ compilation would take a minute here: the
    graph capture around DDP, its gradient hooks and the unwrapped model's checkpoint keys are the same."""
    import functools

    from unet3d.training.runtime import wrap_for_training

    torch.compile = functools.partial(torch.compile, backend="eager")  # this spawned process's own torch
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8, 16))
    rt = runtime(info, 1, compile=True)
    wrapped = wrap_for_training(rt, model)
    assert type(wrapped).__name__ == "OptimizedModule" and isinstance(wrapped._orig_mod, DDP)
    stats = train_one_epoch(rt, state_for(rt, model), wrapped, DiceCELoss(), [my_share(info)], control_for(rt))
    if info.is_main:
        torch.save({"model": model.state_dict(), "loss": stats.loss, "samples": stats.samples}, out)


def test_half_batch_alone_differs(tmp_path, alone):
    """Control: without DDP's gradient averaging, half the batch gives other weights."""
    one_step(dist.setup(), tmp_path / "single.pt")
    info = dist.DistInfo(0, 0, 2, 2, torch.device("cpu"))
    one_step(info, tmp_path / "half.pt")
    a = torch.load(tmp_path / "single.pt", map_location="cpu", weights_only=True)["model"]
    b = torch.load(tmp_path / "half.pt", map_location="cpu", weights_only=True)["model"]
    assert any(not torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def make_val_cases(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Odd-sized volumes, not multiples of the window, with labels loosely following the image."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for i in range(n):
        shape = (13 + i, 11, 9 + 2 * i)
        label = torch.randint(0, 3, shape, generator=g, dtype=torch.uint8)
        image = label[None].float() + 0.8 * torch.randn(1, *shape, generator=g)
        cases.append((image.numpy(), label.numpy()))
    return cases


def run_validation(info: dist.DistInfo, out: Path) -> None:
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8))
    cases = [PreparedCase(f"v{i}", image, label, {}) for i, (image, label) in enumerate(make_val_cases())]
    mine = shard(cases, info.rank, info.world_size)
    result = validate(model, mine, 3, InferenceSettings(window=(8, 8, 8)), info.device)
    torch.save(
        {"per_class": torch.from_numpy(result.per_class), "mean": result.mean_dice, "n": result.num_cases},
        out.with_name(f"{out.stem}_{info.rank}.pt"),
    )


def test_distributed_validation_equals_single_process(tmp_path, alone):
    run_validation(dist.setup(), tmp_path / "single.pt")
    single = torch.load(tmp_path / "single_0.pt", weights_only=True)
    assert single["n"] == 5 and 0 < single["mean"] < 1
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8))
    by_hand = [evaluate_case(model, image, label) for image, label in make_val_cases()]
    torch.testing.assert_close(
        single["per_class"], torch.tensor(by_hand, dtype=torch.float64).mean(0)[1:], rtol=0, atol=1e-12
    )
    # Three ranks: shards of 2, 2 and 1 cases (the end-to-end runs validate on 2 and on 6 ranks).
    spawn_ranks(run_validation, 3, tmp_path / "w3.pt")
    for rank in range(3):
        got = torch.load(tmp_path / f"w3_{rank}.pt", weights_only=True)
        assert got["n"] == 5, "every case exactly once, no padding duplicates"
        torch.testing.assert_close(got["per_class"], single["per_class"], rtol=0, atol=1e-12)
        assert abs(got["mean"] - single["mean"]) < 1e-12


def validation_asked_to_stop(info: dist.DistInfo, out: Path) -> None:
    """Rank 1 is asked to stop (a stop signal) once it has predicted its first case."""
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8))
    cases = [PreparedCase(f"v{i}", image, label, {}) for i, (image, label) in enumerate(make_val_cases())]
    mine = shard(cases, info.rank, info.world_size)
    asked = []
    result = validate(
        model, mine, 3, InferenceSettings(window=(8, 8, 8)), info.device,
        stop=lambda: asked.append(1) is None and info.rank == 1,
    )  # fmt: skip
    out.with_name(f"{out.stem}_{info.rank}.txt").write_text(f"{result is None} {len(asked)}")


def test_a_stop_signal_during_validation_ends_it_on_every_rank_after_the_same_round(tmp_path):
    """A validation of many large scans can outlast what torchrun or a scheduler waits for a graceful stop:
    a rank asked to stop says so in the round's reduction, and every rank gives up after that round."""
    spawn_ranks(validation_asked_to_stop, 2, tmp_path / "stop.pt")
    verdicts = [(tmp_path / f"stop_{rank}.txt").read_text() for rank in range(2)]
    assert verdicts == ["True 1", "True 1"], "both ranks gave up after the first of three rounds"


def evaluate_case(model, image, label) -> list[float]:
    """evaluate.py's per-case Dice for one case (the definition validation must reproduce)."""
    pred = predict(model, image, InferenceSettings(window=(8, 8, 8)), torch.device("cpu")).numpy()
    return [1.0] + [row["dice"] for row in case_metrics(pred, label, 3, (1.0, 1.0, 1.0))]


def one_step_channels_last(info: dist.DistInfo, out: Path, threads: tuple[int, ...]) -> None:
    """Two training steps with the model channels-last and DDP set up as train_ddp.py does it, once with
    each number of threads (one process group, a fresh model and wrapper each time)."""
    import json
    import warnings

    from unet3d.precision import apply_memory_format

    for n in threads:
        torch.set_num_threads(n)  # the weight gradients' strides of 1x1x1 kernels depend on it
        torch.manual_seed(0)
        model = apply_memory_format(UNet3D(1, 3, (4, 8, 16)), torch.channels_last_3d)
        wrapped = DDP(model, gradient_as_bucket_view=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sgd_steps(info, wrapped, model, my_share(info), 2)
        (out / f"warnings{n}_{info.rank}.json").write_text(json.dumps([str(w.message) for w in caught]))
        if info.is_main:
            torch.save({"model": model.state_dict()}, out / f"ddp{n}.pt")
        del wrapped


def test_channels_last_ranks_step_as_the_contiguous_model_without_stride_warnings(tmp_path, alone):
    """The CPU's default layout in fp32: same weights as channels-first, and DDP's buckets fit every gradient."""
    import json

    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8, 16))
    sgd_steps(dist.DistInfo(0, 0, 1, 1, torch.device("cpu")), model, model, make_batch(), 2)
    spawn_ranks(one_step_channels_last, 2, tmp_path, (1, 2))
    for threads in (1, 2):
        for rank in (0, 1):
            caught = json.loads((tmp_path / f"warnings{threads}_{rank}.json").read_text())
            assert not [w for w in caught if "strides" in w], caught
        ddp = torch.load(tmp_path / f"ddp{threads}.pt", map_location="cpu", weights_only=True)["model"]
        for key, value in model.state_dict().items():
            torch.testing.assert_close(ddp[key], value, rtol=1e-4, atol=1e-5, msg=(threads, key))
