"""Weight formats as objects, in the shape of vLLM's `LinearMethodBase`: `create_weights` (the layer's float
parameters, which the loader fills), `process_weights_after_loading` (pack, quantize or tile them, once) and
`apply`. `linear_method` picks one per layer from the model's `KernelConfig`, once, before the model is built;
`apply` decides nothing but what its token-count table says.

- `TorchLinear`: `F.linear` on the plain weight (CUDA, `LORAPLEX_KERNELS=torch`, no oneDNN).
- `PlainF32Linear`: float32 rows as they are; our C kernel streams them for decode-sized calls, MKL's GEMM
  beyond (docs/benchmarks-history.md, "float32 weights: plain rows and our kernel"); `dtype=auto` picks it where the probe
  measures it faster than oneDNN's packing.
- `OneDNNLinear`: the weight reordered once into oneDNN's blocked layout (BENCHMARKS.md, "Engine speed").
- `AMXLinear`: bf16 weights packed into our AMX kernel's B tiles (BENCHMARKS.md, "Dense bf16 weights on AMX").
- `InvariantLinear`: `--deterministic`: plain rows through `batch_invariant_matmul` (docs/engine.md,
  "Deterministic inference").
- `QuantizedLinear`: q4 (GGUF Q4_1 blocks, GPTQ, AWQ) or 8-bit weights, kept in the layout this CPU's kernels
  read, multiplied through a `quant.QuantPlan` (BENCHMARKS.md, "Quantized weights").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_kernels, quant
from loraplex.kernels.cpu_kernels import CpuCaps
from loraplex.kernels.dispatch import Backend, KernelConfig
from loraplex.kernels.quant import QuantizedWeight


class LinearMethod:
    """A weight format. The layer holds `weight` [N, K] (and `bias`) until `process_weights_after_loading`;
    `layer.shared_weight` marks a weight another module also reads (a tied embedding table): kept. Checkpoint
    tensors arrive through `load` (the layer's `weight_loader`), so a format sees each weight as the checkpoint
    holds it; what a format keeps after processing is its own attribute, set by its own `create_weights`."""

    name = "plain"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        layer.shared_weight = False

    def load(self, layer: nn.Module, weight: torch.Tensor, quantized: QuantizedWeight | None = None) -> None:
        """A checkpoint's weight [N, K] copied in (converted to the layer's dtype); `quantized`: bits a
        checkpoint already holds for it, which only a quantized format takes."""
        if quantized is not None:
            raise ValueError(f"{self.name} weights cannot take quantized bits")
        _check_shape(layer, weight)
        layer.weight.copy_(weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as a plain [N, K] tensor (prompt logprobs' slices, tests)."""
        return layer.weight

    def served(self, weight: torch.Tensor) -> torch.Tensor:
        """A float weight as this format would serve it (an adapter's copy of a head is compared with it)."""
        return weight

    def rows(self, layer: nn.Module, index: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{self.name} weights hold no embedding table")

    @staticmethod
    def _drop_weight(layer: nn.Module) -> None:
        if not layer.shared_weight:
            layer.weight = None


class TorchLinear(LinearMethod):
    name = "torch"

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


class PlainF32Linear(LinearMethod):
    """Up to `max_tokens` tokens a call our C kernel (inputs are the model's own activations: contiguous,
    never seen by autograd); beyond, MKL's GEMM on the same rows."""

    name = "float32 rows"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def apply(self, layer, x):
        weight = layer.weight  # a parameter: each read goes through Module.__getattr__
        if x.numel() <= self.max_tokens * layer.in_features:
            y = cpu_kernels.f32_matmul_c(x, weight)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, weight, layer.bias)


class InvariantLinear(LinearMethod):
    """--deterministic: `batch_invariant_matmul`, whose sums for a token do not depend on the other tokens of the
    call or on how many there are (the weight kept as plain rows in the model's dtype)."""

    name = "batch-invariant rows"

    def __init__(self, matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.matmul = matmul

    def create_weights(self, layer, in_features, out_features, bias):
        if in_features % 8:
            raise ValueError(f"deterministic inference multiplies inputs of a multiple of 8 features, got {in_features}")
        super().create_weights(layer, in_features, out_features, bias)

    def apply(self, layer, x):
        y = self.matmul(x, layer.weight)
        return y if layer.bias is None else y + layer.bias


def batch_invariant_matmul(config: KernelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`(x [..., K], w [N, K]) -> x w^T` with each token's sums in one fixed order, whatever the token count
    (deterministic mode): our C kernels on CPU (float32 weights as they are, 16-bit ones widened per tile, float32
    sums rounded once), a Triton kernel with one fixed tiling and no split-K on CUDA."""
    if config.backend == Backend.TRITON:
        from loraplex.kernels.matmul_triton import invariant_matmul_triton

        return invariant_matmul_triton
    if config.backend == Backend.CPU:
        return _invariant_matmul_cpu
    raise ValueError(f"deterministic inference runs our C kernels (CPU) or Triton (CUDA), not the {config.backend} "
                     "backend")


def _invariant_matmul_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return cpu_kernels.f32_matmul_c(x.contiguous(), weight)
    return cpu_kernels.bf16w_matmul_c(x.float(), weight).to(x.dtype)


class OneDNNLinear(LinearMethod):
    name = "oneDNN packed"

    def create_weights(self, layer, in_features, out_features, bias):
        super().create_weights(layer, in_features, out_features, bias)
        layer.packed = None  # oneDNN's blocked layout, once processed

    def process_weights_after_loading(self, layer):
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        self._drop_weight(layer)

    def apply(self, layer, x):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")

    def dense_weight(self, layer):
        return layer.weight if layer.weight is not None else layer.packed.to_dense()


class AMXLinear(LinearMethod):
    name = "AMX tiles"

    def create_weights(self, layer, in_features, out_features, bias):
        super().create_weights(layer, in_features, out_features, bias)
        layer.amx_packed = None  # our kernel's B tiles, once processed

    def process_weights_after_loading(self, layer):
        layer.amx_packed = cpu_kernels.pack_bf16_amx(layer.weight.detach())
        self._drop_weight(layer)

    def apply(self, layer, x):
        y = cpu_kernels.bf16_matmul_amx_c(x.reshape(-1, layer.in_features), layer.amx_packed, layer.out_features)
        y = y.reshape(*x.shape[:-1], layer.out_features)
        return y if layer.bias is None else y + layer.bias

    def dense_weight(self, layer):
        return cpu_kernels.unpack_bf16_amx(layer.amx_packed, layer.out_features)

    def rows(self, layer, index: torch.Tensor) -> torch.Tensor:
        """Rows of the weight read from the tiles: a tied embedding table with no copy of its own."""
        return cpu_kernels.rows_bf16_amx(layer.amx_packed, index)


class QuantizedLinear(LinearMethod):
    """`kind` "q4" or "q8" (`group`: None = per output channel). The loader may hand over the weight already
    quantized (`layer.quantized`: a GGUF's or GPTQ / AWQ checkpoint's bits); else it is quantized from the
    float weight. A tied 8-bit head may also hold its values as bf16 AMX tiles (`tile_table_into_head`): its
    plan then sends calls from the tile kernel's lower bound on to them."""

    name = "quantized"

    def __init__(self, kind: str, group: int | None, config: KernelConfig) -> None:
        self.kind, self.group, self.config = kind, group, config

    def create_weights(self, layer, in_features, out_features, bias):
        super().create_weights(layer, in_features, out_features, bias)
        layer.quantized = layer.head_tiles = None  # the bits; a tied head's bf16 tiles (`share_tiles`)

    def load(self, layer, weight, quantized=None):
        """The float weight kept until processing (a tied table reads it); the bits quantized from the
        checkpoint's own numbers, before any rounding to the model's dtype, or the checkpoint's bits (a
        GGUF's, a GPTQ / AWQ checkpoint's), which must be those numbers."""
        _check_shape(layer, weight)
        if quantized is None:
            quantized = quant.quantize(weight.float(), self.kind, self.group)
        elif not torch.allclose(quant.dequantize(quantized), weight.detach().float(), rtol=1e-5, atol=1e-6):
            raise ValueError("quantized bits do not match the checkpoint's float weight: not its source")
        layer.weight.copy_(weight)
        layer.quantized = quantized

    def process_weights_after_loading(self, layer):
        config = self.config
        weight = layer.quantized if layer.quantized is not None else quant.quantize(layer.weight, self.kind, self.group)
        if weight.shape != (layer.out_features, layer.in_features):
            raise ValueError(f"quantized weight of shape {weight.shape} for a {layer.out_features}x"
                             f"{layer.in_features} layer")
        cpu = config.backend == Backend.CPU
        layer.quantized = quant.for_this_cpu(weight, cpu and config.caps.amx)
        layer.plan = quant.plan(layer.quantized, config.tune, config.caps if cpu else CpuCaps())
        self._drop_weight(layer)

    def apply(self, layer, x):
        y = layer.plan(x)
        return y if layer.bias is None else y + layer.bias

    def share_tiles(self, layer, tiles: torch.Tensor) -> None:
        """Calls from the tile kernel's lower bound on read `tiles` (the same values in bf16) instead."""
        n = layer.out_features
        layer.head_tiles = tiles
        layer.plan = layer.plan.taking_from(self.config.tune.amx_tokens[0], "head tiles",
                                            lambda x: cpu_kernels.bf16_matmul_amx_c(x, tiles, n))

    def dense_weight(self, layer):
        return quant.dequantize(layer.quantized)

    def served(self, weight):
        return quant.dequantize(quant.quantize(weight, self.kind, self.group))

    def rows(self, layer, index: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rows_bf16_amx(layer.head_tiles, index)


def _check_shape(layer: nn.Module, weight: torch.Tensor) -> None:
    if tuple(weight.shape) != (layer.out_features, layer.in_features):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for a {layer.out_features}x{layer.in_features} layer")


def can_pack(dtype: torch.dtype, native_bf16: bool) -> bool:
    """oneDNN (CPU), in float32, or in bfloat16 where the CPU multiplies bf16 natively."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or dtype == torch.bfloat16 and native_bf16


def amx_packs(config: KernelConfig, dtype: torch.dtype, in_features: int) -> bool:
    """Whether a weight of `dtype` goes to our AMX bf16 kernel (else, packed, to oneDNN)."""
    return config.backend == Backend.CPU and config.caps.amx and dtype == torch.bfloat16 and in_features % 32 == 0


def linear_method(config: KernelConfig, in_features: int, quantized: tuple[str, int | None] | None = None
                  ) -> LinearMethod:
    """The weight format of one layer: `quantized` (kind, group) where the model is served quantized; else
    packed for oneDNN or our AMX kernel where weights are packed, plain float32 rows for our kernel, or torch."""
    if quantized is not None:
        return QuantizedLinear(*quantized, config)
    if config.deterministic:
        return InvariantLinear(batch_invariant_matmul(config))
    if config.device_type != "cpu":
        return TorchLinear()
    if config.pack_weights and can_pack(config.dtype, config.caps.native_bf16):
        return AMXLinear() if amx_packs(config, config.dtype, in_features) else OneDNNLinear()
    if config.backend == Backend.CPU and config.dtype == torch.float32 and in_features % 8 == 0:
        return PlainF32Linear(config.tune.f32_kernel_tokens)
    return TorchLinear()


def tile_table_into_head(config: KernelConfig, head: nn.Module, table: torch.Tensor) -> bool:
    """A tied table held once, as the head's AMX tiles: true where the head now serves `rows` (the table's
    own copy can go). An 8-bit head gets the tiles only where the table is exactly its values (a GGUF's
    Q8_0 blocks): they take its calls of a few tokens and more (docs/benchmarks-history.md, "q4 in bf16 on AMX")."""
    if not amx_packs(config, table.dtype, table.shape[1]):
        return False
    if isinstance(head.method, QuantizedLinear):
        if not torch.equal(quant.dequantize(head.quantized).to(table.dtype), table):
            return False  # quantized at load: the head's numbers are not the table's
        head.method.share_tiles(head, cpu_kernels.pack_bf16_amx(table.detach()))
    elif not isinstance(head.method, AMXLinear):
        return False
    head.shared_weight = False
    head.weight = None
    return True
