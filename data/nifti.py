"""Reading NIfTI volumes into channel-first arrays."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from data.geometry import same_grid, spacing_of

LABEL_ROUNDING = 1e-3  # a float label may miss its integer by rounding (a scaled header), not by more


def load_image(path: str | Path) -> tuple[np.ndarray, nib.Nifti1Image]:
    """A 3D or 4D NIfTI image -> (float32 array (C, X, Y, Z), the nibabel image for affine and header).

    MSD stores several modalities as a 4D volume with the channel last; it is moved to the front. ITK and
    SimpleITK write a multi-component image as 5D (X, Y, Z, 1, C), the NIfTI standard's place for vector
    components: its empty time axis is dropped.
    """
    img = _load(path)
    data = _voxels(img, path, np.float32)
    if data.ndim == 5 and data.shape[3] == 1:
        data = data[:, :, :, 0]
    if data.ndim == 3:
        data = data[None]
    elif data.ndim == 4:
        data = np.moveaxis(data, -1, 0)
    else:
        raise ValueError(f"{path}: expected a 3D or 4D image, got shape {data.shape}")
    return np.ascontiguousarray(data), img


def load_label(path: str | Path, onto: nib.Nifti1Image | None = None) -> tuple[np.ndarray, nib.Nifti1Image]:
    """A 3D NIfTI label map of integers (stored as integers or floats) -> (uint8 array (X, Y, Z), the nibabel image).

    `onto`: the label's image. A label on that image's grid whose voxels are stored in another order (axes
    flipped or permuted: a tool that wrote it in RAS beside an LPS scan) is brought into the image's order,
    losslessly, with the affine to match; any other label is returned as stored, for `label_problems` to judge.
    """
    label, img = _read_label(path)
    return (label, img) if onto is None else _in_order_of(label, img, onto)


def _in_order_of(label: np.ndarray, img: nib.Nifti1Image, onto: nib.Nifti1Image) -> tuple[np.ndarray, nib.Nifti1Image]:
    shape = tuple(onto.shape[:3])
    if label.shape == shape and same_grid(img.affine, onto.affine):
        return label, img
    orientations = nib.orientations
    try:
        transform = orientations.ornt_transform(
            orientations.io_orientation(img.affine), orientations.io_orientation(onto.affine)
        )
    except ValueError:  # a singular affine: no order to bring it into
        return label, img
    moved = orientations.apply_orientation(label, transform)
    affine = img.affine @ orientations.inv_ornt_aff(transform, label.shape)
    if moved.shape != shape or not same_grid(affine, onto.affine):
        return label, img
    moved = np.ascontiguousarray(moved)
    return moved, nib.Nifti1Image(moved, affine, img.header)


def _read_label(path: str | Path) -> tuple[np.ndarray, nib.Nifti1Image]:
    img = _load(path)
    data = _voxels(img, path)
    while data.ndim > 3 and data.shape[-1] == 1:  # (X, Y, Z, 1) or ITK's (X, Y, Z, 1, 1)
        data = data[..., 0]
    if data.ndim != 3:
        raise ValueError(f"{path}: expected a 3D label map, got shape {data.shape}")
    if data.dtype.kind in "iub":  # integers as stored: nothing to round (and no float copy of a CT-sized map)
        rounded = data
    else:
        if not np.isfinite(data).all():
            raise ValueError(f"{path}: label map holds NaN or infinite values")
        rounded = np.rint(data)
        off = np.abs(data - rounded) > LABEL_ROUNDING
        if off.any():
            raise ValueError(
                f"{path}: label map holds {int(off.sum())} non-integer value(s), e.g. {float(data[off][0]):g} (was it "
                "resampled with interpolation? labels need nearest neighbour)"
            )
        del off
    if rounded.min() < 0 or rounded.max() > 255:
        raise ValueError(f"{path}: label values must lie in 0..255, got {rounded.min()}..{rounded.max()}")
    return rounded.astype(np.uint8), img


def _load(path: str | Path) -> nib.Nifti1Image:
    try:
        return nib.load(str(path))
    except FileNotFoundError:
        raise
    except Exception as e:  # nibabel raises many kinds for a damaged file
        raise ValueError(f"{path}: cannot read as NIfTI ({type(e).__name__}: {e})") from e


def _voxels(img: nib.Nifti1Image, path: str | Path, dtype=None) -> np.ndarray:
    """The voxels of `img`, read now: a file whose header reads but whose data is truncated or corrupt (an
    interrupted copy or download) raises ValueError naming it, as a damaged header does."""
    try:
        return np.asarray(img.dataobj, dtype=dtype)
    except MemoryError:
        raise
    except Exception as e:  # EOFError (truncated gzip), zlib.error (corrupt stream), OSError, ValueError (short .nii)
        raise ValueError(f"{path}: cannot read its voxels ({type(e).__name__}: {e}); is the file complete?") from e


def records_orientation(img: nib.Nifti1Image) -> bool:
    """Whether the header places the voxels in the scanner's space (a qform or sform code above 0); without
    either, nibabel's affine is a guess (the voxel sizes, x flipped as the old Analyze format stored it)."""
    try:
        return int(img.header["qform_code"]) > 0 or int(img.header["sform_code"]) > 0
    except (KeyError, TypeError, ValueError):  # a header without the codes: nothing to tell
        return True


def spacing(img: nib.Nifti1Image) -> tuple[float, float, float]:
    """Voxel size in millimetres along the three spatial axes, from the affine that places the voxels (the
    sform, else the qform, as nibabel chooses): the one preprocessing resamples by, which the header's pixdim
    can contradict when a tool rewrote only the sform."""
    return spacing_of(img.affine)
