"""MONAI's DDP tutorial recipe, as the reference of benchmarks/quality.py: run under torchrun.

    torchrun --standalone --nproc-per-node 2 benchmarks/monai_recipe.py --data-dir D --time-limit 240 --out O

UNet (16, 32, 64, 128, 256) with two residual units per level, 64^3 patches drawn by RandCropByPosNegLabeld
(foreground and background alike), flips and intensity scaling and shifting, Adam at 1e-3, Dice + cross-
entropy, DistributedSampler over cached cases; trained until the wall-clock budget (counted from this
script's start, its caching included) ends, every rank stopping after the same step. Rank 0 then predicts
the test cases with MONAI's sliding window and writes their Dice per class to O/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

STARTED = time.time()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--time-limit", type=float, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from monai.data import CacheDataset, DataLoader, partition_dataset
    from monai.inferers import sliding_window_inference
    from monai.losses import DiceCELoss
    from monai.networks.nets import UNet
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        LoadImaged,
        NormalizeIntensityd,
        Orientationd,
        RandCropByPosNegLabeld,
        RandFlipd,
        RandScaleIntensityd,
        RandShiftIntensityd,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    root = Path(args.data_dir)
    meta = json.loads((root / "dataset.json").read_text())
    files = [{"image": str(root / e["image"]), "label": str(root / e["label"])} for e in meta["training"]]
    keys = ("image", "label")
    base = [LoadImaged(keys), EnsureChannelFirstd(keys), Orientationd(keys, axcodes="RAS"),
            NormalizeIntensityd("image", nonzero=True, channel_wise=True)]  # fmt: skip
    train_transforms = Compose(
        [
            *base,
            RandCropByPosNegLabeld(keys, "label", spatial_size=(64, 64, 64), pos=1, neg=1, num_samples=2),
            RandFlipd(keys, prob=0.5, spatial_axis=0),
            RandFlipd(keys, prob=0.5, spatial_axis=1),
            RandFlipd(keys, prob=0.5, spatial_axis=2),
            RandScaleIntensityd("image", factors=0.1, prob=1.0),
            RandShiftIntensityd("image", offsets=0.1, prob=1.0),
        ]
    )
    mine = partition_dataset(files, num_partitions=world, shuffle=True, even_divisible=True, seed=0)[rank]
    dataset = CacheDataset(mine, train_transforms, cache_rate=1.0, num_workers=1, progress=False)
    loader = DataLoader(dataset, batch_size=1, shuffle=True, num_workers=1)
    classes = len(meta["labels"])
    model = UNet(3, 1, classes, channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2)
    model = torch.nn.parallel.DistributedDataParallel(model)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    steps, stop = 0, False
    while not stop:
        for batch in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            optimizer.step()
            steps += 1
            flag = torch.tensor([float(time.time() - STARTED > args.time_limit - 15)])  # room to predict
            dist.all_reduce(flag)
            if flag.item() > 0:
                stop = True
                break
    if rank == 0:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from unet3d.inference.metrics import confusion_counts, dice_from_counts

        test = Compose(base)
        scores = []
        model.module.eval()
        with torch.no_grad():
            for rel in meta["test"]:
                name = Path(rel).name
                case = test({"image": str(root / rel), "label": str(root / "labelsTs" / name)})
                logits = sliding_window_inference(case["image"][None], (64, 64, 64), 2, model.module, overlap=0.5)
                pred = logits[0].argmax(0)
                ref = torch.as_tensor(np.asarray(case["label"][0]), dtype=torch.long)
                scores.append(dice_from_counts(confusion_counts(pred, ref, classes))[1:].tolist())
        names = [meta["labels"][str(k)] for k in range(1, classes)]
        per_class = dict(zip(names, np.mean(scores, axis=0).tolist()))
        result = {"per_class": per_class, "mean_dice": float(np.mean(list(per_class.values()))), "steps": steps}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
