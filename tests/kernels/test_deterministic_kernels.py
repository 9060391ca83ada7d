"""The pieces of --deterministic one at a time: the batch-invariant matmuls (C on CPU, Triton in the interpreter)
give a token the same bits whatever the call's token count and the token's place in it; transcendental pointwise
ops likewise; the Triton attention and SGMV launches keep one tiling and never split."""

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_kernels
from loraplex.kernels.custom_ops import POINTWISE_CHUNK, pointwise_op
from loraplex.kernels.dispatch import Backend, KernelConfig
from loraplex.kernels.linear_methods import InvariantLinear, batch_invariant_matmul, linear_method

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work over every thread

needs_c = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: no C kernels")


def rows_everywhere(matmul, x: torch.Tensor, w: torch.Tensor) -> None:
    """Row 0 of x, alone and at every place of calls of 1..41 rows, gives the same bits."""
    alone = matmul(x[:1], w)
    for m in (2, 3, 5, 7, 24, 25, 41):
        batch = x[1:m].clone()
        for place in {0, m // 2, m - 1}:
            call = torch.cat([batch[:place], x[:1], batch[place:]])
            assert torch.equal(matmul(call, w)[place], alone[0]), (m, place)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_matmul_gives_a_token_the_same_bits_in_any_call(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(41, 200).to(dtype), (torch.randn(37, 200) * 0.1).to(dtype)  # 37 rows: a tail of 1
    matmul = batch_invariant_matmul(KernelConfig(Backend.CPU, dtype=dtype, deterministic=True))
    rows_everywhere(matmul, x, w)
    want = x.double() @ w.double().T
    assert torch.allclose(matmul(x, w).double(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)


@needs_c
def test_a_deterministic_config_builds_invariant_linears_and_refuses_odd_widths():
    config = KernelConfig(Backend.CPU, dtype=torch.float32, deterministic=True)
    assert isinstance(linear_method(config, 64), InvariantLinear)
    with pytest.raises(ValueError, match="multiple of 8"):
        from loraplex.platform.models.linear import Linear

        Linear(60, 8, False, config)


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.tanh, lambda t: F.gelu(t, approximate="tanh")])
def test_pointwise_ops_give_an_element_the_same_bits_wherever_it_sits(fn):
    """Torch's CPU loops take the elements past the last whole vector through a scalar routine of their own."""
    op = pointwise_op(KernelConfig(Backend.CPU, deterministic=True), fn)
    torch.manual_seed(0)
    values = torch.randn(4096) * 3
    alone = torch.stack([op(v[None])[0] for v in values[:64]])
    for size in (3, 17, 64, POINTWISE_CHUNK + 5):
        x = values.repeat(size // 64 + 1)[:size]
        assert torch.equal(op(x)[: min(size, 64)], alone[:size])
    assert op(torch.empty(0, 3)).shape == (0, 3)
    assert pointwise_op(KernelConfig(Backend.CPU), fn) is fn  # outside the mode: the op itself


def test_triton_matmul_is_a_matmul_over_tails_of_every_dimension():
    """In the interpreter (numpy's dot stands in for the tensor cores, so its bits prove nothing of the GPU's:
    the GPU check's "deterministic" row does): the numbers, with M, N and K all past a whole tile."""
    pytest.importorskip("triton")
    from loraplex.kernels.matmul_triton import invariant_matmul_triton

    torch.manual_seed(0)
    x, w = torch.randn(3, 41, 72), torch.randn(70, 72) * 0.1
    assert torch.allclose(invariant_matmul_triton(x, w), x @ w.T, atol=1e-4)
    assert invariant_matmul_triton(x[:, :0], w).shape == (3, 0, 70)


def test_triton_attention_keeps_one_tiling_and_never_splits():
    pytest.importorskip("triton")
    from loraplex.kernels.paged_attention_triton import DETERMINISTIC_BLOCK_M, plan

    decode = plan(1, 8, 2, 1, 4096)  # one request, a long context: split across SMs normally
    assert decode.num_splits > 1
    for args in ((1, 8, 2, 1, 4096), (3, 8, 2, 57, 4096), (64, 32, 8, 1, 100)):
        launch = plan(*args, deterministic=True)
        assert launch.num_splits == 1 and launch.block_m == DETERMINISTIC_BLOCK_M
