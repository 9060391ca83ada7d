"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE (shared expert behind a sigmoid gate) and Qwen3-MoE.

Routing follows transformers 5.24 step for step: router logits in the model's dtype, softmax in
float32, top-k, renormalised where the config says so, and the weights cast back to the model's
dtype except in Mixtral, which multiplies by the float32 weights. The experts run batched: the
(token, choice) pairs are sorted by expert and one grouped matmul (`F.grouped_mm`) covers every
expert used, with no host sync (so a decode step can be graph-captured on CUDA); where grouped_mm
does not take the device and dtype, one matmul per expert used.

Experts and routers stay float: `--quantization` is refused for these models, and so is an
adapter that targets them (`lora_refusal`); adapters on the attention projections apply as on
any decoder (`LoRALinear`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.custom_ops import SiluAndMul
from loraplex.kernels.dispatch import KernelConfig
from loraplex.platform.config import ModelConfig
from loraplex.platform.models.linear import Linear

# transformers' defaults for the keys a config.json may leave out, per architecture
MOE_DEFAULTS = {
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632},
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}
MOE_ARCHITECTURES = tuple(MOE_DEFAULTS)

# checkpoint names of one expert's gate, up and down projections
EXPERT_NAMES = {"MixtralForCausalLM": ("w1", "w3", "w2")}
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights divided by their sum (Mixtral always; Qwen: norm_topk_prob)
    float_weights: bool  # routing weights kept in float32 when they scale the expert outputs (Mixtral)
    shared_expert_size: int  # Qwen2-MoE's always-on expert behind a sigmoid gate; 0: none
    dense_layers: tuple[int, ...]  # layers that keep a dense MLP (decoder_sparse_step, mlp_only_layers)
    blocks: tuple[str, ...]  # the block's checkpoint names, tried in order (Mixtral: mlp, or the older one)
    expert_names: tuple[str, str, str]  # one expert's gate, up, down in the per-expert checkpoint layout

    @staticmethod
    def from_raw(raw: dict, arch: str) -> "MoEConfig | None":
        """The MoE settings of a config.json; None for a dense architecture."""
        if arch not in MOE_DEFAULTS:
            return None
        raw = {**MOE_DEFAULTS[arch], **raw}
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: experts with hidden_act {raw['hidden_act']!r} are not supported (silu is)")
        mixtral = arch == "MixtralForCausalLM"
        if not mixtral and raw.get("use_sliding_window"):  # Qwen2-MoE's and Qwen3-MoE's own window layouts
            raise ValueError(f"{arch}: use_sliding_window is not supported")
        # Qwen3-MoE's config class saves num_experts under Mixtral's name
        experts = raw["num_local_experts"] if mixtral else raw.get("num_local_experts", raw["num_experts"])
        top_k = raw["num_experts_per_tok"]
        if not 0 < top_k <= experts:
            raise ValueError(f"{arch}: num_experts_per_tok={top_k} with {experts} experts is not supported")
        return MoEConfig(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"],
            renormalize=mixtral or bool(raw.get("norm_topk_prob", False)),
            float_weights=mixtral,
            shared_expert_size=raw.get("shared_expert_intermediate_size", 0),
            dense_layers=() if mixtral else _dense_layers(raw),
            blocks=("mlp", "block_sparse_moe") if mixtral else ("mlp",),
            expert_names=EXPERT_NAMES.get(arch, QWEN_EXPERT_NAMES),
        )

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


def _dense_layers(raw: dict) -> tuple[int, ...]:
    """transformers' rule: a layer is sparse unless listed in mlp_only_layers or off the sparse step."""
    step, only = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
    return tuple(i for i in range(raw["num_hidden_layers"]) if i in only or (i + 1) % step)


def is_sparse_layer(config: ModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` of the model gets a `SparseMoEBlock` instead of a dense MLP."""
    return config.moe is not None and config.moe.is_sparse(layer)


class SparseMoEBlock(nn.Module):
    """Router, experts (gate_up [E, 2I, H] and down [E, H, I]) and, in Qwen2-MoE, the shared expert."""

    def __init__(self, config: ModelConfig, kernels: KernelConfig) -> None:
        super().__init__()
        moe: MoEConfig = config.moe
        if kernels.quantization != "none":
            raise ValueError(f"--quantization {kernels.quantization} is not supported for {config.architecture}: "
                             f"its experts would stay float; serve it with quantization none")
        self.moe, hidden = moe, config.hidden_size
        self.router = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.intermediate_size), requires_grad=False)
        self.act = SiluAndMul(kernels)
        self.grouped = _grouped_mm_takes(kernels)
        if moe.shared_expert_size:
            self.shared_gate_up = Linear(hidden, 2 * moe.shared_expert_size, False, kernels)
            self.shared_down = Linear(moe.shared_expert_size, hidden, False, kernels)
            self.shared_gate = nn.Parameter(torch.empty(1, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self.experts(x, weights, experts)
        if self.moe.shared_expert_size:
            shared = self.shared_down(self.act(self.shared_gate_up(x)))
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and experts [T, k], in transformers' order of operations."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float_weights else weights.to(logits.dtype)), experts

    def experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), the pairs grouped by expert."""
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: within an expert, tokens keep their order
        counts = torch.zeros(self.moe.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no host sync, unlike bincount
        rows, ids = x[order // top_k], flat[order]
        h = self.act(self._grouped(rows, self.w13, ids, counts))
        y = self._grouped(h, self.w2, ids, counts) * weights.reshape(-1)[order, None]
        out = torch.empty_like(y)
        out[order] = y
        return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)

    def _grouped(self, rows: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [S, in] sorted by expert (ids [S]: each row's; counts [E]: rows per expert) times each
        row's weight[e]^T."""
        if self.grouped:
            return grouped_matmul(rows, weight, counts)
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph: no host sync
            return masked_matmul(rows, weight, ids)
        return looped_matmul(rows, weight, counts)

    @torch.no_grad()
    def load_weights(self, take: Callable[[str], torch.Tensor], prefix: str) -> None:
        """This layer's router, experts and shared expert from a checkpoint, `prefix` = "model.layers.N.":
        experts fused per layer (transformers 5's `experts.gate_up_proj` / `experts.down_proj`, as
        `save_pretrained(save_original_format=False)` writes them) or one module per expert (what
        `save_pretrained` writes by default, and hub checkpoints)."""
        block, router = _take_first(take, [f"{prefix}{b}.gate.weight" for b in self.moe.blocks])
        _copy(self.router, router, block + "gate.weight")
        fused = _take_optional(take, block + "experts.gate_up_proj")
        if fused is not None:
            _copy(self.w13, fused, block + "experts.gate_up_proj")
            _copy(self.w2, take(block + "experts.down_proj"), block + "experts.down_proj")
        else:
            gate, up, down = self.moe.expert_names
            for e in range(self.moe.num_experts):
                name = f"{block}experts.{e}."
                _copy(self.w13[e], torch.cat([take(name + gate + ".weight"), take(name + up + ".weight")]),
                      f"{name}{gate} + {up}")
                _copy(self.w2[e], take(name + down + ".weight"), name + down + ".weight")
        if self.moe.shared_expert_size:
            shared = block + "shared_expert."
            _copy(self.shared_gate_up.weight, torch.cat([take(shared + "gate_proj.weight"),
                                                          take(shared + "up_proj.weight")]), shared + "gate_proj + up_proj")
            _copy(self.shared_down.weight, take(shared + "down_proj.weight"), shared + "down_proj.weight")
            _copy(self.shared_gate, take(block + "shared_expert_gate.weight"), block + "shared_expert_gate.weight")


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One grouped matmul over every expert used, its offsets on the device."""
    return F.grouped_mm(rows, weight.transpose(1, 2), offs=torch.cumsum(counts, 0, dtype=torch.int32))


def looped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One matmul per expert used (the group sizes read on the host)."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = F.linear(rows[start:start + n], weight[e])
            start += n
    return out


def masked_matmul(rows: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every row, each row keeping its own expert's: no data-dependent shape, so a
    CUDA graph can hold it (decode batches, where the weights' reads dominate anyway)."""
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        out = torch.where((ids == e)[:, None], F.linear(rows, weight[e]), out)
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


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
    param.copy_(value)


# ---- adapters: LoRA on experts, routers or shared experts is refused by name ---------------------------

MOE_MODULES = {"experts", "gate", "router", "shared_expert", "shared_expert_gate", "block_sparse_moe",
               "w1", "w2", "w3"}
MLP_MODULES = {"gate_proj", "up_proj", "down_proj"}
_LORA_KEY = re.compile(r"^base_model\.model\.|(\.base_layer)?\.lora_[AB](\.[\w-]+)?\.weight$")  # key -> module


def lora_refusal(config: ModelConfig, raw: dict, keys: Iterable[str] = ()) -> str | None:
    """Why an adapter cannot be served on this MoE model (None: it can, or the model is dense): its
    `target_modules` / `target_parameters` (adapter_config.json, `raw`) or weight `keys` reach an
    expert, a router or a shared expert, or a dense MLP module of a layer that has experts instead."""
    moe: MoEConfig | None = config.moe
    if moe is None:
        return None
    listed = [str(name) for key in ("target_modules", "target_parameters")
              for name in (raw.get(key) if isinstance(raw.get(key), list) else ())]
    hit = sorted({_LORA_KEY.sub("", name) for name in [*listed, *keys] if _reaches_moe(moe, name)})
    if not hit:
        return None
    more = f" and {len(hit) - 6} more" if len(hit) > 6 else ""
    return (f"it targets mixture-of-experts weights of {config.architecture} ({', '.join(hit[:6])}{more}): LoRA on "
            f"experts, routers and shared experts is not supported; target the attention projections")


def _reaches_moe(moe: MoEConfig, name: str) -> bool:
    parts = name.split(".")
    if MOE_MODULES & set(parts):
        return True
    if not MLP_MODULES & set(parts):
        return False
    layer = next((int(b) for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()), None)
    if layer is not None:
        return moe.is_sparse(layer)
    # a bare target name: peft puts it on the shared experts, and on nothing where every layer is sparse
    return moe.shared_expert_size > 0 or not moe.dense_layers
