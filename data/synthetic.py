"""A synthetic segmentation dataset written in the MSD layout, so the default run uses the real loader.

Each case is an MR-like phantom defined in world millimetres: a body of soft tissue holding one or two
ellipsoidal "organs" (class 1), some with a darker "lesion" inside (class 2), a bright vessel-like tube left
unlabelled as a distractor, a smooth multiplicative bias field (intensity inhomogeneity) and Gaussian noise.
Everything follows from the seed and the case's index. The phantom is then acquired on a voxel grid:

- `uniform`: every case at 1 x 1 x 1.5 mm in RAS order, like many clinical scans (the default);
- `mixed`: each case by one of three protocols, as clinical data comes: isotropic 1 mm in RAS order; axial
  0.8 x 0.8 x 3 mm slices in LPS; sagittal 3.3 mm slices with the thick axis first (RIP order);
- `isotropic`, `axial`, `sagittal`: every case by that one protocol of `mixed`, which tells what each
  acquisition costs on the same anatomy.

The same index gives the same anatomy in world coordinates in every geometry, so the datasets can be compared.

Every voxel averages the phantom over its own box (partial volume), as a scanner's voxel integrates the
signal across its extent, finely enough that the image shows where inside the voxel a boundary lies (a thick
slice records where in its slab an organ ends); labels are the phantom at the voxel centre.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import nibabel as nib
import numpy as np

from unet3d.files import remove_stale_temps, temp_path

SINGLE_PROTOCOLS = ("isotropic", "axial", "sagittal")  # the geometries of one protocol each, PROTOCOLS' order
GEOMETRIES = ("uniform", "mixed", *SINGLE_PROTOCOLS)
# the generator's version per geometry, in the folder name: a change that alters the files gets a new folder
# (mixed 2: thick slices integrated every 0.25 mm instead of every 1 mm; uniform 2 and mixed 3: every voxel
# integrated over its box, where before axes of 1.5 mm or less took the value at the centre); the single
# protocols share mixed's
VERSIONS = {"uniform": 2, "mixed": 3, **{name: 3 for name in SINGLE_PROTOCOLS}}
SPACING = (1.0, 1.0, 1.5)  # the uniform acquisition
LABELS = {"0": "background", "1": "organ", "2": "lesion"}
SUBSAMPLE_MM = 0.25  # at most this far apart along each axis: the sub-samples that integrate a voxel
NOISE_SD = 15.0  # Gaussian noise added to every voxel (tissue intensities 20..150)


@dataclass(frozen=True)
class Acquisition:
    """A voxel grid: for each array axis the world axis it runs along, its direction (+1 towards R, A or S)
    and its voxel size in mm."""

    name: str
    axes: tuple[int, int, int]
    directions: tuple[int, int, int]
    spacing: tuple[float, float, float]


UNIFORM = Acquisition("RAS 1x1x1.5", (0, 1, 2), (1, 1, 1), SPACING)
PROTOCOLS = (
    Acquisition("RAS 1 mm isotropic", (0, 1, 2), (1, 1, 1), (1.0, 1.0, 1.0)),
    Acquisition("LPS axial 0.8x0.8x3", (0, 1, 2), (-1, -1, 1), (0.8, 0.8, 3.0)),
    Acquisition("RIP sagittal 3.3x0.9x0.9", (0, 2, 1), (1, -1, -1), (3.3, 0.9, 0.9)),
)


def extent(size: int) -> np.ndarray:
    """The field of view in mm (X, Y, Z): `size` in-plane, the uniform grid's depth along Z."""
    return np.array([size, size, (int(round(size / SPACING[2])) // 8 * 8 or 8) * SPACING[2]], dtype=np.float64)


def grid(acquisition: Acquisition, fov: np.ndarray) -> tuple[tuple[int, int, int], np.ndarray]:
    """(array shape, affine) of an acquisition covering the field of view [0, fov] mm."""
    shape = tuple(max(2, int(round(fov[w] / s))) for w, s in zip(acquisition.axes, acquisition.spacing))
    affine = np.eye(4)
    affine[:3, :3] = 0
    for a, (w, d, s) in enumerate(zip(acquisition.axes, acquisition.directions, acquisition.spacing)):
        affine[w, a] = d * s
        affine[w, 3] += 0.5 * s if d > 0 else fov[w] - 0.5 * s  # voxel 0's centre
    return shape, affine


@dataclass(frozen=True)
class Phantom:
    """One case's anatomy in world mm (drawn once per case, whatever the acquisition)."""

    body: tuple[np.ndarray, np.ndarray]  # centre, radii
    organs: list[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]]  # centre, radii, lesion
    tube: tuple[int, float, float, float]  # axis, the two other coordinates, radius
    bias: list[tuple[float, float]]  # per world axis: frequency, phase
    noise_seed: int


def draw_phantom(rng: np.random.Generator, fov: np.ndarray) -> Phantom:
    body = (fov / 2 + rng.normal(0, 1, 3), fov * rng.uniform(0.42, 0.48, 3))
    organs = []
    for _ in range(rng.integers(1, 3)):
        radii = fov * rng.uniform(0.14, 0.22, 3)
        centre = fov * rng.uniform(0.3, 0.7, 3)
        lesion = None
        if rng.random() < 0.8:
            lesion = (centre + rng.normal(0, 0.2, 3) * radii, radii * rng.uniform(0.4, 0.65))
        organs.append((centre, radii, lesion))
    axis = int(rng.integers(3))
    others = [fov[a] for a in range(3) if a != axis]
    a, b = rng.uniform(0.3, 0.7, 2) * others
    tube = (axis, float(a), float(b), 0.04 * float(fov.min()))
    bias = [(float(rng.uniform(0.3, 1.0)), float(rng.uniform(0, 2 * np.pi))) for _ in range(3)]
    return Phantom(body, organs, tube, bias, int(rng.integers(2**31)))


def _scaled_radius_sq(points: np.ndarray, centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """The square of each world point's (..., 3) scaled radius in an ellipsoid: <= 1 inside it."""
    return (((points - centre) / radii) ** 2).sum(-1)


def _inside(points: np.ndarray, centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    return _scaled_radius_sq(points, centre, radii) <= 1.0


def _tube_distance_sq(points: np.ndarray, tube: tuple[int, float, float, float]) -> np.ndarray:
    """The square of each world point's (..., 3) distance from the tube's axis."""
    axis, a, b, _ = tube
    u, v = [points[..., i] for i in range(3) if i != axis]
    return (u - a) ** 2 + (v - b) ** 2


def _in_tube(points: np.ndarray, tube: tuple[int, float, float, float]) -> np.ndarray:
    return _tube_distance_sq(points, tube) <= tube[3] ** 2


def _shapes(phantom: Phantom) -> list:
    """The phantom's solids, each a function from world points (..., 3) to whether they lie inside it: the body,
    each organ followed by its lesion (None where it has none), the tube."""
    shapes = [functools.partial(_inside, centre=phantom.body[0], radii=phantom.body[1])]
    for centre, radii, lesion in phantom.organs:
        shapes.append(functools.partial(_inside, centre=centre, radii=radii))
        shapes.append(None if lesion is None else functools.partial(_inside, centre=lesion[0], radii=lesion[1]))
    return [*shapes, functools.partial(_in_tube, tube=phantom.tube)]


def _compose(phantom: Phantom, inside: list, points: np.ndarray, fov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(intensity without noise, label) at world points (..., 3), from whether they lie in each of `_shapes`."""
    label = np.zeros(points.shape[:-1], np.uint8)
    image = np.full(points.shape[:-1], 20.0, np.float32)  # air
    body = inside[0]
    image[body] = 100.0
    for j in range(len(phantom.organs)):
        organ = inside[1 + 2 * j] & body
        label[organ], image[organ] = 1, 150.0
        if inside[2 + 2 * j] is not None:
            lesion = inside[2 + 2 * j] & organ
            label[lesion], image[lesion] = 2, 40.0
    # A bright tube through the body, as bright as an organ but unlabelled: intensity alone won't do.
    tube = inside[-1] & body & (label == 0)
    image[tube] = 150.0
    field = np.ones(points.shape[:-1], np.float32)
    for w, (frequency, phase) in enumerate(phantom.bias):
        field += 0.15 * np.cos(2 * np.pi * (points[..., w] / fov[w]) * frequency + phase)
    return image * field, label


def evaluate_phantom(phantom: Phantom, points: np.ndarray, fov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(intensity without noise, label) at world points (..., 3)."""
    return _compose(phantom, [None if f is None else f(points) for f in _shapes(phantom)], points, fov)


def subsample_offsets(acquisition: Acquisition) -> np.ndarray:
    """(N, 3) offsets in voxels at which a voxel of `acquisition` samples the phantom: along every axis an odd
    number of points at most SUBSAMPLE_MM apart that spans the voxel, so their mean integrates its box as the
    scanner does (where inside the voxel a boundary lies shows in the intensity, not only which side of it
    the centre is on)."""
    subs = [2 * math.ceil(s / (2 * SUBSAMPLE_MM)) + 1 for s in acquisition.spacing]
    grids = [(np.arange(k) + 0.5) / k - 0.5 for k in subs]
    return np.stack(np.meshgrid(*grids, indexing="ij"), axis=-1).reshape(-1, 3)


def _grid_points(acquisition: Acquisition, fov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(voxel indices (*shape, 3), affine) of the acquisition's grid."""
    shape, affine = grid(acquisition, fov)
    return np.stack(np.meshgrid(*[np.arange(n, dtype=np.float64) for n in shape], indexing="ij"), axis=-1), affine


def _near_surfaces(phantom: Phantom, points: np.ndarray, reach: float) -> list:
    """For each of `_shapes` (None where it is), whether its surface may pass within `reach` mm of each world
    point (..., 3): never False where it does. For an ellipsoid, |F - 1| * (its smallest radius), F the
    point's scaled radius, is a lower bound on the distance to its surface (the scaling moves no two points
    closer than by that radius); for the tube the distance to its surface is exact."""

    def ellipsoid(centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
        scaled = np.sqrt(_scaled_radius_sq(points, centre, radii))
        return np.abs(scaled - 1.0) * float(np.min(radii)) <= reach

    near = [ellipsoid(*phantom.body)]
    for centre, radii, lesion in phantom.organs:
        near += [ellipsoid(centre, radii), None if lesion is None else ellipsoid(*lesion)]
    tube_radius = phantom.tube[3]
    return [*near, np.abs(np.sqrt(_tube_distance_sq(points, phantom.tube)) - tube_radius) <= reach]


def _sampled(phantom: Phantom, acquisition: Acquisition, fov: np.ndarray):
    """(intensity, label) at every voxel centre, the grid's affine, the mask of voxels whose box a boundary may
    cross, and a generator of (intensity, label) at those voxels' points for each of `subsample_offsets` in
    turn. Elsewhere the voxel holds one class, so its centre stands for its box (the bias field is smooth at a
    voxel's scale). Likewise a sub-sample is tested against only the solids whose surface passes near its
    voxel; for the others it is where the voxel's centre is (the same answer, found in a fraction of the time)."""
    index, affine = _grid_points(acquisition, fov)

    def world(idx: np.ndarray) -> np.ndarray:
        return idx @ affine[:3, :3].T + affine[:3, 3]

    centres = world(index)
    shapes = _shapes(phantom)
    at_centres = [None if f is None else f(centres) for f in shapes]
    close = _near_surfaces(phantom, centres, 0.5 * float(np.linalg.norm(acquisition.spacing)))
    near = np.logical_or.reduce([m for m in close if m is not None])
    intensity, label = _compose(phantom, at_centres, centres, fov)
    inner = index[near]
    centre_inside = [None if m is None else m[near] for m in at_centres]
    close = [None if m is None else m[near] for m in close]

    def sample(offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        points = world(inner + offset)
        inside = []
        for f, at_centre, crossed in zip(shapes, centre_inside, close):
            inside_k = at_centre
            if f is not None:
                inside_k = at_centre.copy()
                inside_k[crossed] = f(points[crossed])
            inside.append(inside_k)
        return _compose(phantom, inside, points, fov)

    samples = (sample(offset) for offset in subsample_offsets(acquisition))
    return intensity, label, affine, near, samples


def _mean(arrays) -> np.ndarray:
    """The mean of the arrays an iterable yields, summed one at a time in float64 (the sub-samples of
    `_sampled`, of which only one is held at once)."""
    total, count = 0.0, 0
    for array in arrays:
        total = total + np.asarray(array, np.float64)
        count += 1
    return total / count


def acquire(phantom: Phantom, acquisition: Acquisition, fov: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image float32, label uint8, affine) of the phantom on the acquisition's grid, with noise.

    The intensity is the mean over `subsample_offsets` across the voxel (partial volume), as the scanner
    records it; the label is the phantom at the voxel's centre.
    """
    intensity, label, affine, near, samples = _sampled(phantom, acquisition, fov)
    image = intensity.astype(np.float32)
    image[near] = _mean(values for values, _ in samples)
    image += np.random.default_rng(phantom.noise_seed).normal(0, NOISE_SD, label.shape).astype(np.float32)
    return image, label, affine


def class_fractions(phantom: Phantom, acquisition: Acquisition, fov: np.ndarray) -> np.ndarray:
    """(3, *shape) float32: the share of each voxel that each class fills, over the sub-samples its intensity
    averages: what a noise-free image can tell about the classes (tests compare it with the centre labels)."""
    _, label, _, near, samples = _sampled(phantom, acquisition, fov)
    fractions = np.stack([label == k for k in range(len(LABELS))]).astype(np.float32)
    fractions[:, near] = _mean(np.stack([labels == k for k in range(len(LABELS))]) for _, labels in samples)
    return fractions


def case_acquisition(geometry: str, index: int) -> Acquisition:
    """The acquisition of case `index` in a dataset of this geometry."""
    if geometry == "uniform":
        return UNIFORM
    if geometry in SINGLE_PROTOCOLS:
        return PROTOCOLS[SINGLE_PROTOCOLS.index(geometry)]
    return PROTOCOLS[index % len(PROTOCOLS)]


def generate_case(
    seed: int, index: int, size: int, geometry: str = "uniform"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Case `index` of the dataset with this seed: (image (X, Y, Z) float32, label uint8 of 0, 1, 2, affine)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"synthetic geometry must be one of {GEOMETRIES}, got {geometry!r}")
    fov = extent(size)
    phantom = draw_phantom(np.random.default_rng([seed, index]), fov)
    return acquire(phantom, case_acquisition(geometry, index), fov)


def folder_name(num_cases: int, size: int, seed: int, geometry: str) -> str:
    """The folder a synthetic dataset is written to under `--synthetic-dir` (its version when above 1)."""
    name = f"cases{num_cases}_size{size}_seed{seed}"
    if geometry != "uniform":
        name += f"_{geometry}"
    return name + (f"-v{VERSIONS[geometry]}" if VERSIONS[geometry] > 1 else "")


def write_synthetic_dataset(
    root: str | Path, num_cases: int = 24, size: int = 64, seed: int = 0, num_test: int = 4, geometry: str = "uniform"
) -> Path:
    """Write `num_cases` training and `num_test` test cases (with labelsTs/) under `root`.

    The files are written to a temporary sibling folder which is then renamed to `root`, so a reader
    never sees a half-written dataset. An existing complete `root` is reused as it is.
    """
    root = Path(root)
    if (root / "dataset.json").is_file():
        return root
    if num_cases < 2 or size < 8:
        raise ValueError(f"need num_cases >= 2 and size >= 8, got {num_cases}, {size}")
    remove_stale_temps(root)  # what a writer killed here before left (SIGTERM during the pre-flight)
    tmp = temp_path(root)  # unique per host and process: nodes may share the folder
    try:
        _write(tmp, num_cases, size, seed, num_test, geometry)
        root.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, root)
    except OSError:  # another process finished first: keep its copy
        if not (root / "dataset.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _write_case(folder: Path, seed: int, index: int, size: int, geometry: str, is_test: bool) -> None:
    image, label, affine = generate_case(seed, index, size, geometry)
    name = f"synth_{index:03d}.nii.gz"
    img_dir, lbl_dir = ("imagesTs", "labelsTs") if is_test else ("imagesTr", "labelsTr")
    nib.save(nib.Nifti1Image(image, affine), folder / img_dir / name)
    nib.save(nib.Nifti1Image(label, affine), folder / lbl_dir / name)


def _writers(num_files: int) -> int:
    """Processes to write `num_files` cases with: one per CPU this process may use, at most 8; one where
    fork is missing (each case depends only on the seed and its index, so the files are the same)."""
    if "fork" not in get_all_start_methods():
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 8, num_files))


def _write(folder: Path, num_cases: int, size: int, seed: int, num_test: int, geometry: str) -> None:
    for sub in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        (folder / sub).mkdir(parents=True)
    jobs = [(folder, seed, i, size, geometry, i >= num_cases) for i in range(num_cases + num_test)]
    processes = _writers(len(jobs))
    if processes == 1:
        for job in jobs:
            _write_case(*job)
    else:  # forked workers: numpy and nibabel only, nothing of a parent's process group or device
        with ProcessPoolExecutor(processes, mp_context=get_context("fork")) as pool:
            for done in [pool.submit(_write_case, *job) for job in jobs]:
                done.result()  # a worker's error is raised here, and the folder is removed by the caller
    names = [f"synth_{i:03d}.nii.gz" for i in range(num_cases + num_test)]
    training = [{"image": f"./imagesTr/{n}", "label": f"./labelsTr/{n}"} for n in names[:num_cases]]
    test = [f"./imagesTs/{n}" for n in names[num_cases:]]
    meta = {
        "name": "Synthetic",
        "description": f"synthetic MR-like volumes, seed {seed}, {geometry} geometry",
        "tensorImageSize": "3D",
        "modality": {"0": "MRI"},
        "labels": LABELS,
        "numTraining": len(training),
        "numTest": len(test),
        "training": training,
        "test": test,
    }
    (folder / "dataset.json").write_text(json.dumps(meta, indent=2))
