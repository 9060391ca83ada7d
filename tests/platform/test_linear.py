"""`PackedLinear` on plain float32 weights: decode-sized calls go to our C kernel, the rest (and anything it
cannot take) to `F.linear`, with the same numbers."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu_kernels
from loraplex.platform.models import linear as linear_module
from loraplex.platform.models.linear import F32_KERNEL_TOKENS, PackedLinear


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


def layer(in_features: int = 64, bias: bool = True) -> PackedLinear:
    torch.manual_seed(0)
    return PackedLinear(in_features, 48, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("shape", [(1, 64), (F32_KERNEL_TOKENS, 64), (4, 3, 64)])
def test_decode_sized_calls_take_the_kernel(calls, shape):
    linear, x = layer(), torch.randn(*shape)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias),
                               atol=1e-5, rtol=1e-5)
    assert calls == [shape]


def test_larger_calls_and_what_the_kernel_cannot_take_go_to_f_linear(calls, monkeypatch):
    layer()(torch.randn(F32_KERNEL_TOKENS + 1, 64))
    layer(in_features=60)(torch.randn(2, 60))  # K not a multiple of 8
    layer()(torch.randn(2, 128)[:, ::2])  # x not contiguous
    x = torch.randn(2, 64, requires_grad=True)  # what autograd must see goes to F.linear
    layer()(x).sum().backward()
    assert x.grad is not None
    trained = PackedLinear(64, 48)
    trained(torch.randn(2, 64)).sum().backward()
    assert trained.weight.grad is not None
    layer().to(torch.bfloat16)(torch.randn(2, 64, dtype=torch.bfloat16))
    monkeypatch.setattr(linear_module, "backend", lambda: "torch")  # LORAPLEX_KERNELS=torch
    layer()(torch.randn(2, 64))
    assert calls == []


def test_a_packed_weight_never_takes_the_kernel(calls):
    from loraplex.platform.models.linear import can_pack

    if not can_pack(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    linear = layer()
    linear.pack()
    linear(torch.randn(2, 64))
    assert calls == []
