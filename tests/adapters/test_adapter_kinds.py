"""Adapters as trainers write them beyond plain LoRA (issue 63): DoRA, rank_pattern / alpha_pattern, lora_bias,
norms in modules_to_save and trainable tokens, each giving peft's own greedy tokens, alone and in one batch with the other kinds, plain adapters and the base;
the combinations no one can define refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import jitter, make_peft_adapter, make_tiny_model, peft_greedy
from tests.adapters.test_embedding_adapters import EagerGraphs
from loraplex.adapters.peft_format import AdapterError, read_peft_adapter
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.models.registry import read_model_config

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [list(range(3 + 7 * i, 3 + 7 * i + 5 + 2 * i)) for i in range(11)]
KINDS = ("dora", "dora_part", "bias", "pattern", "norms", "tokens", "saved", "plain")
TRAINED = sorted({t for p in PROMPTS for t in p[::3]}) + [400, 401]  # ids the "tokens" adapter retrains


def kinds_for(base, root, fused: bool = False, biased: bool = False) -> dict:
    """One adapter of each kind (`fused`: a family whose checkpoint holds qkv_proj and gate_up_proj fused;
    `biased`: one whose q/k/v have biases, trained under bias="all" by one more adapter)."""
    q, v, down = ("qkv_proj", "qkv_proj", "down_proj") if fused else ("q_proj", "v_proj", "down_proj")
    trained = {"trained": jitter(make_peft_adapter(base, root / "trained", rank=4, seed=8, targets=[q], bias="all"),
                                 ".bias", 6)} if biased else {}
    return {**trained,
        "dora": jitter(make_peft_adapter(base, root / "dora", rank=8, seed=1, use_dora=True, targets=None if not fused
                                         else ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]), "magnitude", 1),
        # DoRA on some parts of a fused projection (q and v of q/k/v), with a rank of its own on one of them
        "dora_part": jitter(make_peft_adapter(base, root / "dora_part", rank=4, seed=2, use_dora=True,
                                              targets=sorted({q, v, down}), rank_pattern={v: 2}), "magnitude", 2),
        "bias": make_peft_adapter(base, root / "bias", rank=8, seed=3, lora_bias=True,
                                  targets=None if not fused else [q, "o_proj", down]),
        "pattern": make_peft_adapter(base, root / "pattern", rank=8, seed=4, targets=None if not fused else
                                     [q, "o_proj", "gate_up_proj", down],
                                     rank_pattern={q: 4, "layers.1.mlp.down_proj": 2},
                                     alpha_pattern={"o_proj": 3, down: 40}),
        # every norm ("norm" ends each norm's name: peft saves them all), beside LoRA on one projection
        "norms": jitter(make_peft_adapter(base, root / "norms", rank=4, seed=6, targets=[q],
                                          modules_to_save=["norm"]), "norm", 4),
        "tokens": jitter(make_peft_adapter(base, root / "tokens", rank=4, seed=7, targets=[v],
                                           trainable_token_indices=TRAINED), "trainable_tokens", 5),
        # a layer's whole MLP (down_proj: row-parallel under TP) and one attention projection of their own
        "saved": jitter(make_peft_adapter(base, root / "saved", rank=4, seed=9, targets=["o_proj"],
                                          modules_to_save=["layers.1.mlp", "qkv_proj" if fused else "k_proj"]),
                        ".weight", 7),
        "plain": make_peft_adapter(base, root / "plain", rank=8, seed=5),
    }


def tokens(llm, prompts, adapters):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapter=adapters)
    return [list(o.outputs[0].token_ids) for o in outs]


def llm_for(base, folders: dict, **kwargs):
    return LLM(str(base), dtype="float32", num_kv_blocks=96, lora_modules={k: str(v) for k, v in folders.items()},
               **kwargs)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds-llama")
    base = make_tiny_model(root / "base", "llama", seed=7)
    return base, kinds_for(base, root)


# qwen2: the base's own q/k/v bias, which DoRA's factor leaves alone; phi3: q/k/v and gate/up fused in the checkpoint
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_each_kind_alone_and_all_in_one_batch_give_peft_tokens(llama, tmp_path, arch):
    if arch == "llama":
        base, folders = llama
    else:
        base = make_tiny_model(tmp_path / "base", arch, seed=3)
        folders = kinds_for(base, tmp_path, fused=arch == "phi3", biased=arch == "qwen2")
    names = [*folders, None, "dora"]
    prompts = PROMPTS[:len(names)]
    want = peft_greedy(base, [folders.get(n) for n in names], prompts, NEW)
    llm = llm_for(base, folders)
    assert tokens(llm, prompts, names) == want
    for name, prompt, expected in zip(names[:2], prompts, want):  # alone, each in a batch of its own
        assert tokens(llm, [prompt], [name]) == [expected]


# qwen3: per-head q / k norms; gemma2: four norms a layer, each weight read as 1 + w; olmo2: q / k norms over all heads
@pytest.mark.parametrize("arch,overrides", [("qwen3", dict(head_dim=32)),
                                            ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16)),
                                            ("olmo2", {})])
def test_saved_norms_of_every_layout_give_peft_tokens(tmp_path, arch, overrides):
    base = make_tiny_model(tmp_path / "base", arch, seed=3, **overrides)
    folders = {"all": jitter(make_peft_adapter(base, tmp_path / "all", rank=4, seed=1, targets=["q_proj"],
                                               modules_to_save=["norm"]), "norm", 1),
               "one": jitter(make_peft_adapter(base, tmp_path / "one", rank=4, seed=2, targets=["v_proj"],
                                               modules_to_save=["post_attention_layernorm"]), "norm", 2)}
    names = ["all", "one", None]
    llm = llm_for(base, folders)
    assert tokens(llm, PROMPTS[:3], names) == peft_greedy(base, [folders.get(n) for n in names], PROMPTS[:3], NEW)
    assert {name for _, name in llm.engine.adapters.prefetch("one").norms} == {"post_attention_layernorm"}
    if arch == "qwen3":  # a norm inside the attention block, named with it
        qk = jitter(make_peft_adapter(base, tmp_path / "qk", rank=4, seed=3, targets=["o_proj"],
                                      modules_to_save=["self_attn.q_norm"]), "norm", 3)
        llm.load_adapter("qk", qk)
        assert {name for _, name in llm.engine.adapters.prefetch("qk").norms} == {"q_norm"}
        assert tokens(llm, PROMPTS[:1], ["qk"]) == peft_greedy(base, [qk], PROMPTS[:1], NEW)


# a head tied to the table takes the table's trained rows; Gemma 3 scales its rows inside the embedding module
@pytest.mark.parametrize("arch,overrides", [("llama", dict(tie_word_embeddings=True)),
                                            ("gemma3", dict(head_dim=16, tie_word_embeddings=True))])
def test_trainable_tokens_on_a_tied_table_give_peft_tokens(tmp_path, arch, overrides):
    base = make_tiny_model(tmp_path / "base", arch, seed=3, **overrides)
    folders = {"tokens": jitter(make_peft_adapter(base, tmp_path / "tokens", rank=4, seed=1, targets=["q_proj"],
                                                  trainable_token_indices={"embed_tokens": TRAINED}),
                                "trainable_tokens", 1)}
    names = ["tokens", None, "tokens"]
    llm = llm_for(base, folders)
    assert tokens(llm, PROMPTS[:3], names) == peft_greedy(base, [folders.get(n) for n in names], PROMPTS[:3], NEW)
    held = llm.engine.adapters.prefetch("tokens").tokens
    assert held["lm_head"] is held["embed_tokens"] and held["embed_tokens"][0].tolist() == sorted(TRAINED)


def test_an_adapters_own_tokenizer_serves_its_prompts_and_outputs(tmp_path):
    """A fine-tune that added tokens (rows a padded vocabulary already has, trained as trainable tokens) and saved
    its tokenizer: its requests are tokenized, templated and decoded with it; the base's and other adapters' are
    not; one saved unchanged is no overlay; a token past the model's rows is refused by name."""
    from transformers import AutoTokenizer

    base = make_tiny_model(tmp_path / "base", "llama", seed=3, tie_word_embeddings=True)
    size = len(AutoTokenizer.from_pretrained(base))
    folder = jitter(make_peft_adapter(base, tmp_path / "ov", rank=4, seed=1, targets=["q_proj"],
                                      trainable_token_indices=[size, size + 1]), "trainable_tokens", 1)
    own = AutoTokenizer.from_pretrained(base)
    own.add_tokens(["<|pirate|>", "<|parrot|>"])
    own.chat_template = "{% for m in messages %}<|pirate|>{{ m['content'] }}{% endfor %}"
    own.save_pretrained(folder)
    same = make_peft_adapter(base, tmp_path / "same", rank=4, seed=2, targets=["q_proj"])
    AutoTokenizer.from_pretrained(base).save_pretrained(same)
    llm = llm_for(base, {"ov": folder, "same": same})
    assert "tokenizer" in llm.engine.adapters.prefetch("ov").kinds
    assert llm.engine.adapters.prefetch("same").tokenizer is None
    text = "hello <|pirate|> world"
    outs = llm.generate([text] * 3, GREEDY, adapter=["ov", None, "same"])
    assert outs[0].prompt_token_ids == own(text).input_ids and size in outs[0].prompt_token_ids
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids != outs[0].prompt_token_ids
    assert [list(outs[0].outputs[0].token_ids)] == peft_greedy(base, [folder], [outs[0].prompt_token_ids], NEW)
    assert llm.engine.inputs.detokenize([size + 1], "tokens", "ov") == "<|parrot|>"
    assert llm.engine.inputs.detokenize([size + 1], "tokens") == ""
    assert llm.engine.inputs.chat_token_ids([{"role": "user", "content": "hi"}], adapter="ov")[0] == size
    assert llm.chat([{"role": "user", "content": "hi"}], GREEDY, adapter="ov")[0].prompt_token_ids[0] == size
    with pytest.raises(ValueError, match="got 1 adapters for 2 conversations"):
        llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY, adapter=["ov"])
    with pytest.raises(ValueError, match="'ov' brings a tokenizer of its own, which a mix cannot combine"):
        llm.generate([text], GREEDY, adapter=[{"ov": 0.5, "same": 0.5}])
    hashed = llm.engine.adapters.prefetch("ov").content_hash
    own.eos_token = "<|parrot|>"  # the adapter's own end token ends its outputs; its files change its hash
    own.save_pretrained(folder)
    llm.load_adapter("ov2", folder)
    assert llm.engine.adapters.prefetch("ov2").content_hash != hashed
    sampled = SamplingParams(temperature=0, max_tokens=NEW)
    assert size + 1 in llm.engine.inputs.process("r", text, sampled, "ov2").params.stop_token_ids
    assert size + 1 not in llm.engine.inputs.process("r", text, GREEDY, "ov2").params.stop_token_ids  # ignore_eos
    own.add_tokens([f"<|extra{i}|>" for i in range(60)])  # past the model's 448 rows
    own.save_pretrained(folder)
    with pytest.raises(AdapterError, match="its tokenizer adds tokens past the base model's 448 rows"):
        llm.load_adapter("big", folder)


def test_the_factors_and_patterns_are_read_as_peft_holds_them(llama):
    base, folders = llama
    config = read_model_config(base)
    llm = llm_for(base, {"dora": folders["dora"]})
    weights = llm.engine.adapters.prefetch("dora")
    assert weights.kinds == ("dora",) and weights.dora
    factor = weights.terms[(0, "qkv_proj")].factor
    assert factor.shape == (config.num_heads * config.head_dim + 2 * config.num_kv_heads * config.head_dim,)
    assert not torch.allclose(factor, torch.ones_like(factor))  # trained magnitudes: not the plain adapter
    pattern = read_peft_adapter("p", folders["pattern"], config, 16)
    assert pattern.kinds == ("lora", "rank_pattern", "alpha_pattern") and pattern.rank == 8
    a, b_t = pattern.projections[(1, "down_proj")]
    assert a.shape[0] == 2 and b_t.shape[0] == 2  # its own rank, not padded
    assert pattern.scale_of((1, "down_proj")) == 40 / 2 and pattern.scale_of((0, "o_proj")) == 3 / 8
    bias = read_peft_adapter("b", folders["bias"], config, 16)
    raw = load_file(folders["bias"] / "adapter_model.safetensors")
    assert torch.equal(bias.terms[(0, "down_proj")].bias,
                       raw["base_model.model.model.layers.0.mlp.down_proj.lora_B.bias"] * bias.scaling)
    assert bias.nbytes > read_peft_adapter("p", folders["plain"], config, 16).nbytes  # its biases count


def test_biases_take_a_mix_weight_and_dora_serves_alone(llama):
    base, folders = llama
    llm = llm_for(base, folders)
    alone = tokens(llm, PROMPTS[:2], ["bias", "plain"])
    mixes = [{"bias": 1.0, "plain": 0.0}, {"bias": 0.0, "plain": 1.0}]  # a weight of 0 takes the bias too
    assert tokens(llm, PROMPTS[:2], mixes) == alone
    with pytest.raises(ValueError, match="'dora' is a DoRA adapter .*, which a mix cannot combine; name it alone"):
        tokens(llm, PROMPTS[:1], [{"dora": 0.5}])
    assert tokens(llm, PROMPTS[:1], [{"dora": 1.0}]) == tokens(llm, PROMPTS[:1], ["dora"])  # weight 1: itself
    with pytest.raises(ValueError, match="'norms' brings norms of its own .* which a mix cannot combine"):
        tokens(llm, PROMPTS[:1], [{"norms": 0.5, "plain": 0.5}])
    with pytest.raises(ValueError, match="'tokens' adapts embed_tokens / lm_head, which a mix cannot combine"):
        tokens(llm, PROMPTS[:1], [{"tokens": 0.5, "plain": 0.5}])
    with pytest.raises(ValueError, match="'saved' brings projections or biases of its own .* which a mix cannot"):
        tokens(llm, PROMPTS[:1], [{"saved": 0.5, "plain": 0.5}])


def test_decode_graphs_leave_biases_and_dora_to_eager_steps(llama):
    base, folders = llama
    llm = llm_for(base, folders)
    runner = llm.engine.core.executor.worker.runner
    graphs = runner.graphs = EagerGraphs(runner)
    tokens(llm, PROMPTS[:3], ["pattern", "plain", None])
    assert graphs.replays == NEW - 1
    graphs.replays = 0
    for name in ("dora", "bias", "norms", "tokens", "saved"):
        tokens(llm, PROMPTS[:2], [name, "plain"])
    assert graphs.replays == 0
    graphs.fits = lambda num_tokens, with_lora, mix_passes=0: True  # graphs of mixes too
    tokens(llm, PROMPTS[:2], [{"bias": 0.5, "plain": 0.5}, "plain"])  # the bias's slot is in a mix's pass only
    assert graphs.replays == 0


def test_a_step_without_such_slots_pays_nothing_for_them(llama, monkeypatch):
    """A resident DoRA / bias / norms adapter costs the steps that do not use it nothing beyond a set test."""
    from loraplex.adapters.projection_extras import ProjectionExtras
    from loraplex.adapters.saved_norms import SavedNorms

    base, folders = llama
    llm = llm_for(base, folders)
    tokens(llm, PROMPTS[:3], ["dora", "bias", "norms"])  # resident from now on
    calls = []
    monkeypatch.setattr(ProjectionExtras, "apply", lambda self, y, *a: calls.append(1) or y)
    monkeypatch.setattr(SavedNorms, "apply", lambda self, *a: calls.append(1))
    tokens(llm, PROMPTS[:2], ["plain", None])
    assert calls == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_serves_every_kind(llama, tmp_path, arch):
    """DoRA's factor is read from the checkpoint's whole rows (the engine holds no model under TP): a rank's rows
    of it on q/k/v and gate/up, all of it on the row-parallel o / down, whose partial sums it scales."""
    if arch == "llama":
        base, folders = llama
    else:  # the base's own q/k/v bias
        base = make_tiny_model(tmp_path / "base", arch, seed=3)
        folders = kinds_for(base, tmp_path, biased=True)
    names = [*folders, None]
    want = peft_greedy(base, [folders.get(n) for n in names], PROMPTS[:len(names)], NEW)
    with LLM(str(base), tensor_parallel_size=2, dtype="float32", num_kv_blocks=96, grammar_compile_workers=0,
             lora_modules={n: str(folders[n]) for n in names if n}) as llm:
        assert tokens(llm, PROMPTS[:len(names)], names) == want


def test_deterministic_mode_serves_the_kinds_as_peft(llama):
    base, folders = llama
    names = ["dora", "bias", "pattern", "norms", "tokens", None]
    llm = llm_for(base, folders, deterministic=True)
    assert tokens(llm, PROMPTS[:6], names) == peft_greedy(base, [folders.get(n) for n in names], PROMPTS[:6], NEW)


@pytest.fixture(scope="module")
def empty(llama):
    return llm_for(llama[0], {})


def edit(folder, tmp_path, tensors=None, **changes):
    copy = shutil.copytree(folder, tmp_path / "bad")
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        path = copy / "adapter_model.safetensors"
        save_file(tensors(load_file(path)), path, metadata={"format": "pt"})
    return copy


def drop(part):
    return lambda tensors: {k: t for k, t in tensors.items() if part not in k}


@pytest.mark.parametrize("kind,changes,tensors,reason", [
    ("dora", {"lora_bias": True}, None, "DoRA with lora_bias is not supported"),
    ("dora", {"use_dora": False}, None, "a lora_magnitude_vector, but use_dora is false"),
    ("dora", {}, drop("layers.1.self_attn.k_proj.lora_magnitude"), "layer 1 k_proj: no lora_magnitude_vector"),
    ("bias", {"lora_bias": False}, None, "a lora_B bias, but lora_bias is false"),
    ("pattern", {"rank_pattern": {"q_proj": 0}}, None, "rank_pattern\\['q_proj'\\] must be an integer rank"),
    ("pattern", {"rank_pattern": {"q_proj": 32}}, None, "rank_pattern\\['q_proj'\\] must be an integer rank in"),
    ("pattern", {"alpha_pattern": {"q_proj": "big"}}, None, "alpha_pattern\\['q_proj'\\] must be a finite number"),
    ("pattern", {"rank_pattern": {"(q": 4}}, None, "pattern '\\(q' is not a valid regex"),
    ("pattern", {"rank_pattern": ["q_proj"]}, None, "rank_pattern must map module name patterns"),
    ("pattern", {"rank_pattern": {"q_proj": 4, "lm_head": 2}, "target_modules": ["q_proj", "lm_head"]}, None,
     "give lm_head a rank or alpha of its own"),
    ("dora", {"target_modules": ["q_proj", "embed_tokens"]}, None, "DoRA on \\['embed_tokens'\\] is not supported"),
    ("norms", {"modules_to_save": ["input_layernorm"]}, None,
     "unexpected weight '.*norm.weight' \\(modules_to_save lists \\['input_layernorm'\\]\\)"),
    ("norms", {"modules_to_save": ["norm", "rotary_emb"]}, None, "modules_to_save \\['rotary_emb'\\] is not"),
    ("norms", {"modules_to_save": ["norm", "mlp"]}, None, "modules_to_save lists \\['mlp'\\], but the folder holds"),
    ("saved", {"modules_to_save": ["layers.1.mlp"]}, None, "layer 0 k_proj: a full weight, but it is not in"),
    ("norms", {}, lambda t: {k: v for k, v in t.items() if "norm" not in k}, "modules_to_save lists \\['norm'\\], but"),
    ("norms", {}, lambda t: {**t, "base_model.model.model.norm.weight": torch.ones(3)},
     "norm weight of shape \\(3,\\) does not fit the served model's \\(64,\\)"),
    ("norms", {}, lambda t: {**t, "base_model.model.model.layers.9.input_layernorm.weight": torch.ones(64)},
     "is for a norm the base model does not have"),
    ("tokens", {"trainable_token_indices": TRAINED[:-1] + [448]}, None,
     "trainable tokens \\[448\\] fall outside the base model's vocabulary of 448 rows"),
    ("tokens", {"trainable_token_indices": TRAINED[1:]}, None, "trainable token rows of shape"),
    ("tokens", {"trainable_token_indices": [5, 5]}, None, "lists a token id twice"),
    ("tokens", {"trainable_token_indices": {"q_proj": [5]}}, None, "trainable_token_indices on 'q_proj' is not"),
    ("tokens", {"modules_to_save": ["embed_tokens"]}, None, "has trainable tokens and a LoRA or a full weight"),
    ("tokens", {}, drop("trainable_tokens"), "but the folder holds trainable token rows for \\[\\]"),
    ("bias", {}, lambda t: {**t, "base_model.model.model.layers.0.mlp.down_proj.lora_B.default.bias": torch.ones(64)},
     "are the same tensor under two spellings"),
])
def test_refusals_name_what_cannot_be_served(llama, empty, tmp_path, kind, changes, tensors, reason):
    with pytest.raises(AdapterError, match=f"adapter 'bad' .*{reason}"):
        empty.load_adapter("bad", edit(llama[1][kind], tmp_path, tensors, **changes))
    assert "bad" not in {a.name for a in empty.engine.adapters.list()}


def test_patterns_share_one_matching_budget(llama):
    from loraplex.adapters.variants import ModulePatterns

    patterns = ModulePatterns({"r": 8, "rank_pattern": {"q_proj": 4}}, 16, AdapterError)
    assert patterns.rank_and_scale("model.layers.0.self_attn.q_proj", AdapterError)[0] == 4
    patterns.left[0] = 0.0  # spent
    with pytest.raises(AdapterError, match="take longer than 2s to match in all"):
        patterns.rank_and_scale("model.layers.1.self_attn.q_proj", AdapterError)


def test_a_tokenizer_config_reaches_nothing_outside_the_folder():
    from loraplex.adapters.tokenizer_overlay import _inert

    config = json.loads(_inert(json.dumps({"auto_map": {"AutoTokenizer": ["x.Tok", None]}, "vocab_file": "/etc/passwd",
                                           "model_max_length": 5}).encode(), AdapterError))
    assert config == {"model_max_length": 5}


def test_every_rank_agrees_that_a_bias_on_row_parallel_projections_runs_eagerly(llama, tmp_path):
    """Rank 1 holds no bias of a row-parallel projection (rank 0 adds it), yet runs the step eagerly as rank 0."""
    from loraplex.adapters.slots import LoRASlots
    from loraplex.platform.models.sharding import plan_for
    from loraplex.platform.worker.worker import shard_adapter

    base, _ = llama
    config = read_model_config(base)
    folder = make_peft_adapter(base, tmp_path / "o", rank=4, seed=1, targets=["o_proj"], lora_bias=True)
    weights = read_peft_adapter("o", folder, config, 16)
    shard = shard_adapter(weights, plan_for(config, 2, 1))
    assert all(t.bias is None for t in shard.terms.values())
    slots = LoRASlots(config, 2, torch.float32)
    slots.load(0, shard)
    assert slots.eager_slots == {0}


def test_dora_without_the_base_weights_is_refused_by_name(llama):
    base, folders = llama
    with pytest.raises(AdapterError, match="DoRA needs the served base weights .*read without a model"):
        read_peft_adapter("d", folders["dora"], read_model_config(base), 16)


@pytest.mark.e2e
def test_every_kind_on_the_default_model_gives_peft_tokens_in_one_batch(default_model_dir, tmp_path):
    folders = kinds_for(default_model_dir, tmp_path)
    names = [*KINDS, None]
    llm = llm_for(default_model_dir, folders)
    assert tokens(llm, PROMPTS[:len(names)], names) == peft_greedy(default_model_dir, [folders.get(n) for n in names],
                                                                   PROMPTS[:len(names)], NEW)
