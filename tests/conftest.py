"""Shared fixtures: tiny random-weight models (built here, saved to a temp dir) for fast unit
tests, and the default model for end-to-end ones."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

import pytest

# `make test` runs two xdist workers on CI's two cores. torch's default of a thread per core in each
# puts four OpenMP threads on two cores, whose waiting threads spin: the suite ran about twice as long.
# So one thread per worker (every thread of it: set before torch loads OpenMP, which the C kernels
# share) and per process it starts; `every_core` gives a test the machine's threads back.
CORES = len(os.sched_getaffinity(0))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the thread count it reads)

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines built by tests keep compiled grammars in memory only, never in the user's cache dir (the tests of the
# disk cache, tests/grammar/test_compile_cache.py, give their own folders).
os.environ["LORAPLEX_GRAMMAR_CACHE"] = "off"


@pytest.fixture
def every_core(monkeypatch):
    """The machine's threads for one test and the processes it starts: a kernel's work split across
    threads, or bits that must not depend on it, is what it checks."""
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    monkeypatch.setenv("OMP_NUM_THREADS", str(CORES))
    try:
        yield
    finally:
        torch.set_num_threads(before)


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Schöne Grüße aus München! Ça va? 日本語のテキスト 🙂🚀",
    "def add(a, b):\n    return a + b\n",
    "Hello world, hello loraplex, hello adapters and grammars.",
] * 20


def make_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(folder)
    return fast


def tuned(monkeypatch, **fields) -> None:
    """The autotune table's entries (thresholds or measured choices) set for this test: engines built after
    this, and `quant.quantized_matmul`, read them."""
    import dataclasses

    from loraplex.kernels import autotune

    resolve = autotune.resolve
    monkeypatch.setattr(autotune, "DEFAULT", dataclasses.replace(autotune.DEFAULT, **fields))
    monkeypatch.setattr(autotune, "resolve", lambda *a, **kw: dataclasses.replace(resolve(*a, **kw), **fields))


def without_bf16_kernels(monkeypatch) -> None:
    """No quantized matmul call takes the AMX or the AVX512-BF16 kernels (their bf16 rounding): the float
    and int8 kernels' exact math, whatever the CPU."""
    nowhere = (1 << 30, 1 << 30)
    tuned(monkeypatch, amx_tokens=nowhere, amx_tile_order_tokens=nowhere, dpbf16_tokens=nowhere)


# make_tiny_model's families: transformers' own config and model classes
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
}


@contextlib.contextmanager
def forced_kernels(setting: str):
    """`LORAPLEX_KERNELS=setting` for a block: what every engine built inside it reads, once, as it resolves its
    config (kernel tests build their config instead: tests/kernels/kernel_case.py); the previous setting back
    after."""
    previous = os.environ.get("LORAPLEX_KERNELS")
    os.environ["LORAPLEX_KERNELS"] = setting
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LORAPLEX_KERNELS", None)
        else:
            os.environ["LORAPLEX_KERNELS"] = previous


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A 2-layer random model of the given family, saved like any Hugging Face checkpoint."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    common = dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    common.update(overrides)
    config_cls, model_cls = (getattr(transformers, name) for name in FAMILY_CLASSES[arch])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    with torch.no_grad():  # a spread of logits that does not tie at random init
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from loraplex.platform import LLM

    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
               max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from loraplex.platform.model_store import default_model_dir, is_complete

    folder = default_model_dir()
    if not is_complete(folder):
        if os.environ.get("CI"):
            pytest.fail(f"default model missing at {folder}: `make test` materializes it")
        pytest.skip("default model not materialized (run `make model`)")
    return folder


def assert_all_blocks_free(engine) -> None:
    """Every block is free or cached-free, and no request holds any."""
    assert not engine.has_unfinished()
    assert engine.core.kv.req_blocks == {}
    assert engine.core.kv.num_free_blocks == engine.core.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.core.kv.pool.blocks)


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out_dir: Path, rank: int = 8, seed: int = 0, targets=None,
                      scale: float = 1.0, **config) -> Path:
    """A real PEFT LoRA folder (peft's own save_pretrained) with random, non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or ALL_TARGETS,
                     init_lora_weights=False, **config)
    model = get_peft_model(base, cfg)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.save_pretrained(out_dir)
    return out_dir


def jitter(folder, part: str, seed: int):
    """peft starts DoRA's magnitude at the norm it divides by (a factor of 1, which serves like plain LoRA), and a
    saved module at the base's weight: trained ones differ, as these do."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors, generator = load_file(path), torch.Generator().manual_seed(seed)
    hits = [key for key in tensors if part in key and "lora_" not in key.replace("lora_magnitude", "")]
    assert hits
    for key in hits:  # trainable tokens start as the base's rows too
        tensors[key] = tensors[key] * (1 + 0.3 * torch.randn(tensors[key].shape, generator=generator)) + \
            0.2 * torch.randn(tensors[key].shape, generator=generator) * ("trainable_tokens" in key)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def peft_greedy(base_dir, adapter_dirs, prompts, new_tokens: int) -> list[list[int]]:
    """peft's PeftModel with each prompt's adapter, one prompt at a time; None: base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    out, models = [], {}
    for ids, adapter in zip(prompts, adapter_dirs):
        if adapter is None:
            model = base
        else:
            model = models.get(adapter)
            if model is None:
                fresh = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
                fresh.generation_config.eos_token_id = None
                model = models[adapter] = PeftModel.from_pretrained(fresh, adapter).eval()
        with torch.no_grad():
            g = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        out.append(g[0, len(ids):].tolist())
    return out


@contextlib.contextmanager
def swapping_in_a_link(file: Path, target: Path):
    """While the block runs, a thread keeps replacing `file` (atomically) by a symbolic link to
    `target` and back by its own bytes: the race a confined adapter read must survive."""
    real, stop = file.read_bytes(), threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for tmp, make in ((file.with_name(".swap-link"), lambda t: t.symlink_to(target)),
                              (file.with_name(".swap-file"), lambda t: t.write_bytes(real))):
                make(tmp)
                os.replace(tmp, file)
                stop.wait(0.001)  # each stays a moment, so that reads meet both (a link that lasted
                # microseconds could go unmet by every read of a test, which then saw no refusal)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        yield
    finally:
        stop.set()
        swapper.join()


def spy_on_matches(monkeypatch, pattern: str) -> list[tuple[object, bool]]:
    """(the timeout it was given, whether it timed out) of each `regex.fullmatch` of `pattern` (in any thread,
    a server's too). A match of it without a timeout fails at once (it would backtrack for hours)."""
    import regex

    calls, real = [], regex.fullmatch

    def fullmatch(pat, string, *args, **kwargs):
        if pat != pattern:
            return real(pat, string, *args, **kwargs)
        if kwargs.get("timeout") is None:
            calls.append((None, False))
            raise AssertionError(f"{pattern!r} matched without a timeout")
        try:
            out = real(pat, string, *args, **kwargs)
        except TimeoutError:
            calls.append((kwargs["timeout"], True))
            raise
        calls.append((kwargs["timeout"], False))
        return out

    monkeypatch.setattr(regex, "fullmatch", fullmatch)
    return calls


def assert_refused_at_its_first_deadline(calls) -> None:
    """Quick by construction, not by a stopwatch: every match ran under a short deadline (at most 1 s), and the
    refusal came at the first match that hit it (none ran after)."""
    assert calls and all(isinstance(t, (int, float)) and 0 < t <= 1.0 for t, _ in calls), calls
    assert [timed_out for _, timed_out in calls] == [False] * (len(calls) - 1) + [True], calls


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir, tmp_path_factory) -> list[Path]:
    """8 adapters on the tiny model: ranks 8 and 16, all seven projections."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_adapter(tiny_model_dir, root / f"a{i}", rank=8 if i % 2 else 16, seed=i) for i in range(8)]


STRICT_VIOLATIONS: list[str] = []  # strict structured outputs the engine found breaking their schema


@pytest.fixture(scope="session", autouse=True)
def _count_strict_violations():
    """Every engine's schema backstop (`OutputProcessor._check`) also reports here; a test that
    replaced `Compiled.violation` itself (to check the counting) is left out."""
    from loraplex.grammar.compiler import Compiled
    from loraplex.platform.engine.output_processor import OutputProcessor

    check, real = OutputProcessor._check, Compiled.violation

    def counted(self, request, index, text):
        violation = check(self, request, index, text)
        compiled = request.compiled_grammar
        if violation is not None and compiled.strict_about(violation) and type(compiled).violation is real:
            STRICT_VIOLATIONS.append(f"{request.request_id}/{index}: {violation}")
        return violation

    OutputProcessor._check = counted
    yield
    OutputProcessor._check = check


@pytest.fixture(autouse=True)
def no_strict_violation(_count_strict_violations):
    """The strict-violation counter stays 0 through the whole suite (issue 43)."""
    seen = len(STRICT_VIOLATIONS)
    yield
    assert STRICT_VIOLATIONS[seen:] == [], "strict structured outputs broke their schema"


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder, config, seed: int, rank: int = 4, targets=LLAMA_TARGETS, layers=None):
    """A PEFT LoRA folder with random A and B for a base of `config` (its `ModelConfig`), written directly (no model
    built, unlike `make_peft_adapter`): every projection in `targets` of every layer (or of `layers`)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h), "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}
    blocks = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "qkv_proj": "self_attn"}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(config.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{blocks.get(module, 'mlp')}.{module}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.1
            tensors[prefix + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
         "base_model_name_or_path": None, "bias": "none"}))
    return folder
