"""The Triton layer kernels (`kernels/layer_triton.py`, the interpreter on CPU) as the fused ops' `forward_cuda`
against their `forward_native`: float32 to summation order, bfloat16 equal or one unit in the last place."""

import numpy as np
import pytest
import torch

from kernel_case import configured
from loraplex.kernels.custom_ops import GeluTanhAndMul, RMSNorm, RopeKVWrite, SiluAndMul
from loraplex.kernels.paged_attention import PagedAttentionMetadata

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def bf16_rounded_to_nearest_even(monkeypatch):
    """Triton's interpreter casts float32 to bf16 by cutting bits; compiled, the cast rounds to nearest even
    (LLVM's fptrunc), as torch does. The interpreter is made to round as the GPU does, so bf16 results can be
    compared bit for bit."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    import triton.language as tl

    cut = interpreter.InterpreterBuilder.create_fp_trunc

    def rounded(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cut(self, src, dst_type)
        data = torch.from_numpy(np.ascontiguousarray(src.data)).bfloat16().view(torch.int16).numpy()
        return interpreter.TensorHandle(data.view(np.uint16), dst_type.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_trunc", rounded)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: to 1e-6; bf16 / fp16: at most one unit in the last place apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    bits = [t.view(torch.int16).int() for t in (got, want)]
    ordinal = [torch.where(b < 0, -(b & 0x7FFF), b) for b in bits]  # sign-magnitude -> ordered integers
    assert (ordinal[0] - ordinal[1]).abs().max() <= 1


def built(op_class, dtype: torch.dtype, *args):
    op = op_class(*args, configured("triton", "cpu", dtype))
    assert op.forward == op.forward_cuda  # chosen once, in __init__
    return op.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (7, 67)])
def test_rms_norm_and_the_residual_add_in_place(dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    norm = built(RMSNorm, dtype, width, 1e-6)
    norm.weight.copy_(1 + torch.randn(width, generator=g))  # Gemma's weights come here already offset by 1
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, width, generator=g).to(dtype)
    assert_matches(norm(x), norm.forward_native(x))
    residual = x.clone()
    out, returned = norm(delta, residual)
    want, want_residual = norm.forward_native(delta, x)
    assert returned is residual and torch.equal(residual, want_residual)  # the sum, rounded as torch's add
    assert_matches(out, want)


def test_qk_norm_over_the_heads_of_a_3d_view():
    """[T, H, D]: each head's D values a row (Qwen3's / Gemma 3's q and k norms); D not a power of two."""
    g = torch.Generator().manual_seed(0)
    norm = built(RMSNorm, torch.bfloat16, 80, 1e-6)
    norm.weight.copy_(torch.randn(80, generator=g))
    x = (torch.randn(5, 3, 80, generator=g) * 2).bfloat16()
    out = norm(x)
    assert out.shape == (5, 3, 80)
    assert_matches(out, norm.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_class", [SiluAndMul, GeluTanhAndMul])
def test_activation_times_up(op_class, dtype):
    """1100 outputs: two programs per row, the second masked. GeLU's 0.5 g (1 + tanh(u)) keeps only a few bits
    of 1 + tanh(u) where g < -3 (torch's formula, in either tanh): there the two agree to float32's rounding of
    that sum, 1e-6 |g up|."""
    op = built(op_class, dtype)
    for rows in (1, 7):
        gate_up = (torch.randn(rows, 2 * 1100, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
        got, want = op(gate_up), op.forward_native(gate_up)
        gate, up = gate_up.float().chunk(2, dim=-1)
        tail = gate < -3 if op_class is GeluTanhAndMul else torch.zeros_like(gate, dtype=torch.bool)
        assert_matches(got[~tail], want[~tail])
        assert ((got - want).float()[tail].abs() <= 1e-6 * (gate * up)[tail].abs()).all()


def rope_case(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int):
    """qkv rows, each token's cos / sin [T, 1, D] as the model passes them, and the slots (one -1)."""
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=g) * 100
    emb = torch.cat([angles, angles], dim=-1)
    rope = (emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None])
    slots = torch.randperm(4 * 8, generator=g)[:tokens]
    slots[tokens // 2] = -1
    return qkv, rope, PagedAttentionMetadata.build(slots, torch.zeros(1, 4, dtype=torch.int32),
                                                   torch.tensor([tokens]), torch.tensor([0, tokens]), 8)


def rope_ops(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, kv_dtype: torch.dtype):
    triton_op = RopeKVWrite(heads, kv_heads, dim, configured("triton", "cpu", dtype, kv_dtype=kv_dtype))
    native = RopeKVWrite(heads, kv_heads, dim, configured("torch", "cpu", dtype, kv_dtype=kv_dtype))
    assert triton_op.forward == triton_op.forward_cuda and native.forward == native.forward_native
    return triton_op, native


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float16)])
def test_rope_and_kv_write(dtype, kv_dtype):
    """GQA (6 q heads over 2 kv heads, more heads than one program takes), a padding token's slot -1 left
    unwritten, and a float16 cache under a bf16 model (its copies rounded as `.to` rounds)."""
    heads, kv_heads, dim, tokens = 6, 2, 96, 7
    qkv, rope, meta = rope_case(dtype, tokens, heads, kv_heads, dim)
    caches = [torch.full((4, 8, kv_heads, dim), 7.0, dtype=kv_dtype) for _ in range(4)]
    triton_op, native = rope_ops(dtype, heads, kv_heads, dim, kv_dtype)
    q = triton_op(qkv, rope, caches[0], caches[1], meta)
    want = native(qkv, rope, caches[2], caches[3], meta)
    assert q.shape == (tokens, heads, dim) and q.is_contiguous()
    if dtype == torch.float32:
        assert_matches(q, want)
        assert_matches(caches[0], caches[2])
    else:  # every product and sum rounded where torch rounds it: the same bits
        assert torch.equal(q, want) and torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    written = caches[0].view(-1, kv_heads, dim)[meta.slot_mapping[meta.slot_mapping >= 0]]
    assert (written != 7).all() and (caches[1] == 7).sum() == (32 - (tokens - 1)) * kv_heads * dim


def test_rope_of_a_single_decode_token():
    qkv, rope, meta = rope_case(torch.bfloat16, 1, 4, 4, 64)
    meta.slot_mapping[0] = 5
    caches = [torch.zeros(4, 8, 4, 64, dtype=torch.bfloat16) for _ in range(4)]
    triton_op, native = rope_ops(torch.bfloat16, 4, 4, 64, torch.bfloat16)
    assert torch.equal(triton_op(qkv, rope, *caches[:2], meta), native(qkv, rope, *caches[2:], meta))
    assert all(torch.equal(a, b) for a, b in zip(caches[:2], caches[2:]))


@pytest.mark.parametrize("kernel, constants, pointers, floats", [
    ("_rms_norm_kernel", dict(ROWS=16, BLOCK=128, RESIDUAL=True, ROUND=True), {}, ("eps",)),
    ("_act_and_mul_kernel", dict(GELU=True, BLOCK=1024), {"x_ptr": "*bf16", "out_ptr": "*bf16"}, ()),
    ("_rope_kv_write_kernel", dict(BLOCK_H=16, BLOCK_D=128),
     {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_ptr": "*bf16", "slots_ptr": "*i64"}, ()),
])
def test_layer_kernels_compile_for_the_gpu(kernel, constants, pointers, floats):
    """Each kernel builds to a cubin for sm_90, beside the interpreter runs above."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from compile_case import compile_for_sm90

    assert compile_for_sm90("loraplex.kernels.layer_triton", kernel, constants, pointers, floats)[-1] == "cubin"
