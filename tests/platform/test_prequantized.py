"""GPTQ and AWQ 4-bit checkpoints: their packed integers, zeros and scales are read into q4
with the bits kept; the weights they stand for (s * (q - z), computed here from the integers
we packed) are what the engine multiplies by, and its logits are the float model's of those
weights. Checkpoints are written here in each format's documented layout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_tiny_model, tuned, without_bf16_kernels
from loraplex.kernels import quant
from loraplex.kernels.quant import dequantize
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.models.family import FUSED_PROJECTIONS
from loraplex.platform.models.registry import read_model_config
from test_model import prompt_logits

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i holds column 8c + AWQ_ORDER[i]


def quantize_ints(w: torch.Tensor, group: int, sym: bool):
    """Ints q [N, K] in 0..15, zeros z [G, N] in 1..15, float16 scales s [G, N]: w ~ s (q - z)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if sym:
        s = (g.abs().amax(-1) / 7).clamp(min=1e-4)
        z = torch.full_like(s, 8)
    else:
        low, high = g.amin(-1), g.amax(-1)
        s = ((high - low) / 14).clamp(min=1e-4)
        z = (-low / s).round().clamp(1, 15)
    s = s.half().float()
    q = (g / s[..., None] + z[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).long(), z.T.long().contiguous(), s.T.half().contiguous()


def pack_cols(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C / 8]: nibble i of word c holds column 8c + order[i]."""
    r, c = values.shape
    v = values.reshape(r, c // 8, 8)[..., list(order)].long()
    word = sum(v[..., i] << (4 * i) for i in range(8))
    return word.to(torch.int32)


def write_checkpoint(src, dst, method: str, group: int, sym: bool, fmt: str = "gptq"):
    """`src`'s float folder as a GPTQ (v1 or v2 zeros) or AWQ checkpoint; returns the dense
    weights it stands for, by peft module name."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    expected = {}
    for name in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors.pop(name)
        k = w.shape[1]
        q, z, s = quantize_ints(w, k if group == -1 else group, sym)
        prefix = name.removesuffix("weight")
        per_k = torch.arange(k) // (k if group == -1 else group)
        expected[name] = s.float()[per_k].T * (q - z.T[:, per_k]).float()
        if method == "gptq":
            tensors[prefix + "qweight"] = pack_cols(q).T.contiguous()  # along K: word [k / 8, n]
            tensors[prefix + "qzeros"] = pack_cols(z - (1 if fmt == "gptq" else 0))
            tensors[prefix + "g_idx"] = per_k.to(torch.int32)
            tensors[prefix + "bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # as AutoGPTQ writes
        else:
            tensors[prefix + "qweight"] = pack_cols(q.T.contiguous(), AWQ_ORDER)
            tensors[prefix + "qzeros"] = pack_cols(z, AWQ_ORDER)
        tensors[prefix + "scales"] = s
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                      "desc_act": False, "checkpoint_format": fmt} if method == "gptq" else
                                     {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"})
    (dst / "config.json").write_text(json.dumps(config))
    return expected


def dense_folder(src, dst, weights: dict):
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors.update({k: v.contiguous() for k, v in weights.items()})
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
    return dst


@pytest.mark.parametrize("method,group,sym,fmt", [("gptq", 32, True, "gptq"), ("gptq", 64, False, "gptq_v2"),
                                                  ("gptq", -1, False, "gptq"), ("awq", 32, False, None),
                                                  ("awq", 64, False, None)])
def test_checkpoint_bits_are_kept_and_served(tmp_path, method, group, sym, fmt, monkeypatch):
    without_bf16_kernels(monkeypatch)  # float32 math: compared at 1e-4 below
    src = make_tiny_model(tmp_path / "m", "llama", seed=5)
    folder = tmp_path / "q"
    expected = write_checkpoint(src, folder, method, group, sym, fmt or "gptq")
    engine = Engine(EngineConfig(model=str(folder), num_kv_blocks=32, dtype="float32"))
    assert engine.config.quantization == "q4"  # read from the checkpoint, as vLLM does
    for i, layer in enumerate(engine.core.executor.worker.model.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            want = torch.cat([expected[f"model.layers.{i}.{block}.{p}.weight"] for p in parts])
            got = dequantize(getattr(getattr(layer, block), fused).quantized)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the float model those weights make (lm_head as the q4 model keeps it: 8 bits)
    expected["lm_head.weight"] = dequantize(engine.core.executor.worker.model.lm_head.quantized)
    reference = Engine(EngineConfig(model=str(dense_folder(src, tmp_path / "d", expected)), dtype="float32",
                                    num_kv_blocks=32))
    ids = list(range(3, 40))
    torch.testing.assert_close(prompt_logits(engine, ids, 8), prompt_logits(reference, ids, 8), rtol=0, atol=1e-4)


def test_unsupported_checkpoints_are_refused_by_name(tmp_path):
    src = make_tiny_model(tmp_path / "m", "llama", seed=5)
    write_checkpoint(src, tmp_path / "q", "gptq", 32, True)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    for change, message in (({"bits": 8}, "bits=8"), ({"quant_method": "fp8"}, "'fp8' is not supported"),
                            ({"group_size": 16}, "group size 16")):
        (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], **change}}))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path / "q"), num_kv_blocks=16)
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="serve it with quantization q4"):
        LLM(str(tmp_path / "q"), num_kv_blocks=16, quantization="int8")
    assert read_model_config(tmp_path / "q").prequantized == ("gptq", 32, True)


def test_adapters_on_a_gptq_base_match_peft_on_its_weights(tmp_path, monkeypatch):
    """float32 math throughout, as peft's reference: greedy tokens of a tiny random model are near ties
    that a bf16 engine (or a bf16 kernel's rounding) breaks either way."""
    from conftest import make_peft_adapter, peft_greedy

    without_bf16_kernels(monkeypatch)
    tuned(monkeypatch, dense_dtype="float32")
    src = make_tiny_model(tmp_path / "m", "llama", seed=5)
    expected = write_checkpoint(src, tmp_path / "q", "gptq", 32, False)
    adapter = make_peft_adapter(src, tmp_path / "a", rank=8, seed=2)
    llm = LLM(str(tmp_path / "q"), num_kv_blocks=32, lora_modules={"a": str(adapter)}, dtype="float32",
              lora_dtype="float32")
    expected["lm_head.weight"] = dequantize(llm.engine.core.executor.worker.model.lm_head.quantized)
    dense = dense_folder(src, tmp_path / "d", expected)
    prompts = [list(range(3, 3 + n)) for n in (6, 11, 17)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapter=["a", None, "a"])
    assert [o.outputs[0].token_ids for o in outs] == peft_greedy(dense, [adapter, None, adapter], prompts, 6)
