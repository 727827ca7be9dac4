from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from unet3d import UNet3D
from unet3d.checkpoint import load_checkpoint, save_checkpoint, strip_wrapper_prefixes

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


def test_load_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
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
