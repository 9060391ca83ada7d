"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE (shared expert behind a sigmoid gate) and Qwen3-MoE.

Routing follows transformers 5.24 step for step: router logits in the model's dtype, softmax in
float32, top-k, renormalised where the config says so, and the weights cast back to the model's
dtype except in Mixtral, which multiplies by the float32 weights. The experts run batched: the
(token, choice) pairs are sorted by expert and one grouped matmul (`F.grouped_mm`) covers every
expert used, with no host sync (so a decode step can be graph-captured on CUDA); where grouped_mm
does not take the device and dtype, one matmul per expert used.

Experts and routers stay float: `--quantization` is refused for these models. Adapters on the attention
projections apply as on any decoder; an adapter's router, experts and shared expert come in as `lora`, an
optional delta (`adapters/moe_lora.py`'s `MoEDelta`) that the block asks at each of those points: the router's
logits, each (token, expert) pair's gate_up and down outputs, the shared expert's and its gate's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.custom_ops import SiluAndMul, pointwise_op
from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.linear_methods import batch_invariant_matmul
from loraplex.platform.distributed import all_reduce, identity
from loraplex.platform.models.experts import MoEConfig
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.models.sharding import column, gate_up_rows, row, span

class SparseMoEBlock(nn.Module):
    """Router, experts (gate_up [E, 2I, H] and down [E, H, I]) and, in Qwen2-MoE, the shared expert. Under
    tensor parallelism a rank holds the experts `plan.experts` (the router whole) and its columns of the shared
    expert; each rank's output is a partial sum, all-reduced at the end."""

    def __init__(self, config: ModelConfig, kernels: KernelConfig) -> None:
        super().__init__()
        moe: MoEConfig = config.moe
        if kernels.quantization != "none":
            raise ValueError(f"--quantization {kernels.quantization} is not supported for {config.architecture}: "
                             f"its experts would stay float; serve it with quantization none")
        self.moe, hidden, plan = moe, config.hidden_size, config.shard
        self.held = plan.experts if plan else (0, moe.num_experts)  # [first, end) of the experts this rank holds
        held = self.held[1] - self.held[0]
        self.router = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(held, 2 * moe.intermediate_size, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(held, hidden, moe.intermediate_size), requires_grad=False)
        self.experts = self.held_experts if plan else self.all_experts
        self.reduce = all_reduce if plan else identity
        self.act = SiluAndMul(kernels)
        # --deterministic: every product through the batch-invariant matmul, one expert at a time (a grouped
        # matmul's tiling follows the groups' sizes)
        self.linear = batch_invariant_matmul(kernels) if kernels.deterministic else F.linear
        self.grouped = _grouped_mm_takes(kernels) and not kernels.deterministic
        self.sigmoid = pointwise_op(kernels, torch.sigmoid)
        if moe.shared_expert_size:
            first, end = plan.shared_expert if plan else (0, moe.shared_expert_size)
            self.shared_gate_up = Linear(hidden, 2 * (end - first), False, kernels, None,
                                         plan and column(gate_up_rows((first, end), moe.shared_expert_size)))
            self.shared_down = Linear(end - first, hidden, False, kernels, None,
                                      plan and row(span(first, end)))
            self.shared_gate = nn.Parameter(torch.empty(1, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        weights, experts = self.route(x, lora)
        out = self.experts(x, weights, experts, lora)
        if self.moe.shared_expert_size:
            out = out + self.shared(x, lora)
        return self.reduce(out)

    def shared(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """The shared expert's output times its sigmoid gate."""
        gate_up, gate = self.shared_gate_up(x), self.linear(x, self.shared_gate)
        if lora is not None:
            gate_up, gate = lora.shared("gate_up", x, gate_up), lora.shared("gate", x, gate)
        h = self.act(gate_up)
        down = self.shared_down(h)
        return self.sigmoid(gate) * (down if lora is None else lora.shared("down", h, down))

    def route(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and experts [T, k], in transformers' order of operations."""
        logits = self.linear(x, self.router)
        if lora is not None:
            logits = lora.router(x, logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float_weights else weights.to(logits.dtype)), experts

    def all_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, lora=None) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), the pairs grouped by expert."""
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: within an expert, tokens keep their order
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no host sync, unlike bincount
        rows, ids = x[order // top_k], flat[order]
        h, y = self._pairs(rows, order // top_k, ids, counts, lora)
        y = y * weights.reshape(-1)[order, None]
        out = torch.empty_like(y)
        out[order] = y
        return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)

    def held_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, lora=None) -> torch.Tensor:
        """The (token, choice) pairs of the experts this rank holds, each token's partial sum (zero where none of
        its experts is here). Pairs are picked on the host: tensor parallelism runs without CUDA graphs."""
        flat, first = experts.reshape(-1), self.held[0]
        pairs = ((flat >= first) & (flat < self.held[1])).nonzero().squeeze(1)
        ids, order = torch.sort(flat[pairs] - first, stable=True)
        pairs = pairs[order]
        counts = torch.bincount(ids, minlength=self.w13.shape[0]).to(torch.int32)
        tokens = pairs // experts.shape[1]
        h, y = self._pairs(x[tokens], tokens, ids, counts, lora)
        y = y * weights.reshape(-1)[pairs, None]
        return torch.zeros(x.shape[0], y.shape[1], dtype=y.dtype, device=x.device).index_add_(0, tokens, y).to(x.dtype)

    def _pairs(self, rows: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, lora
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts on the (token, expert) pairs sorted by expert: (activations, outputs), each pair's
        adapter added where `lora` has one."""
        gate_up = self._grouped(rows, self.w13, ids, counts)
        if lora is not None:
            gate_up = lora.experts("gate_up", rows, tokens, ids, gate_up)
        h = self.act(gate_up)
        down = self._grouped(h, self.w2, ids, counts)
        return h, down if lora is None else lora.experts("down", h, tokens, ids, down)

    def _grouped(self, rows: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [S, in] sorted by expert (ids [S]: each row's; counts [E]: rows per expert) times each
        row's weight[e]^T."""
        if self.grouped:
            return grouped_matmul(rows, weight, counts)
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph: no host sync
            return masked_matmul(rows, weight, ids, self.linear)
        return looped_matmul(rows, weight, counts, self.linear)

    @torch.no_grad()
    def load_weights(self, take: Callable[[str], torch.Tensor], prefix: str) -> None:
        """This layer's router, experts and shared expert from a checkpoint, `prefix` = "model.layers.N.":
        experts fused per layer (transformers 5's `experts.gate_up_proj` / `experts.down_proj`, as
        `save_pretrained(save_original_format=False)` writes them) or one module per expert (what
        `save_pretrained` writes by default, and hub checkpoints)."""
        block, router = _take_first(take, [f"{prefix}{b}.gate.weight" for b in self.moe.blocks])
        _copy(self.router, router, block + "gate.weight")
        fused, (first, end) = _take_optional(take, block + "experts.gate_up_proj"), self.held
        if fused is not None:
            _copy(self.w13, fused[first:end], block + "experts.gate_up_proj")
            _copy(self.w2, take(block + "experts.down_proj")[first:end], block + "experts.down_proj")
        else:
            gate, up, down = self.moe.expert_names
            for e in range(self.moe.num_experts):  # every expert's weights taken, the held ones kept
                name = f"{block}experts.{e}."
                w13 = torch.cat([take(name + gate + ".weight"), take(name + up + ".weight")])
                w2 = take(name + down + ".weight")
                if first <= e < end:
                    _copy(self.w13[e - first], w13, f"{name}{gate} + {up}")
                    _copy(self.w2[e - first], w2, name + down + ".weight")
        if self.moe.shared_expert_size:
            shared = block + "shared_expert."
            gate_up = torch.cat([take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")])
            _load(self.shared_gate_up, gate_up, shared + "gate_proj + up_proj")
            _load(self.shared_down, take(shared + "down_proj.weight"), shared + "down_proj.weight")
            _copy(self.shared_gate, take(block + "shared_expert_gate.weight"), block + "shared_expert_gate.weight")


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One grouped matmul over every expert used, its offsets on the device."""
    return F.grouped_mm(rows, weight.transpose(1, 2), offs=torch.cumsum(counts, 0, dtype=torch.int32))


def looped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, linear=F.linear) -> torch.Tensor:
    """One matmul per expert used (the group sizes read on the host), by `linear` (x, w) -> x w^T."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = linear(rows[start:start + n], weight[e])
            start += n
    return out


def masked_matmul(rows: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, linear=F.linear) -> torch.Tensor:
    """Every expert on every row, each row keeping its own expert's: no data-dependent shape, so a
    CUDA graph can hold it (decode batches, where the weights' reads dominate anyway)."""
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        out = torch.where((ids == e)[:, None], linear(rows, weight[e]), out)
    return out


def _grouped_mm_takes(kernels: KernelConfig) -> bool:
    """F.grouped_mm runs on CPU in every float dtype (torch >= 2.10); on CUDA in bfloat16 from SM80."""
    if not hasattr(F, "grouped_mm"):
        return False
    if kernels.device_type == "cpu":
        return True
    return kernels.device_type == "cuda" and kernels.dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability() >= (8, 0)


def _take_optional(take: Callable[[str], torch.Tensor], name: str) -> torch.Tensor | None:
    try:
        return take(name)
    except ValueError:  # `take` refuses a missing weight: here that only means the other layout
        return None


def _take_first(take: Callable[[str], torch.Tensor], names: list[str]) -> tuple[str, torch.Tensor]:
    """(the block prefix of the first name present, its tensor); missing everywhere: the error names the last."""
    for name in names[:-1]:
        value = _take_optional(take, name)
        if value is not None:
            return name[:-len("gate.weight")], value
    return names[-1][:-len("gate.weight")], take(names[-1])


def _load(layer: Linear, weight: torch.Tensor, name: str) -> None:
    """A checkpoint's full weight through the layer's loader (which takes a tensor-parallel rank's part)."""
    try:
        layer.weight_loader(weight)
    except ValueError as exc:
        raise ValueError(f"weight {name}: {exc}") from None


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
    param.copy_(value)
