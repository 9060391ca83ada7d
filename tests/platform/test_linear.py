"""A linear layer's weight format is a method object chosen once from the model's `KernelConfig`
(`kernels/linear_methods.py`); plain float32 rows send decode-sized calls to our C kernel and larger ones
to `F.linear`, with the same numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.kernels import cpu_kernels
from loraplex.kernels import linear_methods as lm
from loraplex.kernels.autotune import TuneTable
from loraplex.kernels.cpu_kernels import CpuCaps
from loraplex.kernels.dispatch import KernelConfig
from loraplex.platform.models.linear import Linear

CPU = KernelConfig(backend="cpu", caps=CpuCaps(library=True))
LIMIT = TuneTable().f32_kernel_tokens


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, ...]]:
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler")
    seen = []
    kernel = cpu_kernels.f32_matmul_c

    def recorded(x, weight):
        seen.append(tuple(x.shape))
        return kernel(x, weight)

    monkeypatch.setattr(cpu_kernels, "f32_matmul_c", recorded)
    return seen


def layer(config: KernelConfig = CPU, in_features: int = 64, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    linear = Linear(in_features, 48, bias, config)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, in_features))
        if bias:
            linear.bias.copy_(torch.randn(48))
    reference = (linear.weight.clone(), None if linear.bias is None else linear.bias.clone())
    linear.process_weights_after_loading()
    linear.reference = reference
    return linear


@pytest.mark.parametrize("config,in_features,expected", [
    (CPU, 64, lm.PlainF32Linear),
    (CPU, 60, lm.TorchLinear),  # K not a multiple of 8: the kernel cannot take it
    (dataclasses.replace(CPU, backend="native"), 64, lm.TorchLinear),  # LORAPLEX_KERNELS=torch
    (dataclasses.replace(CPU, pack_weights=True), 64, lm.OneDNNLinear),
    (dataclasses.replace(CPU, dtype=torch.bfloat16, pack_weights=True), 64, lm.TorchLinear),  # bf16 emulated
    (dataclasses.replace(CPU, dtype=torch.bfloat16, pack_weights=True, caps=CpuCaps(True, True)), 64,
     lm.OneDNNLinear),
    (dataclasses.replace(CPU, dtype=torch.bfloat16, pack_weights=True, caps=CpuCaps(True, True, amx=True)), 64,
     lm.AMXLinear),
    (dataclasses.replace(CPU, dtype=torch.bfloat16, pack_weights=True, caps=CpuCaps(True, True, amx=True)), 48,
     lm.OneDNNLinear),  # the tiles take K in 32s
    (dataclasses.replace(CPU, device_type="cuda", pack_weights=True), 64, lm.TorchLinear)])
def test_each_layer_gets_its_format_once_from_the_config(config, in_features, expected):
    assert type(lm.linear_method(config, in_features)) is expected
    assert type(lm.linear_method(config, in_features, ("q4", 32))) is lm.QuantizedLinear


@pytest.mark.parametrize("shape", [(1, 64), (LIMIT, 64), (4, 3, 64)])
def test_decode_sized_calls_take_the_kernel(calls, shape):
    linear, x = layer(), torch.randn(*shape)
    weight, bias = linear.reference
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert calls == [shape]


def test_larger_calls_and_other_formats_go_to_torch(calls):
    linear = layer()
    x = torch.randn(LIMIT + 1, 64)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, *linear.reference))
    layer(in_features=60)(torch.randn(2, 60))
    layer(dataclasses.replace(CPU, backend="native"))(torch.randn(2, 64))
    assert calls == []


def test_a_packed_weight_never_takes_the_kernel_and_keeps_no_plain_copy(calls):
    if not lm.can_pack(torch.float32, False):
        pytest.skip("no oneDNN in this torch build")
    linear = layer(dataclasses.replace(CPU, pack_weights=True))
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, *linear.reference), atol=1e-5, rtol=1e-5)
    assert calls == [] and linear.weight is None and linear.packed is not None
    assert torch.equal(linear.dense_weight(), linear.reference[0])


def test_a_shared_weight_is_kept_when_packed():
    if not lm.can_pack(torch.float32, False):
        pytest.skip("no oneDNN in this torch build")
    linear = Linear(64, 48, False, dataclasses.replace(CPU, pack_weights=True))
    linear.shared_weight = True
    linear.process_weights_after_loading()
    assert linear.weight is not None and linear.packed is not None


def test_weights_arrive_through_their_format():
    """A checkpoint's weight lands through the layer's format: a float format copies it and refuses bits, a
    quantized one quantizes the checkpoint's own numbers (or keeps bits that are them); each layer carries only
    its own format's attributes."""
    from loraplex.kernels import quant

    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    plain = Linear(64, 48, False, CPU)
    plain.weight_loader(weight)
    assert torch.equal(plain.weight, weight) and not hasattr(plain, "quantized")
    with pytest.raises(ValueError, match="cannot take quantized bits"):
        plain.weight_loader(weight, quant.quantize(weight, "q4", 32))
    with pytest.raises(ValueError, match=r"weight of shape \(64, 48\) for a 48x64 layer"):
        plain.weight_loader(weight.T)
    q4 = Linear(64, 48, False, CPU, ("q4", 32))
    q4.weight_loader(weight)
    assert torch.equal(quant.dequantize(q4.quantized), quant.dequantize(quant.quantize(weight, "q4", 32)))
    assert not hasattr(q4, "packed") and not hasattr(q4, "amx_packed")
    other = quant.quantize(torch.randn(48, 64), "q4", 32)
    with pytest.raises(ValueError, match="do not match the checkpoint's float weight"):
        q4.weight_loader(quant.dequantize(quant.quantize(weight, "q4", 32)), other)
