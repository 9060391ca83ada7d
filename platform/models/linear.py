"""nn.Linear whose weight can be reordered once into oneDNN's blocked layout for CPU matmuls,
or replaced by a 4- or 8-bit quantized one (`kernels/quant.py`).

At decode batch sizes the prepacked oneDNN matmul runs the model's linear layers ~2x faster
than `F.linear` on the plain weight here (BENCHMARKS.md, "Engine speed"), so the CPU engine
packs every linear layer after loading and drops the plain copy. A bf16 weight on a CPU with AMX
is packed into the tiles of our own C kernel instead: 1.2-1.4x oneDNN's speed at decode sizes and
up to ~1000 tokens, 0.8x at prefill chunks of 2048 (BENCHMARKS.md, "Dense bf16 weights on AMX").
With `--quantization` the weight is kept quantized instead (q4 on AMX in the tile kernel's order) and
multiplied by the weight-only kernel. A float32 weight left plain (`dtype=auto`, where the start-up probe
measures plain rows faster than oneDNN's packing, as on CPUs whose oneDNN GEMV is slow) is multiplied by our
C kernel at decode sizes and by MKL's GEMM beyond.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_kernels
from loraplex.kernels.cpu_kernels import native_bf16
from loraplex.kernels.dispatch import backend
from loraplex.kernels.quant import AMX_TOKENS, QuantizedWeight, dequantize, for_this_cpu, quantized_matmul


# Plain float32 weights: our kernel up to here (from 4 tokens faster than MKL's GEMM on the same rows, within ~10%
# of its GEMV at 1-3; at 1-2 tokens capped at AVX2 MKL takes twice as long; BENCHMARKS.md, "float32 weights:
# plain rows and our kernel"), MKL's GEMM beyond
F32_KERNEL_TOKENS = 24


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN (CPU), in float32, or in bfloat16 where the CPU multiplies bf16 natively."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and native_bf16()


def amx_packs(weight: torch.Tensor) -> bool:
    """Whether `pack` lays this weight out for the AMX bf16 kernel (else for oneDNN)."""
    return (weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and backend() == "auto"
            and cpu_kernels.amx_supported())


class PackedLinear(nn.Linear):
    packed: torch.Tensor | None = None  # oneDNN's blocked layout
    amx_packed: torch.Tensor | None = None  # `cpu_kernels.pack_bf16_amx`'s tiles
    quantized: QuantizedWeight | None = None

    def pack(self, keep_weight: bool = False) -> None:
        """Call after the last dtype/device move. `keep_weight` for a weight shared with
        another module (tied embeddings)."""
        weight = self.weight.detach()
        if amx_packs(weight):
            self.amx_packed = cpu_kernels.pack_bf16_amx(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        if not keep_weight:
            del self.weight
            self.register_parameter("weight", None)

    def quantize(self, weight: QuantizedWeight, keep_weight: bool = False) -> None:
        """Multiply by `weight` from now on (in the layout this CPU's kernel reads); the float weight is
        dropped unless shared."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {weight.shape} for a {self.out_features}x{self.in_features} layer")
        self.quantized = for_this_cpu(weight)
        if not keep_weight:
            del self.weight
            self.register_parameter("weight", None)

    def dense_weight(self) -> torch.Tensor:
        if self.weight is not None:
            return self.weight
        if self.quantized is not None:
            return dequantize(self.quantized)
        if self.amx_packed is not None:
            return cpu_kernels.unpack_bf16_amx(self.amx_packed, self.out_features)
        return self.packed.to_dense()

    def _f32_kernel_takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """A decode-sized call on a plain float32 weight goes to our C kernel (not one autograd must see).
        Checked per call in ~1 us (`cpu_kernels.usable` would take twice that, 120 calls a step)."""
        return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
                and not (weight.requires_grad or x.requires_grad) and self.in_features % 8 == 0
                and 0 < x.numel() <= F32_KERNEL_TOKENS * self.in_features and x.is_contiguous()
                and weight.is_contiguous() and backend() == "auto" and cpu_kernels.library() is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a tied 8-bit head may also hold its values as AMX tiles (`share_table_through_head_tiles`): 3+ tokens
        if self.quantized is not None and (self.amx_packed is None or x.numel() // self.in_features < AMX_TOKENS[0]):
            y = quantized_matmul(x, self.quantized)
            return y if self.bias is None else y + self.bias
        if self.amx_packed is not None:
            y = cpu_kernels.bf16_matmul_amx_c(x.reshape(-1, self.in_features), self.amx_packed, self.out_features)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.packed is None:
            weight = self.weight  # a parameter: each read goes through Module.__getattr__
            if self._f32_kernel_takes(x, weight):
                y = cpu_kernels.f32_matmul_c(x, weight)
                return y if self.bias is None else y + self.bias
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
