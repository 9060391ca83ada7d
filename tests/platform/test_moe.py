"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers and peft on tiny
random checkpoints: routers with random weights, so tokens pick different experts."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import jitter, make_peft_adapter, make_tiny_model, peft_greedy
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.models.registry import FAMILIES as SUPPORTED_ARCHITECTURES
from loraplex.platform.models.experts import lora_refusal
from loraplex.platform.models.moe import SparseMoEBlock
from loraplex.platform.models.registry import read_model_config
from test_model import prompt_logits

# 4 experts, top-2; Qwen2-MoE: a shared expert and a dense layer 1, weights not renormalised;
# Qwen3-MoE: layer 0 dense by decoder_sparse_step, renormalised
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              decoder_sparse_step=2, norm_topk_prob=True)),
}
FAMILY_PARAMS = [pytest.param(f, marks=pytest.mark.skipif(FAMILIES[f][0] not in SUPPORTED_ARCHITECTURES,
                                                          reason=f"{FAMILIES[f][0]} not registered yet"))
                 for f in FAMILIES]
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [list(range(3 + i, 3 + i + 6 + 5 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> its tiny checkpoint, built once for the module on first use."""
    root, built = tmp_path_factory.mktemp("moe"), {}

    def get(family: str):
        if family not in built:
            built[family] = make_tiny_model(root / family, family, seed=3, **FAMILIES[family][1])
        return built[family]

    return get


def recorded_routes(engine: Engine, monkeypatch) -> list[torch.Tensor]:
    """Every sparse block's chosen experts [T, k], call by call."""
    routes = []
    for layer in engine.core.executor.worker.model.layers:
        block = sparse_block(layer)
        if block is not None:
            route = block.route
            monkeypatch.setattr(block, "route", lambda x, lora=None, _r=route: routes.append(_r(x)[1]) or _r(x, lora))
    return routes


def sparse_block(layer) -> SparseMoEBlock | None:
    """The layer's MoE block (inside the LoRA wrapper the engine puts around it), or None."""
    block = getattr(layer.mlp, "base_layer", layer.mlp)
    return block if isinstance(block, SparseMoEBlock) else None


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_logits_match_transformers(models, family, monkeypatch):
    import transformers

    folder = models(family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=32, block_size=16))
    routes = recorded_routes(engine, monkeypatch)
    ids = torch.randint(3, 448, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    for chunk in (70, 13):  # one pass, and chunks that cross block boundaries
        got = prompt_logits(engine, ids[0].tolist(), chunk)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    chosen = {tuple(sorted(pair)) for pair in routes[0].tolist()}
    assert len(chosen) >= 4  # tokens really go to different experts
    sparse = [sparse_block(layer) is not None for layer in engine.core.executor.worker.model.layers]
    assert sparse == {"mixtral": [True, True], "qwen2_moe": [True, False], "qwen3_moe": [False, True]}[family]


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_greedy_tokens_match_transformers(models, family):
    folder = models(family)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)  # prompts in chunks
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert got == peft_greedy(folder, [None] * len(PROMPTS), PROMPTS, NEW)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_attention_adapter_matches_peft(models, family, tmp_path):
    folder = models(family)
    adapter = make_peft_adapter(folder, tmp_path / "attn", rank=8, seed=5,  # and the vocabulary modules
                                targets=["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head"])
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, lora_modules={"attn": str(adapter)})
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts, GREEDY, adapter=["attn"] * 3 + [None] * 3)]
    assert got[:3] == peft_greedy(folder, [adapter] * 3, PROMPTS, NEW)
    assert got[:3] != got[3:]  # the adapter changes the tokens


def moe_adapters(folder, root, family: str) -> dict:
    """LoRA on the experts (peft's target_parameters on the fused 3-D weights), on the router, on both with the
    shared expert (Qwen2-MoE), and a plain one on the attention."""
    shared = ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"] if family == "qwen2_moe" else []
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return {"experts": make_peft_adapter(folder, root / "experts", rank=4, seed=1, targets=["q_proj"],
                                         target_parameters=experts),
            "router": make_peft_adapter(folder, root / "router", rank=4, seed=2, targets=["v_proj"],
                                        target_parameters=["mlp.gate.weight"]),
            "all": make_peft_adapter(folder, root / "all", rank=4, seed=3, targets=["q_proj", *shared],
                                     target_parameters=["mlp.gate.weight", *experts]),
            "plain": make_peft_adapter(folder, root / "plain", rank=8, seed=4, targets=["q_proj", "v_proj"]),
            # the other kinds beside them: DoRA and saved norms on the attention side
            "dora": jitter(make_peft_adapter(folder, root / "dora", rank=4, seed=5, targets=["q_proj", "o_proj"],
                                             use_dora=True), "magnitude", 1),
            "norms": jitter(make_peft_adapter(folder, root / "norms", rank=4, seed=6, targets=["v_proj"],
                                              modules_to_save=["norm"]), "norm", 2)}


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_lora_on_routers_experts_and_shared_experts_matches_peft_in_one_batch(models, family, tmp_path):
    folder = models(family)
    adapters = moe_adapters(folder, tmp_path, family)
    names = ["experts", "router", "all", "plain", None, "all", "dora", "norms"]
    prompts = PROMPTS + PROMPTS + PROMPTS[:2]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, lora_modules={k: str(v) for k, v in adapters.items()})
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                        adapter=names)]
    assert got == peft_greedy(folder, [adapters.get(n) for n in names], prompts, NEW)
    kinds = llm.engine.adapters.prefetch("all").kinds
    assert kinds == ("lora", "experts", "router", "shared_expert")[:4 if family == "qwen2_moe" else 3]
    with pytest.raises(ValueError, match="'all' adapts a mixture-of-experts layer .* which a mix cannot combine"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, adapter=[{"all": 0.5, "plain": 0.5}])


def test_tensor_parallel_splits_the_adapters_experts_with_the_experts(models, tmp_path):
    folder = models("qwen2_moe")
    adapters = moe_adapters(folder, tmp_path, "qwen2_moe")
    names = ["all", "experts", None]
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, grammar_compile_workers=0,
             lora_modules={n: str(adapters[n]) for n in names if n}) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                            adapter=names)]
    assert got == peft_greedy(folder, [adapters.get(n) for n in names], PROMPTS, NEW)


def per_expert_copy(src, dst, family: str, config) -> object:
    """`src` (LoRA on the fused experts, through target_parameters) as older transformers' peft wrote the same
    adapter: one LoRA per expert and projection (Mixtral's w1 / w3 / w2 under block_sparse_moe)."""
    shutil.copytree(src, dst)
    tensors, out = load_file(dst / "adapter_model.safetensors"), {}
    experts, hidden, inter = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    for key, tensor in tensors.items():
        if ".experts." not in key:
            out[key.replace(".mlp.gate.", f".{block}.gate.")] = tensor
            continue
        if ".lora_B." in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        a, b = tensor.reshape(experts, -1, tensor.shape[1]), b.reshape(b.shape[0], -1, experts)
        prefix = key.split(".mlp.experts")[0] + f".{block}.experts"
        for e in range(experts):
            parts = {down: (a[e], b[:, :, e])} if a.shape[2] == inter and b.shape[0] == hidden else \
                {gate: (a[e], b[:inter, :, e]), up: (a[e], b[inter:, :, e])}
            for name, (a_e, b_e) in parts.items():
                out[f"{prefix}.{e}.{name}.lora_A.weight"] = a_e.clone()
                out[f"{prefix}.{e}.{name}.lora_B.weight"] = b_e.clone()
    save_file(out, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["target_modules"] = [*cfg["target_modules"], gate, up, down, "gate"]
    cfg["target_parameters"] = None
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_per_expert_adapters_of_older_transformers_serve_as_the_fused_form(models, family, tmp_path):
    folder = models(family)
    fused = moe_adapters(folder, tmp_path, family)["all"]
    legacy = per_expert_copy(fused, tmp_path / "legacy", family, read_model_config(folder))
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, lora_modules={"fused": str(fused),
                                                                          "legacy": str(legacy)})
    names = ["legacy", "fused", "legacy"]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                        adapter=names)]
    assert got == peft_greedy(folder, [fused] * 3, PROMPTS, NEW)
    assert "experts" in llm.engine.adapters.prefetch("legacy").kinds


def test_lora_refusal_reads_layers():
    """A dense MLP module is fine in a dense layer and refused in a sparse one (a wrong base's adapter); a shared
    expert's and the experts' own (per expert or fused) are served; dense models refuse nothing here."""
    from loraplex.platform.models.experts import MoEConfig
    from loraplex.platform.models.families import QWEN3_MOE

    raw = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, num_hidden_layers=2,
               decoder_sparse_step=2)
    config = type("Config", (), {"moe": MoEConfig.from_raw(raw, QWEN3_MOE.experts, "Qwen3MoeForCausalLM"),
                                 "architecture": "Qwen3MoeForCausalLM"})()
    key = "base_model.model.model.layers.{}.mlp.{}.lora_A.weight"
    assert lora_refusal(config, {"target_modules": ["gate_proj", "q_proj"]}, [key.format(0, "gate_proj")]) is None
    assert "model.layers.1.mlp.up_proj" in lora_refusal(config, {}, [key.format(1, "up_proj")])
    assert lora_refusal(config, {"target_modules": ["w1", "q_proj"]}, [key.format(1, "experts.3.down_proj")]) is None
    assert lora_refusal(config, {}, [key.format(1, "shared_expert.up_proj"), key.format(1, "experts")]) is None
    assert lora_refusal(type("Dense", (), {"moe": None})(), {"target_modules": ["gate"]}, []) is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_expert_checkpoints_load(models, family, tmp_path):
    """transformers 5's own layout (experts.gate_up_proj [E, 2I, H], Mixtral's block named mlp) gives the
    logits of the per-expert layout save_pretrained writes by default."""
    import transformers
    from safetensors import safe_open

    folder, fused = models(family), tmp_path / "fused"
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref.save_pretrained(fused, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, fused / name)
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    ids = list(range(5, 40))
    logits = [prompt_logits(Engine(EngineConfig(model=str(f), dtype="float32", num_kv_blocks=16)), ids, 16)
              for f in (folder, fused)]
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_expert_matmul_paths_agree(models):
    """grouped_mm, one matmul per expert used (where grouped_mm does not take the device and dtype) and
    every expert masked (under CUDA graph capture) give the same numbers, and the block the same output."""
    from loraplex.platform.models.moe import grouped_matmul, looped_matmul, masked_matmul

    engine = Engine(EngineConfig(model=str(models("mixtral")), dtype="float32", num_kv_blocks=16))
    block = engine.core.executor.worker.model.layers[0].mlp
    x = torch.randn(23, engine.core.executor.worker.model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([0] * 9 + [2] * 14)  # expert 1 and 3 unused
    counts = torch.tensor([9, 0, 14, 0], dtype=torch.int32)
    with torch.inference_mode():
        grouped = grouped_matmul(x, block.w13, counts)
        torch.testing.assert_close(looped_matmul(x, block.w13, counts), grouped, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(masked_matmul(x, block.w13, ids), grouped, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grouped[9:], x[9:] @ block.w13[2].T, atol=1e-5, rtol=1e-5)
        assert block.grouped
        fused = block(x)
        block.grouped = False
        torch.testing.assert_close(block(x), fused, atol=1e-6, rtol=1e-6)


def test_bf16_logits_are_close_to_transformers_in_bf16(models):
    import transformers

    folder = models("qwen2_moe")
    ids = list(range(3, 40))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    exact = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, fp32 = ref(torch.tensor([ids])).logits[0].float(), exact(torch.tensor([ids])).logits[0]
    got = prompt_logits(Engine(EngineConfig(model=str(folder), dtype="bfloat16", num_kv_blocks=16)), ids, 16).float()
    ref_error = (expected - fp32).abs().max().item()
    assert (got - fp32).abs().max().item() <= 2 * ref_error + 1e-2


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantization_is_refused_clearly(models, quantization):
    with pytest.raises(ValueError, match=f"quantization {quantization} is not supported for MixtralForCausalLM"):
        Engine(EngineConfig(model=str(models("mixtral")), quantization=quantization, dtype="float32",
                            num_kv_blocks=16))


def test_moe_config_is_read_from_config_json(models):
    moe = read_model_config(models("qwen2_moe")).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_size) == (4, 2, 32, 48)
    assert moe.dense_layers == (1,) and not moe.renormalize and not moe.float_weights
    mixtral = read_model_config(models("mixtral")).moe
    assert mixtral.renormalize and mixtral.float_weights and mixtral.dense_layers == ()
