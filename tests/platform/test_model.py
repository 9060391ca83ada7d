"""Our Llama-family model against transformers' on tiny random checkpoints of each family."""

import json

import pytest
import torch

from conftest import forced_kernels, make_tiny_model
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.request import SamplingParams
from loraplex.platform.core.scheduler import SchedulerOutput

VARIANTS = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
}


def prompt_logits(engine: Engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every prompt position, computed chunk by chunk through the paged cache."""
    req = engine.inputs.process("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    rows = []
    while req.num_computed_tokens < len(ids):
        n = min(chunk, len(ids) - req.num_computed_tokens)
        assert engine.core.kv.allocate_slots(req, n) is not None
        with torch.inference_mode():
            step = engine.core.batch.build(SchedulerOutput([(req, n)]), {}).inputs
            hidden = engine.core.executor.worker.runner.forward(step)
            rows.append(engine.core.executor.worker.model.compute_logits(hidden))
        req.num_computed_tokens += n
    engine.core.kv.forget(req)
    return torch.cat(rows)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    import transformers

    arch, overrides = VARIANTS[variant]
    folder = make_tiny_model(tmp_path / variant, arch, seed=1, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=32, block_size=16))
    ids = torch.randint(3, 448, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    for chunk in (70, 13):  # one pass, and chunks that cross block boundaries
        got = prompt_logits(engine, ids[0].tolist(), chunk)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    if variant == "qwen2-qkv-bias":
        assert engine.core.executor.worker.model.layers[0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_are_close_to_a_reference_in_that_dtype(tiny_model_dir, dtype):
    """bf16 / fp16 end to end (KV cache included; chunks of 16 and decode-sized ones, so both the C
    attention kernel and the reference path run) against transformers in the same dtype, and
    both against float32: emulated bf16 is checked here too, where the CPU lacks it natively."""
    import transformers

    half = getattr(torch, dtype)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, num_kv_blocks=16))
    assert engine.core.executor.worker.model.embed_tokens.weight.dtype == half and engine.core.executor.worker.runner.kv_cache.dtype == half
    ids = list(range(3, 40))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=half).eval()
    exact = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, fp32 = ref(torch.tensor([ids])).logits[0].float(), exact(torch.tensor([ids])).logits[0]
    for chunk in (16, 1):
        got = prompt_logits(engine, ids, chunk).float()
        ref_error = (expected - fp32).abs().max().item()
        assert (got - fp32).abs().max().item() <= 2 * ref_error + 1e-2  # as close to fp32 as transformers is
        torch.testing.assert_close(got, expected, atol=4 * ref_error + 1e-2, rtol=0)
        assert (got.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.9


def test_unsupported_architecture_is_named(tmp_path, tiny_model_dir):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        Engine(EngineConfig(model=str(folder)))


def test_missing_weight_is_a_clear_error(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        Engine(EngineConfig(model=str(folder)))


@pytest.mark.parametrize("tied", [False, True])
def test_packed_weights_give_the_same_logits_without_a_plain_copy(tmp_path, tied, monkeypatch):
    """Packed for oneDNN or plain rows (chunks of 7 tokens: our float32 kernel, where C kernels build)."""
    from loraplex.kernels import cpu_kernels
    from loraplex.kernels.linear_methods import can_pack
    from loraplex.platform.models.linear import Linear

    if not can_pack(torch.float32, False):
        pytest.skip("no oneDNN in this torch build")
    kernel_calls = []
    kernel = cpu_kernels.f32_matmul_c
    monkeypatch.setattr(cpu_kernels, "f32_matmul_c", lambda x, w: kernel_calls.append(x.shape) or kernel(x, w))
    folder = make_tiny_model(tmp_path / "m", "llama", seed=2, tie_word_embeddings=tied)
    ids = torch.randint(3, 448, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for pack in (False, True):
        engine = Engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=16, pack_weights=pack))
        logits[pack] = prompt_logits(engine, ids, 7)
        if not pack:
            assert bool(kernel_calls) == (cpu_kernels.library() is not None)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)
    model = engine.core.executor.worker.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert all(m.weight is None for m in linears if m is not model.lm_head.base_layer)  # no second copy kept
    assert (model.lm_head.weight is model.embed_tokens.weight) if tied else model.lm_head.weight is None
    assert model.layers[0].mlp.down_proj.dense_weight().shape == (model.config.hidden_size,
                                                                   model.config.intermediate_size)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}),
                                            ("llama", {"hidden_size": 48, "intermediate_size": 96})])
def test_bf16_weights_on_amx_are_packed_for_the_tile_kernel(tmp_path, arch, overrides):
    """A bf16 model on a CPU with AMX multiplies by our tile kernel (not oneDNN) with the logits of the plain bf16
    weights, to the rounding of sums taken in another order: tied embeddings, qkv biases (qwen2), and a model whose
    hidden size is no multiple of 32 (those layers stay on oneDNN, down_proj's 96 inputs go to the tiles);
    `dense_weight` gives the weight back exactly."""
    from loraplex.kernels import cpu_kernels
    from loraplex.platform.models.linear import Linear

    if not cpu_kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    folder = make_tiny_model(tmp_path / "m", arch, seed=2, **overrides)
    ids = torch.randint(3, 448, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, engines = {}, {}
    for pack in (False, True):
        engines[pack] = Engine(EngineConfig(model=str(folder), dtype="bfloat16", num_kv_blocks=16, pack_weights=pack))
        logits[pack] = prompt_logits(engines[pack], ids, 7)
    torch.testing.assert_close(logits[True], logits[False], atol=0.05, rtol=0.02)
    plain, model = engines[False].core.executor.worker.model, engines[True].core.executor.worker.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    on_tiles = [m.in_features % 32 == 0 for m in linears]
    assert any(on_tiles) and all((getattr(m, "amx_packed", None) is not None) == tiles
                                 and (getattr(m, "packed", None) is None) == tiles
                                 for m, tiles in zip(linears, on_tiles))
    assert all(m.weight is None for m in linears if m is not model.lm_head.base_layer)
    assert torch.equal(model.layers[0].mlp.down_proj.dense_weight(), plain.layers[0].mlp.down_proj.weight)
    if overrides.get("tie_word_embeddings"):  # one copy of the table: the head's tiles
        assert model.embed_tokens.weight is None and model.lm_head.weight is None
        every = torch.arange(model.config.vocab_size)
        assert torch.equal(model.embed(every), plain.embed_tokens.weight)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layer_kernels_run_and_match_the_pytorch_ops(tiny_model_dir, dtype, monkeypatch):
    """On CPU each layer's residual add + norm, RoPE + KV write and SiLU * up run as single C
    calls; the logits equal those of the PyTorch ops they replace (float32: to rounding order;
    bfloat16: they round where those ops round)."""
    from loraplex.kernels import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler here")
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, num_kv_blocks=16))
    ids = list(range(3, 40))
    calls = []
    for name in ("add_rms_norm_c", "rope_write_kv_c", "silu_mul_c"):
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    fused = prompt_logits(engine, ids, 16).float()
    layers = engine.core.executor.worker.model.config.num_layers
    assert calls.count("rope_write_kv_c") == calls.count("silu_mul_c") == 3 * layers  # 3 chunks of 16 / 16 / 5
    assert calls.count("add_rms_norm_c") == 3 * (2 * layers + 1)
    with forced_kernels("torch"):  # the PyTorch ops, chosen when the engine is built
        plain_engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, num_kv_blocks=16))
    plain = prompt_logits(plain_engine, ids, 16).float()
    assert len(calls) == 3 * (4 * layers + 1)  # the torch engine made none
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=0)
    torch.testing.assert_close(fused, plain, **tol)
