"""Engine configuration: frozen dataclasses, validated once at start-up. A model's own configuration is
`ModelConfig` (`platform/models/model_config.py`), read by `platform/models/registry.py`'s `read_model_config`."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, fields

import torch

from loraplex.kernels.dispatch import PrefillAttention
from loraplex.platform.models import model_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "float16": torch.float16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
LORA_DTYPES = {name: (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)  # what the LoRA paths multiply
               for name, dtype in DTYPES.items()}


QUANTIZATIONS = ("none", "q4", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def _setting(default, help: str, **cli):
    """An engine setting: its default, and what `loraplex serve` says of it (the CLI flags are
    generated from these fields; `cli` may name the vLLM flag, choices, or a size parser)."""
    return field(default=default, metadata={"help": help, **cli})


# ---- speculative decoding (`platform/spec_decode/`) --------------------------------------------

METHODS = ("ngram", "grammar")  # grammar: forced tokens only; ngram: forced tokens, then prompt lookup


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON spelling)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most drafts a request verifies in one step
    prompt_lookup_max: int = 4  # the longest n-gram matched
    prompt_lookup_min: int = 2  # the shortest
    disable_by_batch_size: int = 4  # more running sequences than this: the step drafts nothing
    min_acceptance: float = 0.02  # a request's recent acceptance below this pauses its drafts
    grammar_drafts: bool = True  # a structured request's forced tokens drafted (else jump-forward appends them)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > 64:
            raise ValueError(f"speculative num_speculative_tokens must be at most 64, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.min_acceptance, (int, float)) or not 0 <= self.min_acceptance < 1:
            raise ValueError(f"speculative min_acceptance must be in [0, 1), got {self.min_acceptance!r}")
        if not isinstance(self.grammar_drafts, bool):
            raise ValueError(f"speculative grammar_drafts must be a boolean, got {self.grammar_drafts!r}")

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """The flag's JSON; None: no speculation. Unknown keys are refused by name."""
        if text is None or text == "":
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**raw)


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
                                              "measures SDPA faster", choices=list(PrefillAttention))
    enforce_eager: bool = _setting(False, "CUDA: no CUDA graphs (decode batches are captured per padded batch "
                                          "size by default)")
    async_scheduling: bool = _setting(False, "schedule and launch step N+1 before step N's sampled tokens are read "
                                             "back (their ids gathered on the device), so the host's work of a "
                                             "step hides behind the device's; steps with grammars, logprobs or "
                                             "prompt logprobs, penalties, min_tokens still ahead or n > 1 sample "
                                             "in order; not with --speculative-config")
    enable_prefix_caching: bool = _setting(True, "reuse the KV of shared prompt prefixes")
    seed: int = _setting(0, "seed for requests that bring none")
    scheduling_policy: str = _setting("fcfs", "fcfs: requests in arrival order (a request's priority other than 0 "
                                              "refused); priority: by each request's priority (lower first; vLLM's "
                                              "meaning) within its tenant, a running request sitting out a step "
                                              "while a more urgent one prefills, preempted when it needs the seat "
                                              "or blocks. Batch API lines yield to interactive work under either",
                                      choices=list(SCHEDULING_POLICIES))
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
    lora_max_wait_steps: int = _setting(64, "steps a request may wait for its adapters to come in while others "
                                            "overtake it; then no adapter request behind it takes a new slot")
    lora_spill_size: int = _setting(16 << 30, "local disk for adapters' prepared weights (what the CPU cache drops "
                                              "comes back in one read, not a parse of its folder): bytes, or e.g. "
                                              "8GiB; 0: none (in $TMPDIR, removed at exit)", size=True)
    grammar_backend: str = _setting("auto", "structured-output backend (auto: per spec, the first of llguidance, "
                                    "xgrammar, outlines that enforces it exactly)",
                                    choices=["auto", "llguidance", "xgrammar", "outlines"])
    grammar_compile_timeout_s: float = _setting(10.0, "seconds a grammar may take to compile (then: 400)",
                                                flag="--grammar-compile-timeout")
    grammar_compile_workers: int = _setting(4, "processes that compile grammars, at a lower CPU priority (a compile "
                                               "past its timeout is killed with its process; 0: threads of the "
                                               "server, abandoned at the timeout)")
    grammar_cache_dir: str = _setting("auto", "folder of compiled grammars kept across restarts (keyed by the spec "
                                              "and its tenant, the tokenizer, the backend and its version); auto: "
                                              "`grammars` in the cache dir ($LORAPLEX_GRAMMAR_CACHE if set); off: none")
    grammar_cache_size: int = _setting(256 << 20, "bytes the compiled-grammar folder may hold (least recently used "
                                                  "out first): bytes, or e.g. 1GiB", size=True)
    jump_forward: bool = _setting(True, "append grammar-forced tokens without a forward pass each")
    speculative_config: str | None = _setting(None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
                                                    "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                                                    "\"prompt_lookup_min\": 2, \"disable_by_batch_size\": 4}; method "
                                                    "grammar drafts only grammar-forced tokens (docs/speculative.md)")
    tensor_parallel_size: int = _setting(1, "tensor parallelism: the model sharded over N worker processes (gloo "
                                            "on CPU, NCCL on CUDA, one device each), the scheduler, grammars and "
                                            "sampler staying in the engine's process (docs/parallel.md)")
    deterministic: bool = _setting(False, "deterministic inference: a request's tokens and logprobs bitwise the same "
                                          "whatever the batch, the prefix cache, the prefill chunking or a "
                                          "preemption (every kernel sums a token's values in one fixed order; "
                                          "CPU: our C kernels, float32 or bfloat16; CUDA: Triton; docs/engine.md)")
    finish_within_budget: bool = _setting(True, "structured outputs (llguidance) end valid inside max_tokens: no "
                                                "token is taken that leaves more to write than the tokens left, and "
                                                "a request whose shortest answer does not fit is refused (400); "
                                                "off: only the softer --json-close-window steer (docs/structured-outputs.md)")
    json_close_window: int = _setting(64, "JSON outputs not guarded by --finish-within-budget: in the last max(N, max_tokens/4) "
                                          "tokens of max_tokens (at most half), pick a closing token (quote, bracket, "
                                          "brace, end) whenever the grammar allows one (0: off)")
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
                     "tensor_parallel_size", "grammar_cache_size",
                     "lora_cycle_steps", "lora_max_wait_steps", "num_kv_blocks", "max_loras", "max_cpu_loras", "max_adapters_per_request"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_cpu_loras is not None and self.max_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be >= max_loras={self.max_loras}, got {self.max_cpu_loras}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization != "none" and self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"quantization {self.quantization} runs float32 or bfloat16 activations, not {self.dtype}")
        if self.prefill_attention not in list(PrefillAttention):
            raise ValueError(f"prefill_attention must be one of {', '.join(PrefillAttention)}, got "
                             f"{self.prefill_attention!r}")
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
        self.speculative  # noqa: B018 (parsed here so a bad value fails before anything is built)

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (once)."""
        return SpeculativeConfig.parse(self.speculative_config)

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

        # the engine resolves auto by a probe (`platform/resolve.py`, `kernels/autotune.py`) before anything reads
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

    def resolve_max_model_len(self, model: model_config.ModelConfig) -> int:
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
