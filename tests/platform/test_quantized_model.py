"""`--quantization`: the engine on quantized weights gives what the float model with the
dequantized weights gives (logits, and token for token with adapters, against peft), and the
default model's q4 keeps its GGUF's bits: the same numbers as the float folder converted from it."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_peft_adapter, make_tiny_model, peft_greedy, tuned, without_bf16_kernels
from loraplex.kernels import cpu_kernels, quant
from loraplex.kernels.quant import dequantize
from loraplex.platform import LLM
from loraplex.platform.config import EngineConfig, quantized_activation_dtype
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.models.linear import Linear
from loraplex.platform.request import SamplingParams
from test_model import prompt_logits


def dequantized_folder(engine: Engine, src, dst):
    """A HF folder like `src` whose linear weights are the engine's dequantized ones (the float
    model the quantized one stands for)."""
    from loraplex.platform.models.family import FUSED_PROJECTIONS


    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model = engine.core.executor.worker.model
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            dense = dequantize(getattr(getattr(layer, block), fused).quantized)
            sizes = [tensors[f"model.layers.{i}.{block}.{p}.weight"].shape[0] for p in parts]
            for p, w in zip(parts, dense.split(sizes)):
                tensors[f"model.layers.{i}.{block}.{p}.weight"] = w.contiguous()
    head = dequantize(model.lm_head.quantized)
    if model.config.tie_word_embeddings:
        tensors["model.embed_tokens.weight"] = head  # tied: the float reference shares it too
    else:
        tensors["lm_head.weight"] = head
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    for path in src.iterdir():  # config and tokenizer as they are
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
    return dst


@pytest.mark.parametrize("method", ["q4", "int8"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_quantized_logits_are_the_dequantized_models(tmp_path, method, tied, dense, monkeypatch):
    """The prompt's matmuls on the kernels, or on a float32 GEMM of the dequantized weights (the
    bf16 GEMM's rounding is tested in tests/kernels/test_quant.py)."""
    without_bf16_kernels(monkeypatch)  # its bf16 rounding: test_quant.py and below
    tuned(monkeypatch, dense_dtype="float32", dense_tokens_f32=1 if dense else 1 << 30)
    folder = make_tiny_model(tmp_path / "m", "llama", seed=3, tie_word_embeddings=tied)
    engine = Engine(EngineConfig(model=str(folder), num_kv_blocks=16, quantization=method, dtype="float32"))
    linears = [m for m in engine.core.executor.worker.model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is not None for m in linears)
    assert all(m.weight is None for m in linears if m is not engine.core.executor.worker.model.lm_head.base_layer)  # no float copy kept
    reference = Engine(EngineConfig(model=str(dequantized_folder(engine, folder, tmp_path / "ref")),
                                    dtype="float32", num_kv_blocks=16))
    if tied:  # the embedding table is the float one in both; only the head is quantized
        reference.core.executor.worker.model.embed_tokens.weight.data.copy_(engine.core.executor.worker.model.embed_tokens.weight)
    ids = torch.randint(3, 448, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(prompt_logits(engine, ids, 7), prompt_logits(reference, ids, 7),
                               atol=2e-4, rtol=1e-4)


def bf16_valued(adapter):
    """The adapter's weights rounded to values bfloat16 holds (an adapter trained in bf16)."""
    from safetensors.torch import load_file

    path = adapter / "adapter_model.safetensors"
    save_file({k: v.bfloat16().float() for k, v in load_file(str(path)).items()}, str(path))
    return adapter


@pytest.mark.parametrize("lora_dtype", ["auto", "float32"])
def test_adapters_on_a_quantized_base_match_peft_on_the_dequantized_model(tmp_path, tiny_model_dir, lora_dtype,
                                                                           monkeypatch):
    """auto keeps adapters in bfloat16 on a quantized base (QLoRA-style): lossless for adapters
    trained in bf16; float32 keeps any adapter's float32 weights."""
    without_bf16_kernels(monkeypatch)
    # exact prefill GEMMs and float32 decode: the adapters' math, token for token
    tuned(monkeypatch, dense_dtype="float32", int8_activation_tokens=0)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, quantization="q4", dtype="float32", max_loras=4,
              lora_dtype=lora_dtype)
    assert llm.engine.adapters.dtype == (torch.bfloat16 if lora_dtype == "auto" else torch.float32)
    reference = dequantized_folder(llm.engine, tiny_model_dir, tmp_path / "ref")
    adapters = [make_peft_adapter(reference, tmp_path / f"a{i}", rank=8, seed=i, scale=0.5) for i in range(3)]
    if lora_dtype == "auto":
        adapters = [bf16_valued(a) for a in adapters]
    for i, path in enumerate(adapters):
        llm.load_adapter(f"a{i}", str(path))
    prompts = [torch.randint(3, 448, (9 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    which = [0, 1, 2, None]  # three adapters and the base, one batch
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        adapter=[None if a is None else f"a{a}" for a in which])
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == peft_greedy(reference, [None if a is None else adapters[a] for a in which], prompts, 6)


@pytest.mark.e2e
def test_default_model_q4_keeps_the_gguf_bits(default_model_dir, monkeypatch):
    """The folder was converted from the GGUF by dequantizing: the q4 engine's weights are the
    same numbers (checked per layer at load), so its logits are the float engine's."""
    without_bf16_kernels(monkeypatch)  # float32 math throughout
    q4 = Engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=32, quantization="q4", dtype="float32"))
    head = q4.core.executor.worker.model.lm_head.quantized
    assert head.kind == "q8" and head.group == 32  # the GGUF's Q8_0 output blocks
    qkv = q4.core.executor.worker.model.layers[0].self_attn.qkv_proj.quantized
    assert qkv.kind == "q4" and qkv.nbytes() * 5 < qkv.shape[0] * qkv.shape[1] * 4
    fp32 = Engine(EngineConfig(model=str(default_model_dir), dtype="float32", num_kv_blocks=32))
    ids = q4.tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    torch.testing.assert_close(prompt_logits(q4, ids, 16), prompt_logits(fp32, ids, 16), atol=2e-3, rtol=1e-3)


def test_quantization_settings_that_cannot_hold_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="float32 or bfloat16 activations, not float16"):
        EngineConfig(model=str(tiny_model_dir), quantization="q4", dtype="float16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=str(tiny_model_dir), quantization="q3")


@pytest.mark.parametrize("native", [False, True])
def test_auto_under_quantization_is_bf16_where_native(tiny_model_dir, native, monkeypatch):
    from loraplex.kernels import cpu_kernels

    from loraplex.kernels.autotune import TuneTable
    from loraplex.kernels.cpu_kernels import CpuCaps

    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: native)
    dtype, why = quantized_activation_dtype(CpuCaps.detect(), TuneTable())
    assert dtype == ("bfloat16" if native else "float32") and why
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, quantization="q4"))
    assert engine.config.dtype == dtype and engine.core.executor.worker.model.embed_tokens.weight.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("method", ["q4", "int8"])
def test_bf16_activations_on_a_quantized_base_match_the_bf16_float_model(tmp_path, method):
    """bfloat16 activations (auto on a CPU with native bf16) against the dequantized model in
    bfloat16: the same weights rounded to bf16 where a GEMM or AMX takes them, so the logits agree
    within bf16's rounding of activations (measured: max |diff| 0.016 on logits up to 2.7 for q4, int8 the
    same numbers)."""
    folder = make_tiny_model(tmp_path / "m", "llama", seed=5)
    engine = Engine(EngineConfig(model=str(folder), num_kv_blocks=16, quantization=method, dtype="bfloat16"))
    assert engine.core.executor.worker.model.layers[0].self_attn.qkv_proj.quantized is not None
    assert engine.core.executor.worker.model.embed_tokens.weight.dtype == torch.bfloat16
    reference = Engine(EngineConfig(model=str(dequantized_folder(engine, folder, tmp_path / "ref")),
                                    dtype="bfloat16", num_kv_blocks=16))
    ids = torch.randint(3, 448, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = prompt_logits(engine, ids, 7).float(), prompt_logits(reference, ids, 7).float()
    assert got.dtype == want.dtype and (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not cpu_kernels.amx_supported(), reason="the tile order is kept where AMX reads it")
def test_q4_on_amx_is_served_from_tile_order(tmp_path, monkeypatch):
    """On AMX every q4 projection is kept in the tile order (one stream through memory), and the logits
    are the ones the same kernel gives on the weights by rows."""
    folder = make_tiny_model(tmp_path / "m", "llama", seed=6)
    config = EngineConfig(model=str(folder), num_kv_blocks=16, quantization="q4", dtype="bfloat16")
    tiles = Engine(config)
    projections = [m.quantized for m in tiles.core.executor.worker.model.modules()
                   if isinstance(m, Linear) and m is not tiles.core.executor.worker.model.lm_head.base_layer]
    assert projections and all(w.tiles for w in projections)
    monkeypatch.setattr(quant, "for_this_cpu", lambda w, amx: w)
    by_rows = Engine(config)
    assert not by_rows.core.executor.worker.model.layers[0].mlp.down_proj.quantized.tiles
    ids = torch.randint(3, 448, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    assert torch.equal(prompt_logits(tiles, ids, 7), prompt_logits(by_rows, ids, 7))  # 7 tokens: AMX on both


def test_lora_dtype_is_the_models_or_bf16_under_float32(tiny_model_dir, monkeypatch):
    config = lambda **kw: EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, **kw)  # noqa: E731
    assert config(quantization="q4").torch_lora_dtype == torch.bfloat16  # QLoRA-style by default
    assert config(dtype="float32").torch_lora_dtype == torch.float32
    assert config(dtype="float32", lora_dtype="bfloat16").torch_lora_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="adapters are in the model's dtype, or bfloat16 under float32"):
        config(dtype="bfloat16", lora_dtype="float32")
    with pytest.raises(ValueError, match="lora_dtype must be"):
        config(lora_dtype="int8")
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")  # adapters stacked per dtype there
    with pytest.raises(ValueError, match="Triton / CUDA path"):
        Engine(config(dtype="float32", lora_dtype="bfloat16"))


def test_gguf_blocks_that_are_not_the_folders_weights_are_refused(tmp_path, tiny_model_dir):
    """A GGUF checked against a folder it was not converted from: a refusal, never wrong weights."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from loraplex.kernels.dispatch import kernel_config
    from loraplex.platform.models.registry import read_model_config
    from loraplex.platform.models.llama import load_model

    config = read_model_config(tiny_model_dir)
    path = tmp_path / "other.gguf"
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
              "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}
    for i in range(config.num_layers):
        for name, shape in shapes.items():
            raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), GGMLQuantizationType.Q4_1)
            writer.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="qkv_proj: quantized bits do not match the checkpoint.s float weight"):
        load_model(tiny_model_dir, config, kernel_config(torch.device("cpu"), torch.float32, quantization="q4"), 64,
                   gguf=path)


@pytest.mark.e2e
def test_default_model_q4_activation_roundings_stay_close_to_the_float_model(default_model_dir, monkeypatch):
    """q4 rounds activations where it pays (BENCHMARKS.md, "Quantized weights"): prefill-sized
    GEMMs in bfloat16 (forced here, emulated on CPUs without native bf16) and decode at batch 1
    on int8 activations. The weights are the float model's, so what differs is that rounding:
    measured max |logit diff| 0.44 on a logit range of 34 and 37 of 38 top-1 tokens the same."""
    tuned(monkeypatch, dense_dtype="bfloat16", dense_tokens_bf16=8)
    q4 = Engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=64, quantization="q4", dtype="float32"))
    fp32 = Engine(EngineConfig(model=str(default_model_dir), dtype="float32", num_kv_blocks=64))
    text = ("The history of the Roman Empire spans many centuries. It began when Augustus became the first "
            "emperor, and over time the empire grew to cover lands around the Mediterranean Sea, from Spain to Egypt.")
    ids = q4.tokenizer(text)["input_ids"]
    got, want = prompt_logits(q4, ids, 64), prompt_logits(fp32, ids, 64)
    assert (got - want).abs().max() < 1.0
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    monkeypatch.undo()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    q4_llm, fp32_llm = (LLM(str(default_model_dir), num_kv_blocks=64, dtype="float32", **kw)
                        for kw in ({"quantization": "q4"}, {}))
    for prompt in prompts:  # one at a time: batch-1 decode, the int8-activation path
        got, want = (llm.generate([prompt], params)[0].outputs[0].token_ids for llm in (q4_llm, fp32_llm))
        assert list(got) == list(want)


@pytest.mark.e2e
def test_default_model_q4_in_bf16_stays_close_to_the_bf16_model(default_model_dir):
    """q4 in bfloat16 (what auto serves on a CPU with native bf16) against the float model in bf16:
    measured max |logit diff| 0.84 on a logit range of 66 and every top-1 token the same with AMX
    (0.75 and 37 of 38 without it, float32 math on the exact weights), and the same 16 greedy tokens
    on all four prompts of one batch (decode calls of 4 tokens: AMX where present)."""
    from loraplex.kernels.cpu_kernels import native_bf16

    if not native_bf16():  # emulated bf16 is checked on a tiny model (test_model.py); here it costs minutes
        pytest.skip("this CPU has no native bf16: dtype auto serves q4 in float32 here")
    q4 = Engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=64, quantization="q4", dtype="bfloat16"))
    bf16 = Engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=64, dtype="bfloat16"))
    text = ("The history of the Roman Empire spans many centuries. It began when Augustus became the first "
            "emperor, and over time the empire grew to cover lands around the Mediterranean Sea, from Spain to Egypt.")
    ids = q4.tokenizer(text)["input_ids"]
    got, want = prompt_logits(q4, ids, 64).float(), prompt_logits(bf16, ids, 64).float()
    assert (got - want).abs().max() < 1.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    prompts = ["The capital of France is", "Write a haiku about the sea:", "One two three", "def fib(n):"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [[list(o.outputs[0].token_ids) for o in LLM(str(default_model_dir), num_kv_blocks=64, dtype="bfloat16",
                                                        **kw).generate(prompts, params)]
            for kw in ({"quantization": "q4"}, {})]
    assert sum(a == b for a, b in zip(*outs)) >= 3


@pytest.mark.e2e
def test_default_model_q4_bf16_head_tiles_stand_for_the_table_and_the_8bit_head(default_model_dir):
    """On AMX in bf16 the tied Q8_0 head's values (the embedding table, exactly) are packed into tiles once: they
    replace the plain table and take the head's calls of 3+ tokens with the 8-bit kernel's numbers (bf16 weights,
    float32 sums); 1-2 tokens stay on the 8-bit head."""
    from loraplex.kernels import cpu_kernels

    if not cpu_kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    q4 = Engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=32, quantization="q4", dtype="bfloat16"))
    model = q4.model
    head = model.lm_head
    assert head.head_tiles is not None and head.quantized.kind == "q8"
    assert model.embed_tokens.weight is None and head.weight is None
    ids = torch.tensor([1, 17, 4000, 49151])
    table = dequantize(head.quantized).to(torch.bfloat16)
    assert torch.equal(model.embed(ids), table[ids])
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 2, 3, 20):
        x = torch.randn(tokens, head.in_features, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            got = head(x)
        want = quant.amx_matmul(x, head.quantized) if tokens >= 3 else quant.quantized_matmul(x, head.quantized)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
        if tokens < 3:
            assert torch.equal(got, want)  # the 8-bit head itself


def test_dora_and_bias_adapters_on_a_quantized_base_match_peft_on_the_dequantized_model(tmp_path, tiny_model_dir,
                                                                                         monkeypatch):
    """DoRA's norms are taken over the weights the base serves (here dequantized), as peft takes them over the
    dequantized weight of a quantized layer."""
    without_bf16_kernels(monkeypatch)
    tuned(monkeypatch, dense_dtype="float32", int8_activation_tokens=0)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, quantization="q4", dtype="float32", max_loras=2,
              lora_dtype="float32")
    reference = dequantized_folder(llm.engine, tiny_model_dir, tmp_path / "ref")
    dora = make_peft_adapter(reference, tmp_path / "dora", rank=8, seed=1, use_dora=True)
    with safe_open(str(dora / "adapter_model.safetensors"), framework="pt") as f:  # trained magnitudes
        tensors = {k: f.get_tensor(k) * (1.2 if "magnitude" in k else 1.0) for k in f.keys()}
    save_file(tensors, str(dora / "adapter_model.safetensors"), metadata={"format": "pt"})
    bias = make_peft_adapter(reference, tmp_path / "bias", rank=8, seed=2, lora_bias=True)
    llm.load_adapter("dora", str(dora))
    llm.load_adapter("bias", str(bias))
    prompts = [list(range(3 + 5 * i, 12 + 6 * i)) for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapter=["dora", "bias", None])
    assert [list(o.outputs[0].token_ids) for o in outs] == peft_greedy(reference, [dora, bias, None], prompts, 6)
