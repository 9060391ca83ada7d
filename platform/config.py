"""Engine configuration: frozen dataclasses, validated once at start-up."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "float16": torch.float16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
LORA_DTYPES = {name: (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)  # what the LoRA paths multiply
               for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face config.json our decoder needs; what a family changes in it is a field
    (docs/families.md)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # each layer's: "full_attention" or "sliding_attention"
    rope_parameters: dict[str, dict]  # layer type -> its RoPE, standardized (models/rope.py)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None  # the windowed layers' window (None: no layer has one)
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: it sees its whole context)
    hidden_act: str  # the MLP gate's activation (transformers' name)
    norm_offset: float  # each RMSNorm multiplies by (norm_offset + w): Gemma's are 1 + w
    post_norms: bool  # Gemma: attention and MLP outputs normalized too, and a norm before the MLP (4 a layer)
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm on each q and k head before RoPE
    attention_scale: float  # of q.k: head_dim^-0.5, Gemma's query_pre_attn_scalar^-0.5, Granite's multiplier
    attn_logit_softcap: float | None  # Gemma 2: scores become c tanh(s / c)
    final_logit_softcap: float | None  # Gemma: logits become c tanh(l / c)
    embedding_multiplier: float  # Gemma: sqrt(hidden) (rounded to the model's dtype, as transformers does); Granite's
    residual_multiplier: float  # Granite: each block's output is scaled before the residual add
    logits_scaling: float  # Granite: the logits are divided by it
    prequantized: tuple[str, int, bool] | None = None  # a GPTQ / AWQ checkpoint: (method, group, v1 zeros)
    moe: "MoEConfig | None" = None  # experts and routing of a mixture-of-experts model (models/moe.py)

    @staticmethod
    def from_folder(path: str | Path) -> "ModelConfig":
        from loraplex.platform.models import CONFIG_DEFAULTS, SUPPORTED_ARCHITECTURES
        from loraplex.platform.models.moe import MoEConfig
        from loraplex.platform.models.quantized import checkpoint_quantization

        raw = json.loads((Path(path) / "config.json").read_text())
        archs = raw.get("architectures") or [raw.get("model_type", "unknown")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {arch!r} in {path}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        raw = {**CONFIG_DEFAULTS.get(arch, {}), **raw}  # what the file leaves out, as transformers fills it in
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        try:
            family = _family_fields(raw, arch, head_dim)
        except ValueError as exc:
            raise ValueError(f"{exc} (in {path})") from None
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
            or (arch == "Qwen2MoeForCausalLM" and bool(raw.get("qkv_bias", True))),  # Qwen2-MoE's own key
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            **family,
            prequantized=checkpoint_quantization(raw.get("quantization_config")),
            moe=MoEConfig.from_raw(raw, arch),
        )


GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
ONE_WINDOW = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")  # every layer slides, if any


def _family_fields(raw: dict, arch: str, head_dim: int) -> dict:
    """The ModelConfig fields in which the families differ (docs/families.md), as transformers' code for
    each family reads its config; what we would not serve exactly is a ValueError naming it."""
    from loraplex.platform.models import ACTIVATIONS
    from loraplex.platform.models.rope import rope_parameters

    gemma, granite = arch in GEMMA, arch == "GraniteForCausalLM"
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (attention to later tokens) is not supported")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias (biases on the MLP projections) is not supported")
    act = raw.get("hidden_activation") if gemma else raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    types = _layer_types(raw, arch)
    window = None if arch in QWEN and not raw.get("use_sliding_window") else raw.get("sliding_window")
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    return dict(
        layer_types=types,
        rope_parameters=rope_parameters(raw, arch, head_dim),
        sliding_window=window if any(windows) else None,
        layer_windows=windows,
        hidden_act=act,
        norm_offset=1.0 if gemma else 0.0,
        post_norms=gemma,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        attention_scale=(raw["query_pre_attn_scalar"] ** -0.5 if gemma else
                         raw.get("attention_multiplier", 1.0) if granite else head_dim ** -0.5),
        # Gemma 3's transformers code reads attn_logit_softcapping but never applies it: neither do we
        attn_logit_softcap=raw.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
        final_logit_softcap=raw.get("final_logit_softcapping") if gemma else None,
        embedding_multiplier=(raw["hidden_size"] ** 0.5 if gemma else
                              raw.get("embedding_multiplier", 1.0) if granite else 1.0),
        residual_multiplier=raw.get("residual_multiplier", 1.0) if granite else 1.0,
        logits_scaling=raw.get("logits_scaling", 1.0) if granite else 1.0,
    )


def _layer_types(raw: dict, arch: str) -> tuple[str, ...]:
    """Each layer's attention ("full_attention" or "sliding_attention"), as the family's transformers config
    lays them out: its `layer_types` where it reads them, else its own pattern."""
    from loraplex.platform.models.rope import LAYER_TYPES

    n = raw["num_hidden_layers"]
    if arch in ONE_WINDOW:
        return ("sliding_attention" if raw.get("sliding_window") else "full_attention",) * n
    if arch not in QWEN + GEMMA:  # Llama, Granite: no sliding window (the MoE families: models/moe.py's to add)
        return ("full_attention",) * n
    if raw.get("layer_types"):
        types = tuple(raw["layer_types"])
        if len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the {n} layers, got {types}")
        return types
    if arch in QWEN:
        slides = raw.get("use_sliding_window") and raw.get("sliding_window")
        return tuple("sliding_attention" if slides and i >= raw.get("max_window_layers", 28) else "full_attention"
                     for i in range(n))
    pattern = 2 if arch == "Gemma2ForCausalLM" else raw["sliding_window_pattern"]  # every pattern-th is global
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


QUANTIZATIONS = ("none", "q4", "int8")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def _setting(default, help: str, **cli):
    """An engine setting: its default, and what `loraplex serve` says of it (the CLI flags are
    generated from these fields; `cli` may name the vLLM flag, choices, or a size parser)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = _setting("auto", "where the model, KV cache, adapters and sampling live: cpu, cuda or cuda:N "
                                   "(auto: cuda when torch sees one)")
    dtype: str = _setting("auto", "weights and activations; auto: on CUDA bfloat16 (float16 without bf16 support); "
                                  "on CPU whichever of bfloat16 and float32 a "
                                  "one-time probe of the model's step measures faster on this CPU (bfloat16 "
                                  "wins only with native bf16 matmuls: AVX512-BF16 / AMX)",
                          choices=["auto", *DTYPES])
    max_model_len: int | None = _setting(None, "longest prompt + output (default: the model's)")
    max_num_seqs: int = _setting(64, "sequences in one batch")
    max_num_batched_tokens: int = _setting(2048, "tokens in one step (the chunked-prefill budget)")
    block_size: int = _setting(16, "tokens per KV block")
    num_kv_blocks: int | None = _setting(None, "KV cache size in blocks (overrides --kv-cache-memory)")
    kv_cache_memory: int = _setting(1 << 30, "CPU: KV cache size, bytes or e.g. 512MiB (CUDA: see "
                                             "--gpu-memory-utilization)", size=True)
    gpu_memory_utilization: float = _setting(0.9, "CUDA: fraction of the device's memory for weights, activations, "
                                                  "adapters and KV cache; the KV cache gets what a profiling pass "
                                                  "at max_num_batched_tokens leaves (vLLM's meaning)")
    prefill_attention: str = _setting("auto", "CUDA: attention of steps whose prompts are all fresh first chunks "
                                              "(no prefix hit): triton (the paged kernel) or sdpa (torch SDPA, "
                                              "causal: its flash backend; not with soft-capped layers; windowed "
                                              "layers keep the paged kernel); auto: triton until the GPU check "
                                              "measures SDPA faster", choices=["auto", "triton", "sdpa"])
    enforce_eager: bool = _setting(False, "CUDA: no CUDA graphs (decode batches are captured per padded batch "
                                          "size by default)")
    enable_prefix_caching: bool = _setting(True, "reuse the KV of shared prompt prefixes")
    seed: int = _setting(0, "seed for requests that bring none")
    max_loras: int | None = _setting(None, "distinct adapters in one batch (default: as many as --lora-memory "
                                           "holds at --max-lora-rank, at most --max-num-seqs; logged at start)")
    max_lora_rank: int = _setting(16, "largest adapter rank accepted")
    max_adapters_per_request: int = _setting(8, "adapters one request may combine in a weighted mix (each "
                                                "takes a slot of --max-loras while it runs)")
    max_cpu_loras: int | None = _setting(None, "adapters kept in CPU memory (default: as many as --lora-memory holds)")
    lora_memory: int = _setting(2 << 30, "memory for adapter weights (the CPU LRU; batches read them in place): "
                                         "bytes, or e.g. 4GiB", size=True)
    lora_cycle_steps: int = _setting(32, "steps a resident adapter keeps admitting requests while other "
                                         "adapters wait for a slot")
    grammar_backend: str = _setting("auto", "structured-output backend (auto: per spec, the first of llguidance, "
                                    "xgrammar, outlines that enforces it exactly)",
                                    choices=["auto", "llguidance", "xgrammar", "outlines"])
    grammar_compile_timeout_s: float = _setting(10.0, "seconds a grammar may take to compile (then: 400)",
                                                flag="--grammar-compile-timeout")
    grammar_compile_workers: int = _setting(4, "processes that compile grammars, at a lower CPU priority (a compile "
                                               "past its timeout is killed with its process; 0: threads of the "
                                               "server, abandoned at the timeout)")
    jump_forward: bool = _setting(True, "append grammar-forced tokens without a forward pass each")
    json_close_window: int = _setting(64, "JSON outputs: in the last max(N, max_tokens/4) tokens of max_tokens (at most half), "
                                          "pick a closing token (quote, bracket, brace, end) whenever the grammar "
                                          "allows one (0: off)")
    pack_weights: bool = _setting(True, "CPU: linear weights prepacked (oneDNN's layout, or our AMX kernel's for "
                                        "bfloat16); under dtype auto, float32 weights only where the start-up "
                                        "probe measures that faster than plain rows and our decode kernel")
    kv_cache_dtype: str = _setting("auto", "float16: twice the KV tokens of float32 in the same memory; fp8 (= "
                                           "fp8_e4m3, vLLM's name): twice those of bf16, K/V rounded to float8 "
                                           "e4m3 (CPU kernels); auto: the model's dtype",
                                   choices=list(KV_CACHE_DTYPES))
    quantization: str = _setting("none", "weights kept quantized (activations in the model dtype: dtype auto = "
                                         "bfloat16 where the CPU has it natively, else float32): q4 = 4-bit "
                                         "groups of 32 (the default model's GGUF Q4_1 bits as they are; other "
                                         "models quantized at load), int8 = 8-bit per output channel",
                                 choices=list(QUANTIZATIONS))
    lora_dtype: str = _setting("auto", "adapter weights' dtype (vLLM's flag); auto: the model's, but bfloat16 on "
                                       "a --quantization base (QLoRA-style: the base in 4/8 bits, adapters in 16); "
                                       "bfloat16 under a float32 model halves the bytes each token's adapter "
                                       "reads (CPU)", choices=["auto", "float32", "bfloat16"])

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_lora_rank", "lora_memory",
                     "lora_cycle_steps", "num_kv_blocks", "max_loras", "max_cpu_loras", "max_adapters_per_request"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_cpu_loras is not None and self.max_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be >= max_loras={self.max_loras}, got {self.max_cpu_loras}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization != "none" and self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"quantization {self.quantization} runs float32 or bfloat16 activations, not {self.dtype}")
        if self.prefill_attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"prefill_attention must be auto, triton or sdpa, got {self.prefill_attention!r}")
        if self.lora_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"lora_dtype must be auto, float32 or bfloat16, got {self.lora_dtype!r}")
        if self.dtype != "auto" and self.lora_dtype != "auto" and self.torch_lora_dtype not in LORA_DTYPES[self.dtype]:
            raise ValueError(f"lora_dtype {self.lora_dtype} under dtype {self.dtype}: adapters are in the model's "
                             "dtype, or bfloat16 under float32")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")

    @property
    def torch_device(self) -> torch.device:
        """The device `device` names; cuda without a CUDA torch or device is an error saying so."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device} requested but torch {torch.__version__} sees no CUDA device "
                                 "(the CUDA build of torch: make setup-gpu)")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device} requested but only {torch.cuda.device_count()} CUDA "
                                 "device(s) are visible")
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        from loraplex.kernels.cpu_kernels import native_bf16

        # the engine resolves auto by a probe (platform/dtype_probe.py) before anything reads
        # this; before that, the flags' guess: bf16 without AVX512-BF16/AMX runs several times slower
        return torch.bfloat16 if native_bf16() else torch.float32

    @property
    def torch_lora_dtype(self) -> torch.dtype:
        if self.lora_dtype == "auto":
            return torch.bfloat16 if self.quantization != "none" else self.torch_dtype
        return DTYPES[self.lora_dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]

    def resolve_max_loras(self, model: ModelConfig) -> tuple[int, str]:
        """Adapters per batch and why: the given value, or as many worst-case adapters (every
        projection at max_lora_rank) as `lora_memory` holds, capped by max_num_seqs (a batch
        cannot use more adapters than it has sequences) and max_cpu_loras."""
        if self.max_loras is not None:
            return self.max_loras, "set by max_loras"
        from loraplex.adapters.peft_format import adapter_bytes

        worst = adapter_bytes(model, self.max_lora_rank, self.torch_lora_dtype)
        fits = max(1, self.lora_memory // worst)
        chosen = min(fits, self.max_num_seqs, self.max_cpu_loras or fits)
        return chosen, (f"lora_memory={self.lora_memory / 2**20:.0f} MiB holds {fits} adapters of rank "
                        f"{self.max_lora_rank} on every projection ({worst / 2**20:.1f} MiB each); "
                        f"max_num_seqs={self.max_num_seqs}" + (f", max_cpu_loras={self.max_cpu_loras}"
                                                               if self.max_cpu_loras else ""))

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        # not capped by a sliding window: every attention kernel applies each layer's window (layer_windows)
        if self.max_model_len is None:
            return limit
        if not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {self.max_model_len}")
        return self.max_model_len


def quantized_activation_dtype(caps, tune) -> tuple[str, str]:
    """What dtype auto means under --quantization, and why (`caps`: `CpuCaps`, `tune`: `TuneTable`). The weights
    are quantized either way, so this is the activations' and the KV cache's dtype: bfloat16 halves the KV
    bytes a step reads and is what the AMX tile kernel multiplies (docs/benchmarks-history.md, "q4 in bf16 on AMX");
    emulated it is slow."""
    if not caps.native_bf16:
        return "float32", "bf16 is emulated on this CPU (no AVX512-BF16 / AMX)"
    (low, high), (q4_low, q4_high) = tune.amx_tokens, tune.amx_tile_order_tokens
    amx = f"; quantized matmuls on AMX tiles: q4 (in tile order) {q4_low}-{q4_high - 1} tokens, 8-bit " \
          f"{low}-{high - 1}" if caps.amx else ""
    return "bfloat16", "bf16 native" + amx
