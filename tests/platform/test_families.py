"""The model families of #40 (Qwen3, Gemma 2, Gemma 3, Phi-3, Granite; YaRN and LongRoPE) and of #50 (OLMo 2, SmolLM3:
each added as one declaration) against transformers
(float32 logits, greedy tokens) and peft (an adapter on every projection), on 2-layer random checkpoints whose
features are all switched on with values that change the numbers (docs/families.md)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_peft_adapter, make_tiny_model, peft_greedy
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.models.registry import read_model_config
from test_model import prompt_logits

WINDOW = 24  # shorter than the prompts: sliding layers drop the oldest keys
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 20.0]}

# variant -> (family, config overrides, engine settings, prompt length)
VARIANTS = {
    "qwen3": ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              {}, 70),
    "qwen3-yarn": ("qwen3", dict(head_dim=32, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                               "factor": 4.0, "original_max_position_embeddings": 32}),
                   {}, 70),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=1.0,
                              final_logit_softcapping=2.0, tie_word_embeddings=True), {}, 70),
    "gemma3": ("gemma3", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=2.0,
                              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1000000.0}}), {}, 70),
    # LongRoPE: the short factors where the engine never goes past the original context, the long ones beyond
    "phi3-longrope-short": ("phi3", dict(original_max_position_embeddings=32, rope_parameters=LONGROPE),
                            {"max_model_len": 32}, 22),
    "phi3-longrope-long": ("phi3", dict(original_max_position_embeddings=32, rope_parameters=LONGROPE,
                                        sliding_window=48), {}, 70),
    "granite": ("granite", dict(embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.5,
                                logits_scaling=4.0), {}, 70),
    "olmo2": ("olmo2", {}, {}, 70),
    # the second layer without RoPE, and (use_sliding_window) so the one that slides
    "smollm3": ("smollm3", dict(use_sliding_window=True, sliding_window=WINDOW, no_rope_layers=[1, 0],
                                tie_word_embeddings=True), {}, 70),
}
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def randomize_norms(folder) -> None:
    """transformers initialises every norm to ones (Gemma's to zeros, for 1 + w): random ones instead, so a norm
    we skip or misread changes the logits."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if tensor.dim() == 1 and "norm" in name:
            tensors[name] = tensor + 0.3 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            arch, overrides, _, _ = VARIANTS[variant]
            made[variant] = make_tiny_model(tmp_path_factory.mktemp(variant), arch, seed=3, **overrides)
            randomize_norms(made[variant])
        return made[variant]

    return get


def prompt(length: int) -> list[int]:
    return torch.randint(3, 448, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoint, variant):
    import transformers

    folder, (_, _, settings, length) = checkpoint(variant), VARIANTS[variant]
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=32, block_size=16, **settings))
    ids = prompt(length)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    for chunk in (length, 13):  # one pass, and chunks that cross block boundaries
        torch.testing.assert_close(prompt_logits(engine, ids, chunk), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_match_transformers_and_peft(checkpoint, variant, tmp_path):
    arch, _, settings, length = VARIANTS[variant]
    folder = checkpoint(variant)
    adapter = make_peft_adapter(folder, tmp_path / "adapter", rank=8, seed=5,
                                targets=PHI3_TARGETS if arch == "phi3" else None)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, lora_modules={"a": str(adapter)}, **settings)
    ids = prompt(length - NEW)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": ids}] * 2, GREEDY, adapter=[None, "a"])]
    assert got == peft_greedy(folder, [None, adapter], [ids, ids], NEW)
    assert got[0] != got[1]  # the adapter changes the tokens


def test_phi3_adapters_are_read_onto_the_fused_projections(checkpoint, tmp_path):
    """Phi-3's peft modules are our fused ones: one slice each; an adapter for separate q/k/v (a Llama of the
    same shapes) names the module a Phi-3 does not have."""
    from loraplex.adapters.peft_format import AdapterError, adapter_bytes, read_peft_adapter

    folder = checkpoint("phi3-longrope-short")
    config = read_model_config(folder)
    adapter = read_peft_adapter("p", make_peft_adapter(folder, tmp_path / "p", rank=4, targets=PHI3_TARGETS), config, 8)
    a, b = adapter.projections[(0, "qkv_proj")]
    assert a.shape == (4, config.hidden_size) and b.shape == (4, (config.num_heads + 2 * config.num_kv_heads)
                                                              * config.head_dim)
    assert adapter_bytes(config, 4, torch.float32) == adapter.nbytes
    llama = make_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(AdapterError, match="which a Phi3ForCausalLM does not have"):
        read_peft_adapter("l", make_peft_adapter(llama, tmp_path / "l", rank=4), config, 8)


def config_with(tmp_path, source, **changes):
    """A copy of `source`'s config.json with keys changed (None: removed)."""
    folder = tmp_path / "edited"
    folder.mkdir(exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return folder


def test_layer_windows_and_ropes_per_family(checkpoint, tmp_path):
    """Each family's layout of sliding layers and RoPEs, also from configs as transformers 4.x wrote them."""
    gemma2 = read_model_config(checkpoint("gemma2"))
    assert gemma2.layer_windows == (WINDOW, None) and gemma2.attn_logit_softcap == 1.0
    old_gemma2 = read_model_config(config_with(tmp_path, checkpoint("gemma2"), layer_types=None))
    assert old_gemma2.layer_windows == (WINDOW, None)  # transformers' default: every other layer slides
    old_gemma3 = read_model_config(config_with(
        tmp_path, checkpoint("gemma3"), layer_types=None, rope_parameters=None, num_hidden_layers=6, rope_theta=5e5,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=2e4))
    assert old_gemma3.layer_windows == (WINDOW,) * 5 + (None,)  # 5 local layers, then a global one
    assert old_gemma3.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5}
    assert old_gemma3.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 2e4}
    assert read_model_config(checkpoint("qwen3")).layer_windows == (None, WINDOW)  # from max_window_layers
    assert read_model_config(checkpoint("phi3-longrope-long")).layer_windows == (48, 48)
    assert read_model_config(checkpoint("granite")).layer_windows == (None, None)
    smollm3 = read_model_config(checkpoint("smollm3"))
    assert smollm3.layer_windows == (None, WINDOW) and smollm3.rope_layers == (True, False)
    by_interval = read_model_config(config_with(tmp_path, checkpoint("smollm3"), no_rope_layers=None,
                                                      layer_types=None, num_hidden_layers=8))
    assert by_interval.rope_layers == (True, True, True, False) * 2  # transformers' default: every 4th has none
    assert by_interval.layer_windows == (None, None, None, WINDOW) * 2


def test_a_layer_without_rope_reads_no_rotation(checkpoint):
    """SmolLM3's NoPE layer: its table is the identity, the other layer's turns (one table each)."""
    from loraplex.platform.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(read_model_config(checkpoint("smollm3")), 64)
    (cos0, sin0), (cos1, sin1) = rope.at(torch.arange(64), torch.float32)
    assert torch.equal(cos1, torch.ones_like(cos1)) and torch.equal(sin1, torch.zeros_like(sin1))
    assert not torch.equal(sin0, sin1)


def test_every_family_is_declared_once():
    """Each architecture maps to exactly one declaration, and each declaration to its architectures only."""
    from loraplex.platform.models.families import DECLARED
    from loraplex.platform.models.registry import FAMILIES, family_for

    names = [arch for family in FAMILIES.values() for arch in family.architectures]
    assert len({family.name for family in FAMILIES.values()}) == len(DECLARED)
    assert all(family_for(arch).architectures.count(arch) == 1 for arch in names)
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'.*Olmo2ForCausalLM"):
        family_for("GPT2LMHeadModel")


@pytest.mark.parametrize("changes,named", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 2.0}}, "low_freq_factor"),
    ({"hidden_act": "relu"}, "hidden activation 'relu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
])
def test_configs_we_cannot_serve_are_named(checkpoint, tmp_path, changes, named):
    with pytest.raises(ValueError, match=named):
        read_model_config(config_with(tmp_path, checkpoint("qwen3"), **changes))


def test_longrope_factors_must_fit_the_head(checkpoint, tmp_path):
    short = dict(LONGROPE, short_factor=[1.0] * 3)
    with pytest.raises(ValueError, match="short_factor has 3 entries, the head needs 8"):
        read_model_config(config_with(tmp_path, checkpoint("phi3-longrope-short"), rope_parameters=short))
