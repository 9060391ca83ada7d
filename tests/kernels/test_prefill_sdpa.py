"""Prefill attention through torch SDPA (issue #39 point 7): the SDPA branch of `PagedAttention.forward_cuda`
run on CPU tensors equals the paged reference, and the setting is read once, when the layer is built."""

import pytest
import torch

from loraplex.kernels.custom_ops import PagedAttention, fresh_prompts, sdpa_prefill
from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.paged_attention import paged_attention_reference
from loraplex.platform.config import EngineConfig
from paged_case import make_case

TRITON = KernelConfig(backend="triton", device_type="cuda")


@pytest.mark.parametrize("batch,length,heads,kv_heads,dim,block_size,dtype", [
    (1, 37, 8, 2, 32, 16, torch.float32),  # GQA, the last block partly filled
    (3, 64, 4, 4, 64, 16, torch.float32),  # several prompts of one length, blocks exactly filled
    (2, 23, 6, 3, 32, 8, torch.bfloat16),
])
def test_sdpa_branch_equals_the_paged_reference(batch, length, heads, kv_heads, dim, block_size, dtype):
    query, kc, vc, meta, _, _ = make_case(batch + length, [length] * batch, [0] * batch, heads, kv_heads, dim,
                                          block_size, dtype)
    assert fresh_prompts(query, meta)
    out = sdpa_prefill(query, kc, vc, meta, dim ** -0.5)
    expected = paged_attention_reference(query, kc, vc, meta, dim ** -0.5)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **tol)


@pytest.mark.parametrize("query_lens,cached_lens", [
    ([5, 5], [0, 3]),  # a prefix hit: cached context
    ([5, 3], [0, 0]),  # fresh prompts of different lengths
    ([1, 1], [0, 0]),  # decode-sized: the graphs' case
    ([6, 1], [0, 5]),  # a prompt beside a decode token: T = 7 < 2 * 6
])
def test_other_steps_take_the_paged_kernel(query_lens, cached_lens):
    query, kc, vc, meta, _, _ = make_case(3, query_lens, cached_lens, 4, 2, 16, 8, torch.float32)
    assert not fresh_prompts(query, meta)
    layer = PagedAttention(0.25, TRITON, prefill="sdpa")
    layer.kernel = lambda q, k, v, m, s: paged_attention_reference(q, k, v, m, s)  # the Triton kernel's stand-in
    torch.testing.assert_close(layer(query, kc, vc, meta), paged_attention_reference(query, kc, vc, meta, 0.25))


def test_the_setting_is_read_once_when_the_layer_is_built():
    """sdpa binds `forward_cuda` as the layer's forward; triton and auto keep the plain kernel call: the setting
    itself is never consulted per call (the layer does not even keep it)."""
    sdpa = PagedAttention(0.25, TRITON, prefill="sdpa")
    assert sdpa.forward == sdpa.forward_cuda and not hasattr(sdpa, "prefill")
    for setting in ("triton", "auto"):
        layer = PagedAttention(0.25, TRITON, prefill=setting)
        assert "forward" not in vars(layer)  # the class's plain forward: the kernel, no branch
    native = PagedAttention(0.25, KernelConfig(backend="native"), prefill="sdpa")
    assert "forward" not in vars(native) and native.kernel is paged_attention_reference


def test_softcapped_and_windowed_layers_keep_the_paged_kernel():
    capped = PagedAttention(0.25, TRITON, softcap=30.0, prefill="sdpa")
    assert "forward" not in vars(capped)
    windowed = PagedAttention(0.25, TRITON, sliding_window=64, prefill="sdpa")
    assert "forward" not in vars(windowed)
    with pytest.raises(ValueError, match="prefill attention"):
        PagedAttention(0.25, TRITON, prefill="flash")


def test_the_engine_setting_reaches_every_layer(tiny_model_dir):
    """--prefill-attention goes through the resolved KernelConfig into each layer's PagedAttention."""
    from loraplex.platform.resolve import resolve

    import dataclasses

    import torch

    from loraplex.platform.models.llama import DecoderModel

    resolved = resolve(EngineConfig(model=str(tiny_model_dir), prefill_attention="sdpa"))
    assert resolved.kernels.prefill_attention == "sdpa"
    with torch.device("meta"):
        model = DecoderModel(resolved.model, 64, dataclasses.replace(resolved.kernels, backend="triton"))
    assert all(vars(layer.self_attn.attn).get("forward") is not None for layer in model.layers)


def test_engine_config_names_the_setting():
    assert EngineConfig(model="m").prefill_attention == "auto"
    assert EngineConfig(model="m", prefill_attention="sdpa").prefill_attention == "sdpa"
    with pytest.raises(ValueError, match="prefill_attention"):
        EngineConfig(model="m", prefill_attention="flash")
