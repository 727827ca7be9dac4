"""Precision and memory format: which dtype and layout each device gets, and that channels-last computes the same."""

from __future__ import annotations

import pytest
import torch

from unet3d import DiceCELoss, UNet3D
from unet3d import precision as amp
from unet3d.precision import apply_memory_format, format_name, resolve_memory_format

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
CL, CONTIGUOUS = torch.channels_last_3d, torch.contiguous_format


def test_auto_is_channels_last_only_for_fp32_on_the_cpu():
    assert resolve_memory_format("auto", CPU, None) == CL
    assert resolve_memory_format("auto", CPU, torch.bfloat16) == CONTIGUOUS
    assert resolve_memory_format("auto", GPU, None) == CONTIGUOUS  # torch.device only: no CUDA call
    assert resolve_memory_format("auto", GPU, torch.float16) == CONTIGUOUS
    assert resolve_memory_format("channels_last", GPU, torch.bfloat16) == CL
    assert resolve_memory_format("contiguous", CPU, None) == CONTIGUOUS
    assert [format_name(f) for f in (CL, CONTIGUOUS)] == ["channels_last", "contiguous"]
    with pytest.raises(ValueError, match="'nhwc'"):
        resolve_memory_format("nhwc", CPU, None)


def test_apply_lays_out_the_3x3x3_weights_channels_last_and_keeps_the_head_channels_first():
    model = apply_memory_format(UNet3D(2, 3, (4, 8, 16)), CL)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv3d | torch.nn.ConvTranspose3d)]
    assert len(convs) > 5
    for conv in convs:
        if conv is model.head:
            assert conv.weight.stride() == torch.empty(conv.weight.shape).stride()
        else:
            assert conv.weight.is_contiguous(memory_format=CL) and not conv.weight.is_contiguous(), conv
    assert model(torch.randn(1, 2, 16, 16, 8)).is_contiguous()  # logits channels-first, as the loss expects


def test_channels_last_computes_what_channels_first_computes():
    torch.manual_seed(0)
    plain = UNet3D(2, 3, (4, 8, 16))
    laid = apply_memory_format(UNet3D(2, 3, (4, 8, 16)), CL)
    laid.load_state_dict(plain.state_dict())
    x = torch.randn(2, 2, 16, 16, 8)
    y = torch.randint(0, 3, (2, 16, 16, 8))
    outs = []
    for model in (plain, laid):
        out = model(x)
        DiceCELoss()(out, y).backward()
        outs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # the state dict loads into a channels-first model (evaluate.py on another machine)
    again = UNet3D(2, 3, (4, 8, 16))
    again.load_state_dict(laid.state_dict())
    torch.testing.assert_close(again(x), outs[0][0], rtol=1e-4, atol=1e-5)


def test_amp_auto_picks_bf16_only_where_it_is_native(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: True)
    assert amp.resolve_amp("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: False)
    assert amp.resolve_amp("auto", cpu) is None
    assert amp.resolve_amp("off", cpu) is None and amp.resolve_amp("fp16", cpu) == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert amp.resolve_amp("auto", torch.device("cuda", 0)) == torch.float16, "pre-Ampere GPUs: fp16"
    assert amp.grad_scaler(cpu, torch.float16).is_enabled() and not amp.grad_scaler(cpu, torch.bfloat16).is_enabled()
