"""Sliding-window inference: coverage, stitching and padding, checked with a pointwise model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unet3d import UNet3D
from unet3d.inference.sliding_window import (
    InferenceSettings,
    gaussian_weight,
    predict,
    sliding_window_inference,
    window_starts,
)


@pytest.mark.parametrize(("size", "window", "overlap"), [(50, 16, 0.5), (16, 16, 0.5), (17, 16, 0.25), (100, 32, 0)])
def test_window_starts_cover_with_the_requested_overlap(size, window, overlap):
    starts = window_starts(size, window, overlap)
    assert starts[0] == 0 and starts[-1] == size - window
    covered = torch.zeros(size, dtype=torch.bool)
    for s in starts:
        covered[s : s + window] = True
    assert covered.all()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(0 < g <= window * (1 - overlap) + 1e-9 for g in gaps)


def test_gaussian_weight_peaks_in_the_middle():
    w = gaussian_weight((8, 8, 6))
    assert w.shape == (8, 8, 6) and w.max() <= 1 and w.min() >= 1e-3
    assert w[4, 4, 3] == w.max() and w[4, 4, 3] > 100 * w[0, 0, 0]
    assert torch.equal(w, w.flip(0)) and torch.equal(w, w.flip(2)), "symmetric"


class Pointwise(nn.Module):
    """A 1x1x1 convolution: its output at a voxel depends only on that voxel, so stitching must not show."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv3d(2, 3, 1)

    def forward(self, x):
        assert x.shape[2:] == (16, 16, 8), "every window has the requested size"
        return self.conv(x)


@pytest.mark.parametrize("size", [(37, 21, 19), (16, 16, 8), (10, 5, 3), (40, 9, 30)])
def test_stitched_output_equals_whole_volume_output(size):
    model = Pointwise().eval()
    image = torch.randn(2, *size)
    out = sliding_window_inference(model, image, InferenceSettings(window=(16, 16, 8), sw_batch_size=3))
    assert out.shape == (3, *size)
    with torch.no_grad():
        direct = model.conv(image[None])[0]
    torch.testing.assert_close(out, direct, rtol=1e-5, atol=1e-5)


class MirrorSymmetric(nn.Module):
    """A 3x3x3 convolution whose kernel is the same under every mirroring of the axes: mirroring the input
    mirrors the output exactly, so TTA that undoes its flips must give the plain prediction back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv3d(1, 3, 3, padding=1)
        with torch.no_grad():
            w = self.conv.weight
            w.copy_(sum(w.flip(axes) for axes in [(), (2,), (3,), (4,), (2, 3), (2, 4), (3, 4), (2, 3, 4)]) / 8)

    def forward(self, x):
        return self.conv(x)


def test_tta_undoes_its_flips():
    model = MirrorSymmetric()
    image = torch.randn(1, 12, 10, 8)  # the size of the window: one window, no padding, no stitching
    settings = InferenceSettings(window=(12, 10, 8))
    plain = predict(model, image, settings, torch.device("cpu"))
    assert not torch.equal(plain, plain.flip(0)), "the test needs a prediction that mirroring changes"
    mirrored = predict(model, image, InferenceSettings(window=(12, 10, 8), tta=True), torch.device("cpu"))
    assert torch.equal(mirrored, plain)
    with torch.no_grad():  # and the equivariance the test relies on
        torch.testing.assert_close(model(image.flip(1)[None])[0], model(image[None])[0].flip(1))


def test_predict_with_tta_on_a_unet():
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8))
    image = torch.randn(1, 20, 13, 9).numpy()
    plain = predict(model, image, InferenceSettings(window=(8, 8, 8)), torch.device("cpu"))
    mirrored = predict(model, image, InferenceSettings(window=(8, 8, 8), tta=True), torch.device("cpu"))
    assert plain.shape == mirrored.shape == (20, 13, 9) and plain.dtype == torch.int64
    assert int(plain.max()) < 3 and model.training, "predict restores the model's mode"


def test_tta_holds_one_passs_logits_at_a_time(monkeypatch):
    """A CT's logits take gigabytes: each mirrored pass's logits and probabilities are freed before the next
    pass stitches its own (the GPU then holds the running sum and one pass, not every pass's leftovers)."""
    import weakref

    import unet3d.inference.sliding_window as sw

    real, returned, alive_at_start = sw.sliding_window_inference, [], []

    def recording(model, image, settings):
        alive_at_start.append(sum(ref() is not None for ref in returned))
        logits = real(model, image, settings)
        returned.append(weakref.ref(logits))
        return logits

    monkeypatch.setattr(sw, "sliding_window_inference", recording)
    torch.manual_seed(0)
    settings = InferenceSettings(window=(8, 8, 8), tta=True)
    probs = sw.predict_probabilities(UNet3D(1, 3, (4, 8)), torch.randn(1, 12, 10, 8), settings, torch.device("cpu"))
    assert alive_at_start == [0] * 8, "no earlier pass's logits are alive when a pass starts"
    torch.testing.assert_close(probs.sum(0), torch.ones(12, 10, 8))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="overlap"):
        InferenceSettings(window=(16, 16, 8), overlap=1.0)
    with pytest.raises(ValueError, match=r"\(C, X, Y, Z\)"):
        sliding_window_inference(Pointwise(), torch.randn(16, 16, 8), InferenceSettings(window=(16, 16, 8)))
