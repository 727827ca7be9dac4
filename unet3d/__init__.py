"""3D U-Net segmentation trained with DistributedDataParallel.

At the face, the network and its losses (`UNet3D`, `DiceLoss`, `DiceCELoss`); beside them what training
and inference both use: `precision` (--amp, --memory-format), `checkpoint` (checkpoint files: safe
loads, wrapper prefixes, weights into a model) and `files` (atomic writes). The distributed training
runtime is `unet3d.training`, inference and metrics are `unet3d.inference`.
"""

from unet3d.loss import DiceCELoss, DiceLoss
from unet3d.model import UNet3D

__all__ = ["DiceCELoss", "DiceLoss", "UNet3D"]
