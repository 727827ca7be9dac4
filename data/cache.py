"""The preprocessing cache: each case checked and fingerprinted once, then brought into the plan's space once
into uncompressed .npy files.

Training opens them as read-only memory maps, so every rank and DataLoader worker on a machine shares one
copy through the page cache instead of decompressing NIfTI or holding its own arrays. A case is redone when
its source files change (size, mtime, or the bytes at either end: a copy over a file that kept its size and
mtime is still seen), when the plan's preprocessing changes (each plan has its own folder, named by its digest), or
when the cache format changes.

Files are named KEY = NAME-<hash of the image's and label's paths>, so that datasets sharing a --cache-dir (a
corrected copy of the labels, say) never read or overwrite each other's cases. Under CACHE_ROOT:
fingerprints/<orientation>-<crop>/KEY.json (what planning needs of the case), and per plan <digest>/
KEY_image.npy (C, X, Y, Z) float32, KEY_label.npy (X, Y, Z) uint8, KEY_fg.npy (N, 4) int32 rows of (class, x,
y, z), KEY_native.npy (the label on the file's own grid, for validation), KEY_share.npy (2, X, Y, Z) uint8
(each voxel's runner-up class and its share: the soft targets, `data.patches`) and KEY.json, written last,
which marks the case complete and holds its geometry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data.check import case_problems
from data.geometry import Geometry
from data.msd import Case, DatasetSpec
from data.nifti import load_image, load_label, records_orientation
from data.patches import PreparedCase, foreground_coords
from data.plan import Fingerprint, Plan, PlanRequest, fingerprint_arrays
from data.preprocess import preprocess
from unet3d.files import atomic_write, atomic_write_text, out_of_room

CACHE_VERSION = 6  # 4: fingerprints measure the shape before the crop (the masked z-score's rule); 5: and the
# labelled voxels the crop removes; 6: NAME_share.npy, the soft targets
DIGEST_BYTES = 4096  # read from each end of a source file for its stamp
# 2: the obliquity; 3: whether the header records an orientation (a change here re-reads the images, not the
# planned cache)
FINGERPRINT_VERSION = 3


def _sources(case: Case) -> list:
    """What tells a changed source file: its size, its mtime, and a digest of its first and last bytes, for a
    copy over it that kept both (`cp -p`, `rsync -a`, an archive unpacked). A .nii.gz ends with the CRC-32 of
    its whole content; a .nii's header and last voxels are in the digest. Nothing here depends on the file
    system, so nodes with their own copies of a dataset at one path share a cache."""
    found = []
    for path in (case.image, case.label):
        st = path.stat()
        found.append([str(path), st.st_size, st.st_mtime_ns, _ends_digest(path, st.st_size)])
    return found


def _ends_digest(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        head = f.read(DIGEST_BYTES)
        f.seek(max(0, size - DIGEST_BYTES))
        tail = f.read(DIGEST_BYTES)
    return hashlib.sha1(head + tail).hexdigest()[:16]


def _key(case: Case) -> str:
    """The case's file name in the cache: its name and a hash of where its files are."""
    where = f"{case.image.resolve()}\n{case.label.resolve()}".encode()
    return f"{case.name}-{hashlib.sha1(where).hexdigest()[:10]}"


def _fingerprint_file(root: Path, case: Case, request: PlanRequest) -> Path:
    return root / "fingerprints" / f"{request.orientation}-{request.crop}" / f"{_key(case)}.json"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fingerprint_cases(
    cases: Sequence[Case], spec: DatasetSpec, request: PlanRequest, root: Path, shard: int, num_shards: int
) -> list[str]:
    """Check and fingerprint the cases of shard `shard` of `num_shards` that have no fresh fingerprint file.

    Returns one message per problem (empty when all went well), so the caller can gather every rank's
    problems and report them together.
    """
    errors = []
    for case in list(cases)[shard::num_shards]:
        path = _fingerprint_file(root, case, request)
        try:
            stamp = {  # everything the checks depend on: a fingerprint that passed them once may not pass now
                "version": CACHE_VERSION,
                "fingerprint": FINGERPRINT_VERSION,
                "modalities": spec.modalities,
                "num_classes": spec.num_classes,
                "sources": _sources(case),
            }
            saved = _read_json(path)
            if saved is not None and saved.get("stamp") == stamp:
                continue
            image, image_nii = load_image(case.image)
            label, label_nii = load_label(case.label, image_nii)
            problems = case_problems(case, image, image_nii, label, label_nii, spec.num_classes, spec.modalities)
            if problems:
                errors += [f"{case.name}: {p}" for p in problems]
                continue
            found = fingerprint_arrays(case.name, image, image_nii.affine, label, spec.modalities, request)
            found = dataclasses.replace(found, unoriented=not records_orientation(image_nii))
            atomic_write_text(path, json.dumps({"stamp": stamp, **found.to_dict()}))
        except (OSError, ValueError) as e:
            if out_of_room(e) is not None:  # the cache's disk, not the case: said as itself
                raise
            errors.append(f"{case.name}: {e}")
    return errors


def load_fingerprints(cases: Sequence[Case], request: PlanRequest, root: Path) -> list[Fingerprint]:
    """The fingerprints `fingerprint_cases` wrote for these cases."""
    return [Fingerprint.from_dict(json.loads(_fingerprint_file(root, c, request).read_text())) for c in cases]


def _paths(folder: Path, case: Case) -> dict[str, Path]:
    name = _key(case)
    return {
        "image": folder / f"{name}_image.npy",
        "label": folder / f"{name}_label.npy",
        "fg": folder / f"{name}_fg.npy",
        "native": folder / f"{name}_native.npy",
        "share": folder / f"{name}_share.npy",
        "meta": folder / f"{name}.json",
    }


def _stamp(case: Case, plan: Plan, num_classes: int) -> dict:
    return {
        "version": CACHE_VERSION,
        "plan": plan.preprocessing(),
        "num_classes": num_classes,
        "sources": _sources(case),
    }


def is_fresh(case: Case, plan: Plan, num_classes: int, folder: str | Path) -> bool:
    """Whether the cached files of `case` exist and were made with this plan from its current source files."""
    paths = _paths(Path(folder), case)
    meta = _read_json(paths["meta"])
    try:
        stamp = _stamp(case, plan, num_classes)
    except OSError:
        return False
    return meta is not None and meta.get("stamp") == stamp and all(p.is_file() for p in paths.values())


def _save_npy(path: Path, array: np.ndarray) -> None:
    """`np.save`'s format, written through the file's own write: `ndarray.tofile`, which np.save uses, reports a
    short write without its errno, and a full disk then read as a bad case."""
    array = np.ascontiguousarray(array)

    def write(f) -> None:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
        f.write(array)

    atomic_write(path, write)


def write_case(case: Case, plan: Plan, num_classes: int, folder: str | Path) -> None:
    """Bring one (checked) case into the plan's space; write its cache files, the meta file last."""
    folder = Path(folder)
    stamp = _stamp(case, plan, num_classes)  # before reading: a file changed meanwhile leaves a stale stamp
    image, image_nii = load_image(case.image)
    native, _ = load_label(case.label, image_nii)
    planned = preprocess(image, image_nii.affine, plan, native, num_classes)
    fg = foreground_coords(planned.label)
    rows = [np.column_stack([np.full(len(c), k, np.int32), c]) for k, c in sorted(fg.items())]
    paths = _paths(folder, case)
    _save_npy(paths["image"], planned.image)
    _save_npy(paths["label"], planned.label)
    _save_npy(paths["fg"], np.concatenate(rows) if rows else np.zeros((0, 4), np.int32))
    _save_npy(paths["native"], native)
    _save_npy(paths["share"], planned.label_share)
    meta = {"stamp": stamp, "geometry": planned.geometry.to_dict()}
    atomic_write_text(paths["meta"], json.dumps(meta))


def build_cache(
    cases: Sequence[Case], plan: Plan, num_classes: int, folder: str | Path, shard: int = 0, num_shards: int = 1
) -> list[str]:
    """Write the stale cases of shard `shard` of `num_shards` (cases[shard::num_shards]); one message per case
    that could not be prepared."""
    errors = []
    for case in list(cases)[shard::num_shards]:
        try:
            if not is_fresh(case, plan, num_classes, folder):
                write_case(case, plan, num_classes, folder)
        except (OSError, ValueError) as e:
            if out_of_room(e) is not None:  # the cache's disk, not the case: said as itself
                raise
            errors.append(f"{case.name}: {e}")
    return errors


def open_case(case: Case, folder: str | Path) -> PreparedCase:
    """The cached case as read-only memory maps (FileNotFoundError if it was never built)."""
    paths = _paths(Path(folder), case)
    meta = _read_json(paths["meta"])
    if meta is None:
        raise FileNotFoundError(f"case {case.name} is not in the cache {folder}; build_cache first")
    fg = np.load(paths["fg"])
    coords = {int(k): fg[fg[:, 0] == k, 1:] for k in np.unique(fg[:, 0])}
    return PreparedCase(
        case.name,
        np.load(paths["image"], mmap_mode="r"),
        np.load(paths["label"], mmap_mode="r"),
        coords,
        native_label=np.load(paths["native"], mmap_mode="r"),
        geometry=Geometry.from_dict(meta["geometry"]),
        label_share=np.load(paths["share"], mmap_mode="r"),
    )
