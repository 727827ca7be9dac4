"""Branches that only GPUs (or fp16) take, reached on the CPU: the device and its capability stubbed where
needed, the real code everywhere else."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data.plan import legacy_plan
from tests.helpers import control_for, runtime, spawn_ranks, state_for
from unet3d import DiceCELoss, UNet3D
from unet3d import precision as amp
from unet3d.checkpoint import CheckpointError, load_checkpoint
from unet3d.files import temp_path
from unet3d.training import dist
from unet3d.training.config import TrainConfig
from unet3d.training.control import TrainingError
from unet3d.training.epoch import train_one_epoch
from unet3d.training.optim import build_optimizer, optimizer_kernels
from unet3d.training.runtime import Runtime, describe_run
from unet3d.training.state import TrainState

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")
CF = torch.contiguous_format
FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1.pt"


def fake_gpu(monkeypatch, capability: tuple[int, int], name: str = "Tesla V100-SXM2-32GB") -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    # torch's own check also counts emulated bf16 as support: it must not be what decides
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
)
def test_amp_auto_follows_the_compute_capability(monkeypatch, capability, expected):
    fake_gpu(monkeypatch, capability)
    assert amp.resolve_amp("auto", GPU) == expected
    assert amp.grad_scaler(torch.device("cpu"), expected).is_enabled() == (expected == torch.float16)


def test_amp_bf16_is_refused_on_gpus_without_bf16_tensor_cores(monkeypatch):
    fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    with pytest.raises(ValueError, match=r"--amp bf16: Tesla T4 \(compute capability 7.5\) has no bf16 tensor cores"):
        amp.resolve_amp("bf16", GPU)
    fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    assert amp.resolve_amp("bf16", GPU) == torch.bfloat16


@pytest.mark.parametrize(
    ("device", "dtype", "kernels"),
    [
        (GPU, torch.float16, "foreach"),  # fp16 loss scaling: never the fused kernels
        (GPU, torch.bfloat16, "fused"),
        (GPU, None, "fused"),
        (torch.device("cpu"), torch.float16, "default"),
        (torch.device("cpu"), None, "default"),
    ],
)
def test_fused_optimizers_never_run_under_fp16_loss_scaling(device, dtype, kernels):
    assert optimizer_kernels(device, dtype) == kernels
    for name in ("sgd", "adamw"):
        optimizer = build_optimizer(torch.nn.Linear(2, 2).parameters(), name, 0.1, 0.0, 0.9, kernels="foreach")
        assert optimizer.defaults["foreach"] is True and not optimizer.defaults.get("fused")
    with pytest.raises(ValueError, match="kernels must be"):
        build_optimizer(torch.nn.Linear(2, 2).parameters(), "sgd", 0.1, 0.0, 0.9, kernels="fast")


def test_device_report_without_props_uuid(monkeypatch, caplog, tmp_path):
    """`props.uuid` is missing on some torch versions the project allows: the report must not need it."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name="Tesla V100"))
    info = dist.DistInfo(0, 0, 1, 1, GPU)
    cfg = TrainConfig(
        features=(4, 8), patch_size=(16, 16, 8), epochs=1, samples_per_epoch=4, num_workers=0, out_dir=str(tmp_path)
    )
    plan = legacy_plan(["MRI"], (16, 16, 8), (4, 8))
    spec = SimpleNamespace(class_names=["bg", "x"])
    run = SimpleNamespace(data_dir="d", train=[], val=[], spec=spec, cache="c", plan=plan)
    logger = logging.getLogger("unet3d")
    logger.propagate = True
    with caplog.at_level(logging.INFO, logger="unet3d"):
        describe_run(Runtime(cfg=cfg, dist=info, amp_dtype=torch.float16, memory_format=CF, steps_per_epoch=2), run)
    text = caplog.text
    assert "device cuda:0 = Tesla V100, CUDA_VISIBLE_DEVICES=" in text and "UUID" not in text
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name="H100", uuid="1234-abcd")
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unet3d"):
        describe_run(Runtime(cfg=cfg, dist=info, amp_dtype=torch.bfloat16, memory_format=CF, steps_per_epoch=2), run)
    assert "= H100 (UUID GPU-1234-abcd)" in caplog.text


def _resume_fixture_into(scaler: torch.amp.GradScaler, warnings: list[str], path: Path = FIXTURE) -> TrainState:
    """The fixture checkpoint loaded into a TrainState whose scaler is `scaler`, as resume() does."""
    checkpoint = load_checkpoint(path, "cpu")
    rt = runtime(dist.DistInfo(0, 0, 2, 2, CPU), 2, **{**checkpoint["config"], "amp": "fp16"})
    model = UNet3D(**checkpoint["model_args"])
    state = state_for(rt, model)
    state.scaler = scaler
    state.load(checkpoint, source=str(path), rank=0, world_size=1, warn=warnings.append)
    return state


def test_fp16_resume_from_a_checkpoint_written_without_a_grad_scaler():
    """The fixture was trained without fp16 (its scaler state is empty); resuming with fp16 starts a fresh scale."""
    assert load_checkpoint(FIXTURE, "cpu")["scaler"] == {}
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # what --amp fp16 builds
    warnings: list[str] = []
    state = _resume_fixture_into(scaler, warnings)
    assert state.epoch == 1 and state.step == 0 and scaler.get_scale() == 65536.0
    assert any("holds no GradScaler state" in w for w in warnings), warnings


@pytest.mark.parametrize("saved", ["fused", "foreach"])
def test_resuming_keeps_this_runs_optimizer_kernels_not_the_checkpoints(tmp_path, saved):
    """A checkpoint's param groups carry the kernels of the run that wrote it (a bf16 run: fused); loading
    them would make an fp16 run step with the fused kernels under the GradScaler. The run keeps its own
    choice (on this CPU: torch's default, neither flag), and the moments and step counts are loaded."""
    checkpoint = load_checkpoint(FIXTURE, "cpu")
    for group in checkpoint["optimizer"]["param_groups"]:
        group.update(fused=saved == "fused" or None, foreach=saved == "foreach" or None)
    torch.save(checkpoint, tmp_path / "written_elsewhere.pt")
    state = _resume_fixture_into(torch.amp.GradScaler("cpu", enabled=False), [], tmp_path / "written_elsewhere.pt")
    assert [(g["fused"], g["foreach"]) for g in state.optimizer.param_groups] == [(None, None)]
    saved_state = checkpoint["optimizer"]["state"]
    assert len(state.optimizer.state_dict()["state"]) == len(saved_state) > 0
    first = next(iter(saved_state))
    for key, value in saved_state[first].items():
        torch.testing.assert_close(state.optimizer.state_dict()["state"][first][key], value, msg=key)


def test_an_unusable_optimizer_state_is_a_checkpoint_error(tmp_path):
    """Classified, so the job ends once with a message instead of torchrun restarting the same crash."""
    state = load_checkpoint(FIXTURE, "cpu")
    state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"] * 2
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=r"bad.pt: its optimizer or schedule state does not fit"):
        _resume_fixture_into(torch.amp.GradScaler("cpu", enabled=False), [], tmp_path / "bad.pt")


def test_fp16_overflow_steps_are_counted_skipped_and_left_out_of_the_loss():
    """At a huge initial scale the first fp16 steps overflow: skipped as the GradScaler does, counted, never a
    'bad step' fault (more of them in a row than --max-bad-steps), and their loss is not in the epoch mean."""
    torch.manual_seed(0)
    steps = 60
    rt = runtime(dist.DistInfo(0, 0, 1, 1, CPU), steps, torch.float16, lr=0.01, momentum=0.9, max_bad_steps=3)
    state = state_for(rt, UNet3D(1, 3, (4, 8)))
    state.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    label = torch.randint(0, 3, (2, 8, 8, 8))
    batch = (label[:, None].float() + torch.randn(2, 1, 8, 8, 8), label)
    stats = train_one_epoch(rt, state, state.model, DiceCELoss(), [batch] * steps, control_for(rt))
    assert stats.overflowed > 3, "more overflows in a row than --max-bad-steps, and no TrainingError"
    assert stats.skipped == 0 and stats.overflowed < steps
    assert stats.samples == 2 * (steps - stats.overflowed), "overflowed steps are not in the epoch's mean loss"
    assert math.isfinite(stats.loss) and state.scaler.get_scale() < 2.0**60
    assert state.epoch == 1, "the epoch is counted as done"


def test_fp16_gradients_that_stay_non_finite_stop_the_job_once_the_loss_scale_is_below_1():
    """A finite loss with NaN gradients looks like a loss-scale overflow under fp16: the GradScaler halves the
    scale and skips the step. Halving never cures it, so once the scale is below 1 it is a TrainingError (it
    skipped every step to the end of training, the scale falling to 6e-8, before)."""
    torch.manual_seed(0)
    rt = runtime(dist.DistInfo(0, 0, 1, 1, CPU), 40, torch.float16, lr=0.01, momentum=0.9, max_bad_steps=3)
    model = UNet3D(1, 3, (4, 8))
    state = state_for(rt, model)
    state.scaler = torch.amp.GradScaler("cpu")  # what --amp fp16 builds: 65536 to start
    next(model.parameters()).register_hook(lambda grad: grad * float("nan"))
    label = torch.randint(0, 3, (2, 8, 8, 8))
    batch = (label[:, None].float() + torch.randn(2, 1, 8, 8, 8), label)
    with pytest.raises(TrainingError, match=r"step 18: fp16 gradients are non-finite even at a loss scale of 0.5"):
        train_one_epoch(rt, state, model, DiceCELoss(), [batch] * 40, control_for(rt))


def test_temporary_names_differ_between_hosts_with_the_same_pid(monkeypatch, tmp_path):
    """Nodes sharing a cache or output folder on a network file system never write the same temporary file."""
    names = set()
    for host in ("node01", "node02"):
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        monkeypatch.setattr(os, "getpid", lambda: 4242)
        name = temp_path(tmp_path / "case_image.npy").name
        assert name.startswith(".case_image.npy.tmp-") and host in name and "4242" in name
        names.add(name)
    assert len(names) == 2
    assert temp_path(tmp_path / "x") != temp_path(tmp_path / "x"), "a random token separates threads too"


def test_stitched_logits_that_would_not_fit_on_the_gpu_go_to_the_host(monkeypatch):
    from unet3d.inference.sliding_window import accumulator_device, volume_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    voxels = 512 * 512 * 600  # a CT with 14 classes
    assert volume_bytes(14, voxels, tta=False) == 29 * voxels * 4  # logits, weights, softmax: 18 GB
    assert volume_bytes(14, voxels, tta=True) == 43 * voxels * 4  # and the sum and a mirrored copy: 27 GB
    assert accumulator_device(GPU, volume_bytes(14, voxels, tta=False)) == CPU
    assert accumulator_device(GPU, 2**30) == GPU
    assert accumulator_device(GPU, 5 * 2**30) == CPU, "half of what the GPU can give, not all of it"
    assert accumulator_device(CPU, volume_bytes(14, voxels, tta=False)) == CPU, "on the CPU there is nowhere else"
    # after a training epoch the caching allocator holds 40 GB of blocks the driver counts as used: reusable
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 44 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 2**30)
    assert accumulator_device(GPU, 5 * 2**30) == GPU
    assert accumulator_device(GPU, volume_bytes(14, voxels, tta=True)) == CPU  # 27 GB > half of 48


def test_cuda_step_times_are_read_only_once_the_gpu_has_reached_them(monkeypatch):
    """CUDA's elapsed time raises while an event is pending: at the epoch's end the last step's kernels may still
    run, so the clock waits for the later event before reading (stub events that keep CUDA's rule)."""
    from unet3d.training.timing import _Clock

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.done, self.at = False, None

        def record(self) -> None:
            self.at = len(recorded)
            recorded.append(self)

        def synchronize(self) -> None:  # waits for this event and for everything recorded before it
            for event in recorded[: self.at + 1]:
                event.done = True

        def elapsed_time(self, end: Event) -> float:
            if not (self.done and end.done):
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            return 1000.0 * (end.at - self.at)

    recorded: list[Event] = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = _Clock(GPU)
    start, end = clock.mark(), clock.mark()
    assert clock.seconds(start, end) == 1.0


def _trained_state(rt, model: UNet3D) -> dict:
    """The checkpoint of `model` after one optimizer step (its moments or momentum buffers exist)."""
    state = state_for(rt, model)
    x = torch.randn(1, 1, 8, 8, 8).contiguous(memory_format=rt.memory_format)
    model(x).square().mean().backward()
    state.optimizer.step()
    return state.state_dict(world_size=2, rng_states=[])  # no generator states: none are restored


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_a_resume_into_fused_kernels_puts_the_step_counts_on_the_parameters_device():
    """A checkpoint of AdamW with CPU step counts (written by an fp16 run's foreach kernels, or on the CPU)
    resumed by a run whose groups are fused (bf16 or fp32 on CUDA): the fused kernels take the step counts on
    the weights' device, in float32, and fail with a CPU one. The weights' device is played by `meta`, where a
    step count left on the CPU shows as on a GPU; the run's fused flags are set on its groups as
    `build_optimizer(kernels="fused")` sets them on CUDA."""
    rt = runtime(dist.DistInfo(0, 0, 1, 1, CPU), 1, optimizer="adamw", features=(4, 8))
    checkpoint = _trained_state(rt, UNet3D(1, 3, (4, 8)))
    steps = [s["step"] for s in checkpoint["optimizer"]["state"].values()]
    assert steps and all(s.device == CPU for s in steps)
    resumed = state_for(rt, UNet3D(1, 3, (4, 8)).to("meta"))
    for group in resumed.optimizer.param_groups:
        group.update(fused=True, foreach=None)
    resumed.load(checkpoint, source="adamw.pt", rank=0, world_size=1, warn=lambda message: None)
    for group in resumed.optimizer.param_groups:
        assert group["fused"] is True
        for param in group["params"]:
            step = resumed.optimizer.state[param]["step"]
            assert (step.device, step.dtype) == (param.device, torch.float32)


@pytest.mark.parametrize(("saved", "resumed"), [("channels_last", "contiguous"), ("contiguous", "channels_last")])
def test_a_resume_in_another_memory_format_gives_the_buffers_the_weights_strides(saved, resumed):
    """--memory-format may change on resume; the fused CUDA kernels require momentum buffers with the weights'
    strides (the CPU kernels do not check), and a loaded buffer keeps the strides it was saved with."""
    formats = {"channels_last": torch.channels_last_3d, "contiguous": CF}
    rt = runtime(dist.DistInfo(0, 0, 1, 1, CPU), 1, features=(4, 8))
    runs = {name: dataclasses.replace(rt, memory_format=formats[name]) for name in (saved, resumed)}
    torch.manual_seed(0)
    checkpoint = _trained_state(runs[saved], amp.apply_memory_format(UNet3D(1, 3, (4, 8)), formats[saved]))
    state = state_for(runs[resumed], amp.apply_memory_format(UNet3D(1, 3, (4, 8)), formats[resumed]))
    state.load(checkpoint, source="other_format.pt", rank=0, world_size=1, warn=print)
    five_d = [p for p in state.model.parameters() if p.dim() == 5 and p.shape[-1] > 1]
    assert five_d and any(p.stride() != torch.empty(p.shape).stride() for p in five_d) == (resumed != "contiguous")
    saved_state = checkpoint["optimizer"]["state"]
    for index, param in enumerate(state.model.parameters()):
        buffer = state.optimizer.state[param]["momentum_buffer"]
        assert buffer.stride() == param.stride(), index
        torch.testing.assert_close(buffer, saved_state[index]["momentum_buffer"])


def test_ranks_that_resolve_another_precision_are_refused():
    """V100s beside A100s: `--amp auto` is fp16 with loss scaling on some ranks, bf16 on the others."""
    from unet3d.training.runtime import check_same_precision

    same = [(f"node{i}, cuda:0 = NVIDIA A100", "torch.bfloat16", "contiguous", None) for i in range(4)]
    assert check_same_precision("auto", same) is None
    mixed = [*same[:3], ("node3, cuda:0 = Tesla V100-SXM2-32GB", "torch.float16", "contiguous", None)]
    with pytest.raises(
        ValueError,
        match=r"--amp auto resolved differently on the ranks \(.*rank 3 \(node3, cuda:0 = "
        r"Tesla V100-SXM2-32GB\): torch.float16, contiguous\): they must train in one precision",
    ):
        check_same_precision("auto", mixed)
    layouts = [same[0], (same[1][0], "torch.bfloat16", "channels_last", None)]
    with pytest.raises(ValueError, match="give --amp fp16 \\(or off\\) and --memory-format"):
        check_same_precision("auto", layouts)


def _bf16_refused_on_rank_1(info, out: Path) -> None:
    """Rank 1 stands for a V100 beside rank 0's A100: `--amp bf16` is refused there alone."""
    from unet3d.training import runtime as rt_module

    if info.rank == 1:
        fake_gpu(pytest.MonkeyPatch(), (7, 0))
        real = rt_module.resolve_amp
        rt_module.resolve_amp = lambda mode, device: real(mode, GPU)  # the refusal a V100 gives
    try:
        rt_module.agree_on_precision("bf16", "contiguous", CPU)
        verdict = "accepted"
    except ValueError as e:
        verdict = f"ValueError: {e}"
    (out / f"rank{info.rank}.txt").write_text(verdict)


def test_a_precision_refused_on_some_ranks_is_refused_on_every_rank(tmp_path):
    """`--amp bf16` on a job of A100s and V100s: the V100 ranks refuse it. Were they to raise before the
    ranks compare their precisions, the A100 ranks would wait in that gather until the collective timeout;
    every rank must end with the same refusal instead."""
    spawn_ranks(_bf16_refused_on_rank_1, 2, tmp_path, timeout=60)
    verdicts = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert verdicts[0] == verdicts[1], verdicts
    assert (
        verdicts[0].startswith("ValueError: rank 1 (")
        and "Tesla V100-SXM2-32GB (compute capability 7.0) has no" in verdicts[0]
    )
    assert "bf16 tensor cores" in verdicts[0] and "use --amp fp16" in verdicts[0]


def test_probabilities_go_back_to_a_fine_scans_grid_on_the_host_when_it_would_not_fit(monkeypatch):
    """A 0.7 mm CT planned at 1.5 mm: its logits fit on the GPU, its own grid's resampling buffers (ten times
    the voxels) do not; evaluation and validation take the probabilities to the host for that step."""
    from unet3d.inference.sliding_window import RESAMPLE_BYTES_PER_VOXEL, accumulator_device, resampling_device

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * 2**30, 16 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    planned, native = 240 * 240 * 256, 512 * 512 * 600
    assert accumulator_device(GPU, 4 * 3 * planned * 4) == GPU, "the planned volume's logits fit"
    assert RESAMPLE_BYTES_PER_VOXEL * native > 2 * 2**30 and resampling_device(GPU, native) == CPU
    assert resampling_device(GPU, planned) == GPU and resampling_device(CPU, native) == CPU


def test_the_agents_preflight_on_gpus_makes_no_cuda_context(monkeypatch, tmp_path, tiny_dataset, capsys):
    """launch.sh's one process per node checks the job and then stays on as torchrun's agent for the whole job:
    a CUDA context made by the pre-flight would hold memory on the first GPU until the job ends. With GPUs
    seen (NVML's count, stubbed) the real pre-flight plans for cuda, and every call that would start CUDA
    fails the test."""
    import torch.distributed.run

    import train_ddp
    from unet3d.training.agent import run_agent

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def touched(*args, **kwargs):
        raise AssertionError("the pre-flight started CUDA")

    for name in ("_lazy_init", "init", "get_device_capability", "get_device_name", "get_device_properties",
                 "mem_get_info", "set_device", "synchronize", "is_bf16_supported"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, touched)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", touched, raising=False)
    monkeypatch.setenv("UNET3D_EXPECT_CUDA", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    monkeypatch.setenv("UNET3D_STOP_FILE", str(tmp_path / "stop"))
    started = []
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: started.append(argv))
    args = ["--data-dir", str(tiny_dataset), "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "o")]
    argv = ["--standalone", "--nproc-per-node", "2", "train_ddp.py", *args, "--val-fraction", "0.34"]
    assert run_agent(argv, train_ddp.main) == 0
    assert started == [argv] and (tmp_path / "stop.agent").exists()
    assert any((tmp_path / "cache").rglob("*.npy")), "the pre-flight ran, and built the cache"
    assert "levels of [32, 64, 128] channels" in capsys.readouterr().out, "planned with the GPUs' widths"
