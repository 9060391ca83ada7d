"""Adapters on the embedding table and the LM head (LoRA, modules_to_save, changed base layers), served per
slot in one batch with plain adapters and base requests, each giving peft's own greedy tokens."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_all_blocks_free, make_peft_adapter, make_tiny_model, peft_greedy
from loraplex.adapters.peft_format import AdapterError, read_peft_adapter
from loraplex.adapters.registry import AdapterRegistry
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.models.registry import read_model_config

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [list(range(3 + 7 * i, 3 + 7 * i + 5 + 2 * i)) for i in range(6)]


def perturb(folder, pattern: str, seed: int):
    """Changes the full weights peft saved (copies of the base's when saved): a replacement the engine left
    out, or took from the base model, then gives other tokens."""
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    hits = [key for key in tensors if re.search(pattern, key)]
    assert hits, f"no saved weight matches {pattern}"
    for key in hits:
        tensors[key] = tensors[key] + 0.08 * torch.randn(tensors[key].shape, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def tokens(llm, prompts, adapters):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapter=adapters)
    return [o.outputs[0].token_ids for o in outs]


def llm_for(base, adapters: dict, **kwargs):
    return LLM(str(base), dtype="float32", num_kv_blocks=64, lora_modules={k: str(v) for k, v in adapters.items()},
               **kwargs)


def edit_config(folder, **changes):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-bases")
    return {"llama": make_tiny_model(root / "llama", "llama", seed=1),
            "tied": make_tiny_model(root / "tied", "llama", seed=2, tie_word_embeddings=True),
            "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=3),
            "qwen3": make_tiny_model(root / "qwen3", "qwen3", seed=4),
            # Gemma scales rows inside its embedding module (the delta joins unscaled), Granite after it
            "gemma2": make_tiny_model(root / "gemma2", "gemma2", seed=5, head_dim=16, query_pre_attn_scalar=16,
                                      tie_word_embeddings=True),
            "granite": make_tiny_model(root / "granite", "granite", seed=6, embedding_multiplier=3.0)}


@pytest.fixture(scope="module")
def folders(bases, tmp_path_factory):
    """The adapters of the untied Llama base: one per kind, plus a plain one."""
    root, base = tmp_path_factory.mktemp("vocab-adapters"), bases["llama"]
    return {
        "emb": make_peft_adapter(base, root / "emb", rank=4, seed=11, targets=["embed_tokens"]),
        "head": make_peft_adapter(base, root / "head", rank=4, seed=12, targets=["lm_head", "v_proj"]),
        "mts": perturb(make_peft_adapter(base, root / "mts", rank=4, seed=13, targets=["q_proj"],
                                         modules_to_save=["embed_tokens", "lm_head"]), r"(embed_tokens|lm_head)\.weight", 5),
        "plain": make_peft_adapter(base, root / "plain", rank=8, seed=14),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "tied", "gemma2", "granite"])
def test_embedding_lora_matches_peft(bases, tmp_path, arch):
    folder = make_peft_adapter(bases[arch], tmp_path / "emb", rank=4, seed=21, targets=["embed_tokens", "o_proj"])
    llm = llm_for(bases[arch], {"emb": folder})
    got = tokens(llm, PROMPTS[:3], "emb")
    assert got == peft_greedy(bases[arch], [folder] * 3, PROMPTS[:3], NEW)
    assert got != tokens(llm, PROMPTS[:3], None)
    weights = llm.engine.adapters.prefetch("emb")
    assert weights.embedding is not None and weights.replacements == {}  # the saved base layer is the model's


@pytest.mark.parametrize("arch", ["llama", "tied"])
def test_head_lora_matches_peft(bases, tmp_path, arch):
    """On a tied base the head's LoRA changes the logits only, never the embedding."""
    folder = make_peft_adapter(bases[arch], tmp_path / "head", rank=4, seed=22, targets=["lm_head"])
    llm = llm_for(bases[arch], {"head": folder})
    got = tokens(llm, PROMPTS[:3], "head")
    assert got == peft_greedy(bases[arch], [folder] * 3, PROMPTS[:3], NEW)
    assert got != tokens(llm, PROMPTS[:3], None)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "tied", "gemma2"])
def test_modules_to_save_match_peft_and_count_in_memory(bases, tmp_path, arch):
    folder = perturb(make_peft_adapter(bases[arch], tmp_path / "mts", rank=4, seed=23, targets=["q_proj"],
                                       modules_to_save=["embed_tokens", "lm_head"]), r"(embed_tokens|lm_head)\.weight", 6)
    llm = llm_for(bases[arch], {"mts": folder})
    got = tokens(llm, PROMPTS[:3], "mts")
    assert got == peft_greedy(bases[arch], [folder] * 3, PROMPTS[:3], NEW)
    weights = llm.engine.adapters.prefetch("mts")
    assert set(weights.replacements) == {"embed_tokens", "lm_head"} and weights.modules_to_save == {"embed_tokens",
                                                                                                   "lm_head"}
    table = 448 * 64 * 4  # vocab x hidden, float32: two of them, neither equal to the base's
    lora = sum(a.nbytes + b.nbytes for a, b in weights.projections.values())
    assert weights.nbytes == lora + 2 * table and llm.engine.adapters.memory() == (1, weights.nbytes)
    assert llm.engine.adapters.get("mts").modules_to_save == ("embed_tokens", "lm_head")


def test_a_changed_base_layer_on_a_tied_base_is_the_table_both_read(bases, tmp_path):
    """peft loads a saved base layer into the model: on a tied model into the one table the embedding and
    the head share, so both change."""
    folder = perturb(make_peft_adapter(bases["tied"], tmp_path / "emb", rank=4, seed=24, targets=["embed_tokens"]),
                     r"base_layer", 7)
    llm = llm_for(bases["tied"], {"emb": folder})
    assert tokens(llm, PROMPTS[:3], "emb") == peft_greedy(bases["tied"], [folder] * 3, PROMPTS[:3], NEW)
    weights = llm.engine.adapters.prefetch("emb")
    assert weights.replacements["embed_tokens"] is weights.replacements["lm_head"]  # one table, held once


def test_one_batch_mixes_vocab_adapters_plain_adapters_and_base(bases, folders):
    """Three slots: the first batch holds emb, head, mts and base requests; plain waits for a slot, which
    then changes hands (a slot that held full weights must not keep them)."""
    llm = llm_for(bases["llama"], folders, max_loras=3, max_num_seqs=8)
    names = ["emb", "head", None, "mts", "plain", "mts"]
    got = tokens(llm, PROMPTS, names)
    assert got == peft_greedy(bases["llama"], [folders.get(n) for n in names], PROMPTS, NEW)
    assert len({tuple(t) for t in got}) == len(got)  # each adapter really changes the tokens
    assert llm.engine.adapters.num_slot_loads >= 4  # four adapters through three slots
    assert_all_blocks_free(llm.engine)
    assert llm.engine.adapters.num_pins() == 0


def test_unload_frees_the_slots_and_the_memory(bases, folders):
    llm = llm_for(bases["llama"], {"mts": folders["mts"], "emb": folders["emb"]}, max_loras=2)
    tokens(llm, PROMPTS[:2], ["mts", "emb"])
    slots = llm.engine.adapters.slots
    assert slots.embedding.num_active == 2 and slots.head.num_active == 1
    llm.unload_adapter("mts")
    llm.unload_adapter("emb")
    assert slots.embedding.num_active == 0 and slots.head.num_active == 0
    assert slots.embedding.weights == [None, None] and slots.head.lora == [None, None]
    assert llm.engine.adapters.memory() == (0, 0) and llm.engine.adapters.num_pins() == 0
    assert tokens(llm, PROMPTS[:1], None) == peft_greedy(bases["llama"], [None], PROMPTS[:1], NEW)


def test_the_byte_budget_counts_full_weights(bases, folders):
    """Two modules_to_save adapters do not fit a budget of one and a half: the older one is evicted."""
    config = read_model_config(bases["llama"])
    one = read_peft_adapter("m", folders["mts"], config, 16).nbytes
    assert one > 2 * 448 * 64 * 4
    registry = AdapterRegistry(config, max_loras=1, max_lora_rank=16, max_cpu_loras=None, dtype=torch.float32,
                               lora_memory=one * 3 // 2)
    registry.load("m1", str(folders["mts"]))
    registry.load("m2", str(folders["mts"]))
    assert registry.memory() == (1, one)
    registry.pin("m2", registry.prefetch("m2"))
    registry.assign_slots({"m2"})
    assert registry.slots.embedding.weights[0] is registry.prefetch("m2").replacements["embed_tokens"]  # no copy
    registry.unpin("m2")


def test_without_a_model_a_saved_base_layer_is_kept(bases, folders):
    """A registry no model told its weights (no comparison possible) keeps the copy, as peft would load it."""
    config = read_model_config(bases["llama"])
    weights = read_peft_adapter("e", folders["emb"], config, 16)
    assert set(weights.replacements) == {"embed_tokens"}
    a_t, b_t = weights.embedding
    raw = load_file(folders["emb"] / "adapter_model.safetensors")
    assert torch.equal(a_t, raw["base_model.model.model.embed_tokens.lora_embedding_A"].T)
    assert torch.equal(b_t, raw["base_model.model.model.embed_tokens.lora_embedding_B"].T)


@pytest.mark.parametrize("changes,reason", [
    ({"use_dora": True}, "no lora_magnitude_vector, but use_dora is true"),
    ({"modules_to_save": ["embed_tokens", "lm_head", "score"]}, "modules_to_save \\['score'\\] is not supported"),
    ({"modules_to_save": ["embed_tokens", "lm_head", "norm"]}, "modules_to_save lists \\['norm'\\], but the folder"),
    ({"lora_bias": True}, "no lora_B bias, but lora_bias is true"),
    ({"use_qalora": True}, "QA-LoRA"),
    ({"alora_invocation_tokens": [5, 6]}, "activated LoRA"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "LOHA"}, "peft_type 'LOHA'"),
    ({"modules_to_save": ["embed_tokens"]}, "unexpected weight 'base_model.model.lm_head.weight'"),
    ({"target_modules": ["q_proj", "lm_head"]}, "both a LoRA target and in modules_to_save"),
])
def test_refusals_name_what_cannot_be_served(bases, folders, tmp_path, changes, reason):
    folder = shutil.copytree(folders["mts"], tmp_path / "bad")
    edit_config(folder, **changes)
    config = read_model_config(bases["llama"])
    with pytest.raises(AdapterError, match=f"adapter 'bad' .*{reason}"):
        read_peft_adapter("bad", folder, config, 16)
    registry = AdapterRegistry(config, 1, 16, None, torch.float32)
    with pytest.raises(ValueError, match=reason):
        registry.load("bad", str(folder))
    assert registry.list() == []


def test_a_full_weight_for_another_vocabulary_is_refused(bases, folders, tmp_path):
    folder = shutil.copytree(folders["mts"], tmp_path / "resized")
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.lm_head.weight"] = torch.zeros(450, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(AdapterError, match="lm_head weight of shape \\(450, 64\\) does not fit"):
        read_peft_adapter("resized", folder, read_model_config(bases["llama"]), 16)


class EagerGraphs:
    """Stands in for the decode graphs on the CPU: a replay runs the step eagerly, but as a captured graph
    would, with no embedding adapter in it (a graph is captured before any adapter is resident)."""

    def __init__(self, runner) -> None:
        self.runner, self.replays = runner, 0

    def fits(self, num_tokens: int, with_lora: bool, mix_passes: int = 0) -> bool:
        return mix_passes == 0

    def run(self, step):
        self.replays += 1
        from loraplex.adapters.lora_layers import VocabAdapters

        embed = self.runner.model.embed_tokens
        held, embed.adapters = embed.adapters, VocabAdapters.empty(len(embed.adapters.lora))
        try:
            return self.runner.forward(step)
        finally:
            embed.adapters = held


def test_decode_graphs_serve_head_adapters_and_leave_embedding_adapters_to_eager_steps(bases, folders):
    llm = llm_for(bases["llama"], {n: folders[n] for n in ("emb", "head", "mts")}, max_loras=3)
    graphs = llm.engine.core.executor.worker.runner.graphs = EagerGraphs(llm.engine.core.executor.worker.runner)
    names = ["head", None, "head"]
    assert tokens(llm, PROMPTS[:3], names) == peft_greedy(bases["llama"], [folders.get(n) for n in names],
                                                          PROMPTS[:3], NEW)
    assert graphs.replays == NEW - 1  # every decode step: the head's rows get their slots outside the graph
    graphs.replays = 0
    names = ["emb", "mts", None]
    assert tokens(llm, PROMPTS[:3], names) == peft_greedy(bases["llama"], [folders.get(n) for n in names],
                                                          PROMPTS[:3], NEW)
    assert graphs.replays == 0


def test_tied_copies_under_ensure_weight_tying_must_agree(bases, tmp_path):
    """peft ties the two modules_to_save copies of a tied model into one: two different ones have no single
    meaning; equal ones are one table, held once."""
    folder = make_peft_adapter(bases["tied"], tmp_path / "tie", rank=4, seed=25, targets=["q_proj"],
                               modules_to_save=["embed_tokens", "lm_head"], ensure_weight_tying=True)
    config = read_model_config(bases["tied"])
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.model.embed_tokens.weight"] += 0.01
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(AdapterError, match="two different modules_to_save copies"):
        read_peft_adapter("tie", folder, config, 16)
    tensors["base_model.model.lm_head.weight"] = tensors["base_model.model.model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    weights = read_peft_adapter("tie", folder, config, 16)
    assert weights.replacements["embed_tokens"] is weights.replacements["lm_head"]


def test_an_unchanged_base_layer_is_dropped_on_a_quantized_head(bases, tmp_path):
    """The head of an int8 model serves its float weight rounded: an adapter's copy of that float weight is
    the same head, not a second one kept in full."""
    folder = make_peft_adapter(bases["llama"], tmp_path / "both", rank=4, seed=26, targets=["embed_tokens", "lm_head"])
    llm = llm_for(bases["llama"], {"both": folder}, quantization="int8")
    weights = llm.engine.adapters.prefetch("both")
    assert weights.replacements == {} and weights.embedding is not None and weights.head is not None
    assert tokens(llm, PROMPTS[:1], "both") != tokens(llm, PROMPTS[:1], None)


def test_stacked_slots_copy_vocab_weights_to_the_device_once(bases, tmp_path):
    """With stacked slots (CUDA) a slot holds device copies; one table a tied adapter gives both modules is
    copied once. The meta device stands in for a GPU: copies there are new tensors."""
    from loraplex.adapters.slots import LoRASlots

    folder = perturb(make_peft_adapter(bases["tied"], tmp_path / "emb", rank=4, seed=27, targets=["embed_tokens"]),
                     r"base_layer", 8)
    config = read_model_config(bases["tied"])
    weights = read_peft_adapter("emb", folder, config, 16)
    slots = LoRASlots(config, 2, torch.float32, torch.device("meta"), max_rank=16)
    slots.load(1, weights)
    table = slots.embedding.weights[1]
    assert table.is_meta and table is slots.head.weights[1] and slots.embedding.lora[1][0].is_meta
    assert slots.head.lora[1] is None and slots.embedding.weights[0] is None
    slots.clear(1)
    assert slots.embedding.num_active == slots.head.num_active == 0


def test_prompt_logprobs_go_through_the_adapters_head(bases, folders):
    """Prompt logprobs of a request whose adapter changes the head (LoRA on lm_head, modules_to_save) are peft's,
    not the base head's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = bases["llama"]
    llm = llm_for(base, {"head": folders["head"], "mts": folders["mts"]})
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    ids = PROMPTS[4]
    for name in ("head", "mts"):
        got = llm.generate([{"prompt_token_ids": ids}], params, adapter=name)[0].prompt_logprobs
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          folders[name]).eval()
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for i in range(1, len(ids)):
            assert got[i][ids[i]].logprob == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-4)
    assert_all_blocks_free(llm.engine)
