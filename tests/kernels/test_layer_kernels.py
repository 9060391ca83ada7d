"""The fused per-layer C kernels (residual add + RMSNorm, RoPE + KV write, SiLU * up) against the
PyTorch ops they replace, in float32 and in bfloat16 (where they must round as those ops round)."""

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_kernels
from loraplex.kernels.paged_attention import write_kv_reference

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work over every thread

needs_kernel = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]
# float32: summation order only; bfloat16: at most one unit in the last place where that order
# tips a rounding
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def torch_rms_norm(x, w, eps):
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_residual_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    torch.testing.assert_close(cpu_kernels.add_rms_norm_c(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), **TOL[dtype])
    residual = x.clone()
    out = cpu_kernels.add_rms_norm_c(delta, w, 1e-5, residual)
    assert torch.equal(residual, x + delta)  # the sum, rounded as torch's add rounds
    torch.testing.assert_close(out, torch_rms_norm(x + delta, w, 1e-5), **TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rope_and_kv_write(dtype, tokens):
    heads, kv_heads, dim, block_size, blocks = 9, 3, 64, 16, 8
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=g) * 100
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1  # a padding token: nothing written for it
    caches = [torch.zeros(blocks, block_size, kv_heads, dim, dtype=dtype) for _ in range(4)]
    q = cpu_kernels.rope_write_kv_c(qkv, cos[:, None], sin[:, None], heads, kv_heads, slots, caches[0], caches[1])
    # the PyTorch ops of the model's fallback
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    qk = qk.view(tokens, heads + kv_heads, dim)
    qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    write_kv_reference(qk[:, heads:], v.view(tokens, kv_heads, dim), caches[2], caches[3], slots)
    torch.testing.assert_close(q, qk[:, :heads], **TOL[dtype])
    torch.testing.assert_close(caches[0], caches[2], **TOL[dtype])
    assert torch.equal(caches[1], caches[3])  # v copied as it is
    assert caches[0].view(-1, kv_heads, dim)[slots[slots >= 0]].abs().sum() > 0


@needs_kernel
def test_rope_writes_a_float16_cache_under_a_float32_model():
    if not cpu_kernels._f16c():
        pytest.skip("this CPU has no F16C")
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 5 * 16, generator=g)
    cos, sin = torch.rand(3, 1, 16, generator=g), torch.rand(3, 1, 16, generator=g)
    caches = [torch.zeros(2, 4, 1, 16, dtype=torch.float16) for _ in range(2)]
    q = cpu_kernels.rope_write_kv_c(qkv, cos, sin, 3, 1, torch.tensor([5, 0, 2]), *caches)
    qk = qkv[:, :64].view(3, 4, 16)
    qk = qk * cos + rotate_half(qk) * sin
    torch.testing.assert_close(q, qk[:, :3])
    torch.testing.assert_close(caches[0].view(-1, 16)[[5, 0, 2]], qk[:, 3].half())
    torch.testing.assert_close(caches[1].view(-1, 16)[[5, 0, 2]], qkv[:, 64:].half())


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rope_writes_an_fp8_cache_rounded_as_torch_rounds(dtype, tokens):
    """`--kv-cache-dtype fp8`: k and v rounded to float8 e4m3 in the C write, bit for bit what torch's
    conversion gives for the same values (to nearest even, subnormals, saturation at +-448)."""
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * torch.logspace(-4, 3, dim).repeat(15)
    qkv = qkv.to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=g) * 100
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype)[:, None] for f in (torch.cos, torch.sin))
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    wide = [torch.zeros(8, 16, kv_heads, dim, dtype=dtype) for _ in range(2)]
    fp8 = [torch.zeros(8, 16, kv_heads, dim, dtype=torch.float8_e4m3fn) for _ in range(2)]
    q_wide = cpu_kernels.rope_write_kv_c(qkv, cos, sin, heads, kv_heads, slots, *wide)
    q_fp8 = cpu_kernels.rope_write_kv_c(qkv, cos, sin, heads, kv_heads, slots, *fp8)
    assert torch.equal(q_fp8, q_wide)
    for got, exact in zip(fp8, wide):
        assert torch.equal(got.view(torch.uint8), exact.to(torch.float8_e4m3fn).view(torch.uint8))
    assert fp8[1].float().abs().max() == 448  # saturated, not NaN
    assert (fp8[1].float().abs() < 2 ** -6).logical_and(fp8[1].float() != 0).any()  # subnormals written


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_silu_mul(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 1540, generator=g) * 4).to(dtype)  # 1540: a tail past the vector width
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul_c(gate_up), F.silu(gate) * up, **TOL[dtype])


@needs_kernel
def test_layer_kernels_refuse_misuse_instead_of_reading_wrong_memory():
    """The checked bindings (cpu_ops.py) name the function and the argument."""
    x, w = torch.randn(8, 16), torch.randn(16)
    with pytest.raises(ValueError, match="add_rms_norm: x must be contiguous"):
        cpu_kernels.add_rms_norm_c(torch.randn(16, 8).T, w, 1e-5)
    with pytest.raises(ValueError, match="silu_mul: out holds 4 elements, the sizes passed need T \\* I = 64"):
        cpu_kernels.ops.silu_mul(x, 8, 8, cpu_kernels.KV_KINDS[torch.float32], torch.empty(4))
    qkv, cos = torch.randn(2, 3 * 8), torch.randn(2, 8)
    caches = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    with pytest.raises(TypeError, match="rope_write_kv: slots must be torch.int64, not torch.int32"):
        cpu_kernels.ops.rope_write_kv(qkv, cos, cos, 2, 1, 1, 8, torch.tensor([0, 1], dtype=torch.int32), *caches,
                                      0, 0, torch.empty(2, 1, 8))
    with pytest.raises(TypeError, match="rope_write_kv"):  # an argument too many
        cpu_kernels.ops.rope_write_kv(qkv, cos, cos, 2, 1, 1, 8, torch.tensor([0, 1]), *caches, 0, 0,
                                      torch.empty(2, 1, 8), 0)
