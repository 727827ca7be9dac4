"""DDP equivalence: two gloo ranks with half a batch each take the same step as one process with all of it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import spawn_ranks
from unet3d import UNet3D, dist
from unet3d.amp import grad_scaler
from unet3d.engine import train_one_epoch
from unet3d.loss import DiceCELoss
from unet3d.optim import build_optimizer, build_schedule

BATCH = 4


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    label = torch.randint(0, 3, (BATCH, 16, 16, 8), generator=g, dtype=torch.uint8)
    image = label[:, None].float() + torch.randn(BATCH, 1, 16, 16, 8, generator=g)
    return image, label


def one_step(info: dist.DistInfo, out: Path) -> None:
    """One real training step (train_one_epoch) on this rank's share of the batch; rank 0 saves weights."""
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8, 16))
    wrapped = DDP(model) if dist.is_dist() else model
    optimizer = build_optimizer(model.parameters(), "sgd", lr=0.1, weight_decay=3e-5)
    image, label = make_batch()
    share = BATCH // info.world_size
    mine = slice(info.rank * share, (info.rank + 1) * share)
    stats = train_one_epoch(
        wrapped,
        [(image[mine], label[mine])],
        1,
        DiceCELoss(),
        optimizer,
        build_schedule(optimizer, "sgd"),
        grad_scaler(info.device, None),
        None,
        info.device,
        epoch=0,
        epochs=1,
    )
    if info.is_main:
        torch.save({"model": model.state_dict(), "loss": stats.loss, "samples": stats.samples}, out)


def test_two_ranks_half_batch_equal_one_process_whole_batch(tmp_path, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    single = tmp_path / "single.pt"
    one_step(dist.setup(), single)
    spawn_ranks(one_step, 2, tmp_path / "ddp.pt")
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


def test_half_batch_alone_differs(tmp_path, monkeypatch):
    """Control: without DDP's gradient averaging, half the batch gives other weights."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    one_step(dist.setup(), tmp_path / "single.pt")
    info = dist.DistInfo(0, 0, 2, 2, torch.device("cpu"))
    one_step(info, tmp_path / "half.pt")
    a = torch.load(tmp_path / "single.pt", map_location="cpu", weights_only=True)["model"]
    b = torch.load(tmp_path / "half.pt", map_location="cpu", weights_only=True)["model"]
    assert any(not torch.allclose(a[k], b[k], atol=1e-6) for k in a)
