"""3D U-Net segmentation trained with DistributedDataParallel."""

from unet3d.loss import DiceCELoss, DiceLoss
from unet3d.model import UNet3D

__all__ = ["DiceCELoss", "DiceLoss", "UNet3D"]
