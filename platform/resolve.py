"""An `EngineConfig` resolved once, before anything is built: `auto` dtype, the device, quantization read from
the checkpoint, the kernels (backend, CPU capabilities, the autotune table), `max_loras`, `max_model_len` and
the KV cache's size where it does not depend on the loaded model. Every choice carries the line the start-up
log prints for it; `Engine.__init__` only wires parts together from the result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loraplex.adapters.peft_format import adapter_bytes
from loraplex.kernels import autotune
from loraplex.kernels.cpu_kernels import CpuCaps
from loraplex.kernels.dispatch import Backend, KernelConfig, kernel_config, machine, resolve_backend
from loraplex.kernels.linear_methods import can_pack
from loraplex.platform.config import EngineConfig, quantized_activation_dtype
from loraplex.platform.device import normalize_device
from loraplex.platform.worker.model_runner import kv_bytes_per_block
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.models.registry import read_model_config
from loraplex.platform.models.sharding import plan_for


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig  # with dtype, quantization and pack_weights as resolved
    model: ModelConfig
    device: torch.device
    kernels: KernelConfig
    max_model_len: int
    max_loras: int
    num_kv_blocks: int | None  # None: sized from the device's memory once the model is loaded (CUDA)
    notes: tuple[str, ...]  # what was chosen and why, for the start-up log


def resolve(config: EngineConfig) -> ResolvedConfig:
    model = read_model_config(config.model)
    device = normalize_device(config.torch_device)  # cuda -> cuda:N: compared with tensors' devices
    notes: list[str] = []
    config = _quantization(config, model, device, notes)
    found = backend, caps, tune = machine(device)
    _check_device(config, device, backend)
    config = _dtype(config, model, device, caps, tune, notes)
    _check_lora_dtype(config, device, backend)
    if config.deterministic:
        _check_deterministic(config, backend, caps, notes)
    if config.tensor_parallel_size > 1:
        _check_tensor_parallel(config, model, device, notes)
    kernels = kernel_config(device, config.torch_dtype, config.torch_kv_dtype, config.torch_lora_dtype,
                            config.pack_weights, config.quantization, found, config.prefill_attention,
                            deterministic=config.deterministic)
    max_loras, why = _max_loras(config, model)
    notes.append(f"adapters: max_loras={max_loras} per batch ({why}); CPU cache bounded by "
                 f"lora_memory={config.lora_memory / 2**20:.0f} MiB")
    notes.append(f"kernels: {backend} on {device}, dtype {str(kernels.dtype).removeprefix('torch.')}, KV "
                 f"{str(kernels.kv_dtype).removeprefix('torch.')}; {caps}")
    notes += [f"autotune: {line}" for line in tune.lines()]
    return ResolvedConfig(config, model, device, kernels, config.resolve_max_model_len(model), max_loras,
                          _num_kv_blocks(config, model, device), tuple(notes))


def _max_loras(config: EngineConfig, model: ModelConfig) -> tuple[int, str]:
    """Adapters per batch and why: the given value, or as many worst-case adapters (every
    projection at max_lora_rank) as `lora_memory` holds, capped by max_num_seqs (a batch
    cannot use more adapters than it has sequences) and max_cpu_loras."""
    if config.max_loras is not None:
        return config.max_loras, "set by max_loras"
    worst = adapter_bytes(model, config.max_lora_rank, config.torch_lora_dtype)
    fits = max(1, config.lora_memory // worst)
    chosen = min(fits, config.max_num_seqs, config.max_cpu_loras or fits)
    return chosen, (f"lora_memory={config.lora_memory / 2**20:.0f} MiB holds {fits} adapters of rank "
                    f"{config.max_lora_rank} on every projection ({worst / 2**20:.1f} MiB each); "
                    f"max_num_seqs={config.max_num_seqs}" + (f", max_cpu_loras={config.max_cpu_loras}"
                                                             if config.max_cpu_loras else ""))


def _quantization(config: EngineConfig, model: ModelConfig, device: torch.device, notes: list[str]) -> EngineConfig:
    if model.prequantized and config.quantization == "none":  # as vLLM reads it from the checkpoint
        notes.append(f"{model.prequantized[0]} 4-bit checkpoint: quantization -> q4 (its bits kept)")
        config = dataclasses.replace(config, quantization="q4")
    if config.quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization {config.quantization} runs CPU kernels; on {device} use quantization none")
    return config


def _check_device(config: EngineConfig, device: torch.device, backend: Backend) -> None:
    if config.kv_cache_dtype.startswith("fp8") and (device.type != "cpu" or backend == Backend.TRITON):
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} runs the CPU kernels (not the Triton ones yet); "
                         f"on {device} use kv_cache_dtype auto or float16")


def _check_lora_dtype(config: EngineConfig, device: torch.device, backend: Backend) -> None:
    stacked = device.type == "cuda" or backend == Backend.TRITON  # the Triton kernels read adapters in the model's dtype
    if stacked and config.torch_lora_dtype != config.torch_dtype:
        raise ValueError(f"lora_dtype {config.torch_lora_dtype} under dtype {config.torch_dtype} on the Triton / "
                         "CUDA path: adapters there are in the model's dtype")


def _check_deterministic(config: EngineConfig, backend: Backend, caps: CpuCaps, notes: list[str]) -> None:
    """--deterministic runs where every kernel it needs has a batch-invariant form: our C kernels on CPU (float32 or
    bfloat16, dense weights, a KV cache they read) or Triton on CUDA (docs/engine.md, "Deterministic inference")."""
    why = None
    if backend == Backend.NATIVE:
        why = "our C kernels (CPU) or Triton (CUDA); this machine runs the PyTorch path (no C compiler, or " \
              "LORAPLEX_KERNELS=torch)"
    elif config.quantization != "none":
        why = f"dense weights; quantization {config.quantization} is not batch-invariant yet"
    elif backend == Backend.CPU and config.torch_dtype not in (torch.float32, torch.bfloat16):
        why = f"float32 or bfloat16 on CPU, not {config.torch_dtype}"
    elif backend == Backend.CPU and config.kv_cache_dtype == "float16" and not caps.f16c:
        why = "a KV cache the C attention kernel reads (float16 needs F16C)"
    if why:
        raise ValueError(f"--deterministic needs {why}")
    notes.append(f"deterministic: every matmul, attention and LoRA kernel batch-invariant ({backend}); "
                 "prefill attention through the paged kernel")


def _check_tensor_parallel(config: EngineConfig, model: ModelConfig, device: torch.device, notes: list[str]) -> None:
    """What tensor parallelism serves: float weights of any family whose heads, MLP, experts and vocabulary split
    `tensor_parallel_size` ways; on CUDA one device per rank."""
    size = config.tensor_parallel_size
    if config.quantization != "none" or model.prequantized:
        raise ValueError(f"tensor_parallel_size {size}: quantized weights are not sharded (quantization "
                         f"{config.quantization}{', a ' + model.prequantized[0] + ' checkpoint' if model.prequantized else ''}); "
                         "serve float weights (quantization none)")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices, {torch.cuda.device_count()} visible")
    for rank in range(size):
        plan_for(model, size, rank)  # a split it cannot make is refused here, naming why
    notes.append(f"tensor parallelism: {size} worker processes ({'NCCL' if device.type == 'cuda' else 'gloo'}), "
                 "the model sharded; no CUDA graphs")


def _dtype(config: EngineConfig, model: ModelConfig, device: torch.device, caps: CpuCaps,
           tune: autotune.TuneTable, notes: list[str]) -> EngineConfig:
    """`auto`: under quantization bf16 where native; on CPU what the probe measures fastest; on CUDA bf16."""
    if config.dtype != "auto":
        return config
    if config.quantization != "none":
        chosen, why = quantized_activation_dtype(caps, tune)
        notes.append(f"dtype auto -> {chosen} under quantization {config.quantization} ({why})")
        return dataclasses.replace(config, dtype=chosen)
    if device.type != "cpu":
        return dataclasses.replace(config, dtype=str(config.torch_dtype).removeprefix("torch."))
    chosen, packed, why = autotune.resolve_dtype(model_shape(model), probe_linear, caps.native_bf16)
    packed = packed and config.pack_weights
    layout = "" if chosen != "float32" else ", weights packed" if packed else ", weights plain"
    notes.append(f"dtype auto -> {chosen}{layout} ({why})")
    return dataclasses.replace(config, dtype=chosen, pack_weights=packed)


def _num_kv_blocks(config: EngineConfig, model: ModelConfig, device: torch.device) -> int | None:
    """As given; on CPU `kv_cache_memory` bytes; on CUDA sized after loading (`gpu_memory_utilization`)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type == "cuda":
        return None
    return max(1, config.kv_cache_memory // kv_bytes_per_block(model, config.block_size, config.torch_kv_dtype))


def model_shape(model: ModelConfig) -> autotune.ModelShape:
    return autotune.ModelShape(model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
                               model.intermediate_size, model.vocab_size, model.num_layers)


def probe_linear(in_features: int, out_features: int, dtype: torch.dtype, packed: bool,
                 generator: torch.Generator) -> Linear:
    """One linear layer as the engine would build it in `dtype`, packed or on plain rows (the dtype probe)."""
    caps = CpuCaps.detect()
    kernels = KernelConfig(resolve_backend(torch.device("cpu")), "cpu", dtype, pack_weights=packed and
                           can_pack(dtype, caps.native_bf16), caps=caps)
    layer = Linear(in_features, out_features, False, kernels)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=generator) * in_features ** -0.5)
    layer.to(dtype)
    layer.process_weights_after_loading()
    return layer
