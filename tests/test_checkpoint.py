from __future__ import annotations

import ast
import errno
import json
import os
import resource
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import spawn_ranks
from unet3d import UNet3D
from unet3d.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, strip_wrapper_prefixes
from unet3d.files import out_of_room
from unet3d.training import dist
from unet3d.training.checkpointing import LAST, PREVIOUS, checkpoint_dir, find_resume

REPO = Path(__file__).resolve().parents[1]


class HasModuleChild(nn.Module):
    """A model whose own parameter names begin with "module"."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.module_b = nn.Linear(2, 1)


def test_strips_only_real_prefixes():
    sd = UNet3D(1, 2, (2, 4)).state_dict()
    for prefix in ("", "module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."):
        wrapped = {prefix + k: v for k, v in sd.items()}
        assert list(strip_wrapper_prefixes(wrapped)) == list(sd)
    own = HasModuleChild().state_dict()
    assert list(strip_wrapper_prefixes(own)) == list(own), "names starting with 'module' are not prefixes"
    ddp_own = {"module." + k: v for k, v in own.items()}
    assert list(strip_wrapper_prefixes(ddp_own)) == list(own)


def test_expected_keys_settle_ambiguity():
    only = nn.Sequential()
    only.module = nn.Linear(2, 2)  # every key of the bare model starts with "module."
    sd = only.state_dict()
    assert list(strip_wrapper_prefixes(sd, expected_keys=sd.keys())) == list(sd)
    assert list(strip_wrapper_prefixes({"module." + k: v for k, v in sd.items()}, sd.keys())) == list(sd)


def test_save_is_atomic_and_load_maps_to_device(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    save_checkpoint({"model": {"w": torch.ones(3)}, "epoch": 1}, path)
    save_checkpoint({"model": {"w": torch.zeros(3)}, "epoch": 2}, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]
    state = load_checkpoint(path, "cpu")
    assert state["epoch"] == 2 and state["model"]["w"].device.type == "cpu"


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint({"epoch": 2}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert load_checkpoint(path, "cpu")["epoch"] == 1


def test_a_file_size_limit_mid_save_is_a_plain_error_naming_the_file(tmp_path):
    """The kernel's own refusal (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) halfway through torch.save,
    whose zip writer then raises a RuntimeError over it: the error names the errno and the file, the temporary
    file is gone and the checkpoint already there is intact."""
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    try:
        with pytest.raises(OSError) as caught:
            save_checkpoint({"epoch": 2, "w": torch.zeros(1_000_000)}, path)  # 4 MB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught.value.errno == errno.EFBIG and caught.value.filename == str(path)
    assert out_of_room(caught.value) is caught.value
    assert isinstance(caught.value.__cause__, RuntimeError), "torch's zip writer raised over the kernel's error"
    assert out_of_room(caught.value.__cause__).errno == errno.EFBIG, "which is found under it"
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert load_checkpoint(path, "cpu")["epoch"] == 1
    assert out_of_room(RuntimeError("unexpected pos")) is None and out_of_room(OSError(errno.EACCES, "no")) is None


def test_load_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*evil.pt: Weights only load failed"):
        load_checkpoint(tmp_path / "evil.pt", "cpu")
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        load_checkpoint(tmp_path / "nothing.pt", "cpu")


def test_every_torch_load_passes_map_location_and_weights_only():
    """Source check: a torch.load without map_location would put tensors back on the saving GPU."""
    calls = []
    for path in REPO.rglob("*.py"):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                keywords = {k.arg for k in node.keywords}
                calls.append((path.name, {"map_location", "weights_only"} <= keywords))
    assert calls and all(ok for _, ok in calls), calls


def _write_pair(folder):
    """last.pt and previous.pt as a run leaves them after two epochs."""
    state = {k: {} for k in ("model", "optimizer", "scheduler", "scaler", "config", "model_args")}
    save_checkpoint({**state, "epoch": 1, "best_metric": 0.1}, folder / LAST, previous=folder / PREVIOUS)
    save_checkpoint({**state, "epoch": 2, "best_metric": 0.2}, folder / LAST, previous=folder / PREVIOUS)
    return folder / LAST


@pytest.mark.parametrize("damage", ["truncated", "empty", "byte-flipped"])
def test_unreadable_last_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    last = _write_pair(tmp_path / "checkpoints")
    data = last.read_bytes()
    if damage == "truncated":
        last.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        last.write_bytes(b"")
    else:
        flipped = bytearray(data)
        for i in range(len(flipped) // 3, len(flipped) // 3 + 64):
            flipped[i] ^= 0xFF
        last.write_bytes(bytes(flipped))
    warnings = []
    path, state = find_resume("auto", tmp_path, "cpu", warnings.append)
    assert path.name == "previous.pt" and state["epoch"] == 1
    assert len(warnings) == 1 and str(last) in warnings[0]


def test_unreadable_checkpoints_are_never_silently_ignored(tmp_path):
    last = _write_pair(tmp_path / "checkpoints")
    last.write_bytes(b"junk")
    (tmp_path / "checkpoints" / "previous.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint.*--resume none starts over"):
        find_resume("auto", tmp_path, "cpu", lambda message: None)
    assert find_resume("none", tmp_path, "cpu", lambda message: None) is None
    assert find_resume("auto", tmp_path / "elsewhere", "cpu", lambda message: None) is None
    with pytest.raises(CheckpointError, match=str(last)):
        find_resume(str(last), tmp_path, "cpu", lambda message: None)


def _failing_save(info, folder) -> None:
    """Rank 0's save fails with a full disk; every rank must learn it at once instead of waiting."""

    def full_disk():
        save_checkpoint({"epoch": 1}, folder / "last.pt", previous=folder / "previous.pt")
        original = torch.save

        def partial(obj, f):
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        torch.save = partial
        try:
            save_checkpoint({"epoch": 2}, folder / "last.pt", previous=folder / "previous.pt")
        finally:
            torch.save = original

    began = time.monotonic()
    try:
        dist.run_on_main(full_disk)
        outcome = "saved"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
        room = out_of_room(e)
    (folder / f"rank{info.rank}.json").write_text(
        json.dumps([outcome, time.monotonic() - began, room.errno if room is not None else None])
    )


def test_a_failed_save_leaves_the_last_checkpoint_and_no_rank_waiting(tmp_path):
    spawn_ranks(_failing_save, 2, tmp_path, timeout=60)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert outcomes[0][0] == f"OSError: [Errno 28] No space left on device: '{tmp_path / 'last.pt'}'"
    assert outcomes[1][0].startswith("OSError: rank 0 failed: OSError: [Errno 28]") and outcomes[1][1] < 10
    # every rank decides on the value, not the message: the job ends without a restart on each
    assert [o[2] for o in outcomes] == [errno.ENOSPC, errno.ENOSPC]
    assert load_checkpoint(tmp_path / "last.pt", "cpu")["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == ["last.pt"]


def test_a_resume_at_an_epoch_boundary_names_a_changed_seed_batch_or_epoch_length():
    """Between epochs the batch size, the epoch's length and the seed may change (mid-epoch they are refused):
    each changes what the run trains on, so the warning must name it."""
    import dataclasses

    from unet3d.training.checkpointing import check_compatible
    from unet3d.training.config import TrainConfig

    saved = dataclasses.asdict(TrainConfig(seed=0, batch_size=2, samples_per_epoch=128, epochs=2))
    now = {**saved, "seed": 3, "batch_size": 4, "samples_per_epoch": 64, "epochs": 3, "num_workers": 7}
    args = {"in_channels": 1, "num_classes": 3}
    state = {"config": saved, "model_args": args, "world_size": 2, "step": 0}
    changed = check_compatible(state, now, args, 1, Path("last.pt"))
    assert changed == ["batch_size", "epochs", "samples_per_epoch", "seed"], "num_workers changes without a word"
    with pytest.raises(CheckpointError, match=r"seed \(checkpoint 0, now 3; needed to resume mid-epoch\)"):
        check_compatible({**state, "step": 5}, now, args, 2, Path("last.pt"))


def test_a_resume_names_classes_the_dataset_renamed_and_refuses_another_number_of_them():
    """The same number of classes under other names trains on (the same output channels) with a warning naming
    both lists, as evaluate.py does; another number of classes cannot continue."""
    import dataclasses

    from unet3d.training.checkpointing import check_compatible
    from unet3d.training.config import TrainConfig

    config = dataclasses.asdict(TrainConfig())
    args = {"in_channels": 1, "num_classes": 3}
    state = {"config": config, "model_args": args, "step": 0, "class_names": ["background", "organ", "lesion"]}
    assert check_compatible(state, config, args, 1, Path("last.pt"), ["background", "organ", "lesion"]) == []
    relative = {**state, "config": {**config, "data_dir": "runs/synthetic/x"}}  # as recorded before 2026-12-07
    now = {**config, "data_dir": os.path.abspath("runs/synthetic/x")}
    assert check_compatible(relative, now, args, 1, Path("last.pt")) == [], "the same folder, not a change"
    changed = check_compatible(state, config, args, 1, Path("last.pt"), ["background", "liver", "tumour"])
    assert changed == [
        "class names (checkpoint ['background', 'organ', 'lesion'], now ['background', 'liver', 'tumour'])"
    ]
    with pytest.raises(CheckpointError, match=r"num_classes \(checkpoint 3, now 2\)"):
        check_compatible(state, config, {**args, "num_classes": 2}, 1, Path("last.pt"), ["background", "organ"])


def test_weights_with_nan_or_inf_are_never_written(tmp_path):
    """README: no checkpoint with NaN or infinite weights is ever written; the refusal comes before any
    collective or file, on every rank alike (each checks its own copy of the same weights)."""
    from types import SimpleNamespace

    from unet3d.training.checkpointing import save_checkpoints
    from unet3d.training.control import TrainingError

    for bad in (float("nan"), float("inf")):
        model = UNet3D(1, 2, (4, 8))
        with torch.no_grad():
            next(model.parameters())[0].view(-1)[0] = bad
        rt = SimpleNamespace(out_dir=tmp_path, device=torch.device("cpu"))
        with pytest.raises(TrainingError, match="the weights hold NaN or inf values: refusing to write a checkpoint"):
            save_checkpoints(rt, SimpleNamespace(model=model), is_best=True)
    assert not list(tmp_path.rglob("*.pt"))


def test_trained_steps_of_a_checkpoint_from_before_they_were_counted():
    """TensorBoard numbers steps across runs by `trained_steps`; a checkpoint without it had its epochs at its
    own steps per epoch (samples / (batch x world size)), whatever the resumed run's are."""
    from unet3d.training.state import trained_steps

    old = {"epoch": 3, "config": {"samples_per_epoch": 64, "batch_size": 2}, "world_size": 2}
    assert trained_steps(old) == 48
    assert trained_steps({**old, "trained_steps": 50}) == 50
    assert trained_steps({"epoch": 2, "config": {}}) == 0, "format 1 without the fields: from 0, no crash"


def test_resume_path_is_left_for_the_runs_own_checkpoint_once_it_has_trained_on_from_it(tmp_path):
    """`--resume other/best.pt --out-dir OUT`: the first start loads PATH. A torchrun restart, or the same
    command after a stop, went back to PATH and trained its epochs again; OUT's last.pt records that it started
    from PATH (`resumed_from`), and continues instead. A last.pt of another start still yields to PATH."""
    state = {k: {} for k in ("model", "optimizer", "scheduler", "scaler", "config", "model_args")}
    other = tmp_path / "other" / "checkpoints" / "best.pt"
    save_checkpoint({**state, "epoch": 2, "best_metric": 0.5}, other)
    out = tmp_path / "out"
    warnings: list[str] = []
    assert find_resume(str(other), out, "cpu", warnings.append)[0] == other, "a fresh folder: PATH"
    own = checkpoint_dir(out) / LAST
    save_checkpoint({**state, "epoch": 3, "best_metric": 0.1, "resumed_from": str(other.resolve())}, own)
    path, found = find_resume(str(other), out, "cpu", warnings.append)
    assert path == own and found["epoch"] == 3
    assert warnings == [f"--resume {other}: continuing from {own}, this run's own, which trained on from it"]
    save_checkpoint({**state, "epoch": 3, "best_metric": 0.1, "resumed_from": None}, own)
    assert find_resume(str(other), out, "cpu", warnings.append)[0] == other, "not started from PATH: PATH"


def test_a_resume_from_another_folder_chooses_best_pt_afresh_and_records_where_it_started(tmp_path):
    """That run's best Dice (say 0.9, on its own validation) kept this folder from ever writing best.pt, while
    the closing words named a best.pt that did not exist."""
    from tests.helpers import runtime, state_for
    from unet3d.training.checkpointing import resume
    from unet3d.training.report import closing_words

    info = dist.DistInfo(0, 0, 1, 1, torch.device("cpu"))
    rt = runtime(info, 2, out_dir=str(tmp_path / "new"))
    torch.manual_seed(0)
    state = state_for(rt, UNet3D(1, 3, (4, 8)))
    state.epoch, state.best_metric = 2, 0.9
    source = tmp_path / "old" / "checkpoints" / "best.pt"
    save_checkpoint(state.state_dict(world_size=1, rng_states=[]), source)
    checkpoint = load_checkpoint(source, "cpu")
    for resume_option, best in ((str(source), -float("inf")), ("auto", 0.9)):
        rt = runtime(info, 2, out_dir=str(tmp_path / "new"), resume=resume_option)
        fresh = state_for(rt, UNet3D(1, 3, (4, 8)))
        resume(rt, fresh, checkpoint, source)
        assert fresh.epoch == 2 and fresh.best_metric == best, resume_option
    assert fresh.resumed_from is None, "auto: the checkpoint's own record (it had none)"
    rt = runtime(info, 2, out_dir=str(tmp_path / "new"), resume=str(source))
    fresh = state_for(rt, UNet3D(1, 3, (4, 8)))
    resume(rt, fresh, checkpoint, source)
    assert fresh.resumed_from == str(source.resolve())
    assert fresh.state_dict(world_size=1, rng_states=[])["resumed_from"] == str(source.resolve())
    fresh.best_metric = 0.7  # recorded, but no best.pt in this folder
    assert "best mean Dice" not in closing_words(rt, fresh, None)


def test_a_resume_applies_this_runs_lr_momentum_and_weight_decay(tmp_path):
    """load_state_dict put the checkpoint's hyperparameters back: a resume with --lr 0.1 trained on at the old
    rate while the warning named lr as changed."""
    from tests.helpers import runtime, state_for

    info = dist.DistInfo(0, 0, 1, 1, torch.device("cpu"))
    torch.manual_seed(0)
    old = state_for(runtime(info, 2, lr=0.01, momentum=0.9, weight_decay=3e-5), UNet3D(1, 3, (4, 8)))
    old.schedule.set_progress(0.5)
    checkpoint = old.state_dict(world_size=1, rng_states=[])
    new = state_for(runtime(info, 2, lr=0.1, momentum=0.5, weight_decay=0.01), UNet3D(1, 3, (4, 8)))
    new.load(checkpoint, source="c.pt", rank=0, world_size=1, warn=lambda m: None)
    group = new.optimizer.param_groups[0]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 0.01) and new.schedule.base_lrs == [0.1]
    assert group["lr"] == pytest.approx(0.1 * 0.5**0.9), "the new rate at the checkpoint's progress"


def test_the_optimizer_cannot_change_on_resume():
    """SGD's state failed to load into AdamW ('step'), AdamW's in SGD at the first step ('momentum')."""
    import dataclasses

    from unet3d.training.checkpointing import check_compatible
    from unet3d.training.config import TrainConfig

    saved = dataclasses.asdict(TrainConfig(optimizer="sgd"))
    args = {"in_channels": 1, "num_classes": 3}
    state = {"config": saved, "model_args": args, "world_size": 1, "step": 0}
    with pytest.raises(CheckpointError, match=r"optimizer \(checkpoint sgd, now adamw\)"):
        check_compatible(state, {**saved, "optimizer": "adamw"}, args, 1, Path("last.pt"))


def test_best_pt_is_written_before_last_pt(tmp_path, monkeypatch):
    """A crash between the two left a last.pt carrying the new best_metric beside an older best.pt, which later
    epochs, compared with that best_metric, never replaced."""
    from types import SimpleNamespace

    from unet3d.training import checkpointing

    written = []
    monkeypatch.setattr(checkpointing, "save_checkpoint", lambda state, path, previous=None: written.append(path.name))
    state = SimpleNamespace(model=UNet3D(1, 2, (4, 8)), state_dict=lambda **kwargs: {})
    rt = SimpleNamespace(out_dir=tmp_path, device=torch.device("cpu"), world_size=1)
    checkpointing.save_checkpoints(rt, state, is_best=True)
    assert written == ["best.pt", "last.pt"]


def test_an_unreadable_last_pt_passed_over_is_kept_aside_not_made_previous_pt(tmp_path):
    from unet3d.training.checkpointing import resume_source
    from unet3d.training.config import TrainConfig

    last = _write_pair(tmp_path / "checkpoints")
    last.write_bytes(b"junk")
    assert resume_source(TrainConfig(out_dir=str(tmp_path))) == str(tmp_path / "checkpoints" / PREVIOUS)
    assert (tmp_path / "checkpoints" / "last.pt.unreadable").read_bytes() == b"junk" and not last.exists()


def test_resume_none_into_a_folder_with_checkpoints_says_they_will_be_replaced(tmp_path, caplog):
    import logging

    from unet3d.training.checkpointing import resume_source
    from unet3d.training.config import TrainConfig

    _write_pair(tmp_path / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="unet3d"):
        assert resume_source(TrainConfig(out_dir=str(tmp_path), resume="none")) is None
    assert "--resume none: starting over; this run's checkpoints will replace those in" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unet3d"):
        assert resume_source(TrainConfig(out_dir=str(tmp_path / "empty"), resume="none")) is None
    assert "starting over" not in caplog.text


def test_temporary_files_of_writers_killed_on_this_host_are_removed_by_the_next_writer(tmp_path):
    """A signal's default action runs no `finally`: a pre-flight killed while it wrote the synthetic dataset
    left its hidden folder, a rank killed mid-save its half-written checkpoint. The next writer of the same
    path removes those of dead processes of this host, never a live one's or another host's."""
    import socket
    import subprocess
    import sys

    from data.synthetic import write_synthetic_dataset

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, gone = socket.gethostname(), int(dead.stdout)
    root = tmp_path / "syn"
    stale = tmp_path / f".syn.tmp-{host}-{gone}-abcd1234"
    (stale / "imagesTr").mkdir(parents=True)
    live = tmp_path / f".syn.tmp-{host}-{os.getpid()}-abcd1234"
    elsewhere = tmp_path / f".syn.tmp-othernode-{gone}-abcd1234"
    live.mkdir()
    elsewhere.mkdir()
    young = tmp_path / f".syn.tmp-{host}-{gone}-00000000"  # a minute old at the most: perhaps still written
    young.mkdir()
    dashed = tmp_path / f".syn.tmp-{host}-7-{gone}-00000001"  # host "{host}-7" on a shared file system
    writing = tmp_path / f".syn.tmp-{host}-{gone}-00000002"  # an old folder, but a file in it written now
    (writing / "imagesTr").mkdir(parents=True)
    (writing / "imagesTr" / "case.nii.gz").write_bytes(b"now")
    dashed.mkdir()
    for old in (stale, stale / "imagesTr", live, elsewhere, dashed, writing, writing / "imagesTr"):
        os.utime(old, (time.time() - 3600, time.time() - 3600))
    write_synthetic_dataset(root, num_cases=2, size=8, seed=0, num_test=0)
    assert (root / "dataset.json").is_file() and not stale.exists() and live.exists() and elsewhere.exists()
    assert young.exists() and dashed.exists() and writing.exists()
    half = tmp_path / "checkpoints" / f".last.pt.tmp-{host}-{gone}-ffff0000"
    half.parent.mkdir()
    half.write_bytes(b"half a checkpoint")
    os.utime(half, (time.time() - 3600, time.time() - 3600))
    save_checkpoint({"epoch": 1}, tmp_path / "checkpoints" / "last.pt")
    assert not half.exists() and sorted(p.name for p in half.parent.iterdir()) == ["last.pt"]


def test_resume_naming_the_runs_own_previous_pt_leaves_a_readable_last_pt_alone(tmp_path):
    from unet3d.training.checkpointing import resume_source
    from unet3d.training.config import TrainConfig

    last = _write_pair(tmp_path / "checkpoints")
    previous = tmp_path / "checkpoints" / PREVIOUS
    assert resume_source(TrainConfig(out_dir=str(tmp_path), resume=str(previous))) == str(previous)
    assert last.exists() and not (tmp_path / "checkpoints" / "last.pt.unreadable").exists()
