"""LoRA on a mixture-of-experts layer, read from a PEFT folder: the router, the experts and Qwen2-MoE's shared
expert (`moe_lora.py` serves them).

What peft writes on transformers 5's MoE models:
- the router (`mlp.gate`, a parameter, not a Linear) and the experts' fused 3-D weights (`experts.gate_up_proj`
  [E, 2I, H], `experts.down_proj` [E, H, I]) through `target_parameters`: one LoRA per parameter,
  `lora_A` [r * E, in] (expert-major: expert e's rows are e * r ...) and `lora_B` [out, r * E] (expert-minor:
  column k * E + e), so expert e's delta is `scale * B[:, :, e] @ A[e]`. Two parameters of one module nest: the
  first's keys hold `experts.base_layer.`, the second's `experts.`; which is which is read from their shapes.
- the shared expert's projections and its gate (Linear modules) through `target_modules`, as any LoRA.
And what it wrote on older transformers, whose experts were one module each (`experts.3.w1` / `w3` / `w2` in
Mixtral, `experts.3.gate_proj` / `up_proj` / `down_proj` in Qwen's): one LoRA per expert and projection, read into
the same per-expert layout (gate and up side by side as one LoRA of twice the rank, B block-diagonal; an expert
the adapter leaves alone holds zeros).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from loraplex.platform.models.model_config import ModelConfig

MOE_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                     r"(gate|experts(?:\.base_layer)*|experts\.\d+\.\w+|shared_expert\.(?:gate_proj|up_proj|down_proj)"
                     r"|shared_expert_gate)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
PER_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)$")
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
SHARED = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate")


@dataclass
class LoRA:
    """One plain LoRA: A [r, in], B [out, r], scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class ExpertLoRA:
    """One expert weight's LoRA, per expert: A [E, r, in], B [E, out, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class MoELoRA:
    """One sparse layer's LoRA; None where the adapter leaves a part alone."""

    router: LoRA | None = None
    gate_up: ExpertLoRA | None = None
    down: ExpertLoRA | None = None
    shared: dict[str, LoRA] = field(default_factory=dict)  # "gate_proj" / "up_proj" / "down_proj" / "gate"

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.router, self.gate_up, self.down, *self.shared.values()]
        return [t for p in parts if p is not None for t in (p.a, p.b)]


def check_target_parameters(raw: dict, config: ModelConfig, fail) -> None:
    """`target_parameters` may name the experts' weights and the router of a MoE model, nothing else."""
    value = raw.get("target_parameters") or []
    if not value:
        return
    if config.moe is None:
        raise fail("target_parameters is not supported on a dense model (target_modules is)")
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise fail(f"target_parameters must be a list of parameter names, got {value!r}")
    other = sorted(p for p in value if not p.endswith(EXPERT_PARAMETERS + ("gate.weight",)))
    if other:
        raise fail(f"target_parameters {other} is not supported (only the experts' {list(EXPERT_PARAMETERS)} and "
                   "the router's gate.weight)")
    if raw.get("use_dora") or raw.get("lora_bias") or raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise fail("DoRA, lora_bias and rank / alpha patterns are not supported beside target_parameters")


def read_moe_weights(tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, scale: float,
                     dtype: torch.dtype, fail) -> dict[int, MoELoRA]:
    """layer -> its MoE LoRA, from the folder's keys that match MOE_KEY."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = MOE_KEY.match(key).groups()
        layer = int(layer)
        if layer >= config.num_layers or not config.moe.is_sparse(layer):
            raise fail(f"weight {key!r} is for experts of layer {layer}, which has none: wrong base model?")
        found.setdefault((layer, module), {})[which] = tensor
    layers: dict[int, MoELoRA] = {}
    per_expert: dict[int, dict[tuple[int, str], LoRA]] = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise fail(f"layer {layer} {module}: lora_A and lora_B must both be present")
        moe = layers.setdefault(layer, MoELoRA())
        name = f"layer {layer} {module}"
        one = PER_EXPERT.match(module)
        if one:
            per_expert.setdefault(layer, {})[(int(one[1]), one[2])] = _expert_module(ab, config, one, rank, scale,
                                                                                     dtype, name, fail)
        elif module == "gate":
            moe.router = _plain(ab, rank, config.hidden_size, config.moe.num_experts, scale, dtype, name, fail)
        elif module.startswith("experts"):
            kind, lora = _experts(ab, config, rank, scale, dtype, name, fail)
            if getattr(moe, kind) is not None:
                raise fail(f"layer {layer}: two LoRAs on the experts' {kind} weight")
            setattr(moe, kind, lora)
        else:
            part = module.rpartition(".")[2].removeprefix("shared_expert_")
            in_f, out_f = _shared_shape(config, part)
            moe.shared[part] = _plain(ab, rank, in_f, out_f, scale, dtype, name, fail)
    for layer, modules in per_expert.items():
        if layers[layer].gate_up is not None or layers[layer].down is not None:
            raise fail(f"layer {layer}: LoRA on its experts both per expert and on their fused weights")
        layers[layer].gate_up, layers[layer].down = _stacked(modules, config, rank, scale, dtype)
    return layers


def _expert_module(ab, config: ModelConfig, match, rank: int, scale: float, dtype, name: str, fail) -> LoRA:
    """One expert's gate, up or down module (older transformers' per-expert layout)."""
    expert, part = int(match[1]), match[2]
    gate, up, down = config.moe.expert_names
    if expert >= config.moe.num_experts or part not in (gate, up, down):
        raise fail(f"{name}: not an expert module of {config.architecture} (experts 0-{config.moe.num_experts - 1}, "
                   f"{gate} / {up} / {down})")
    hidden, inter = config.hidden_size, config.moe.intermediate_size
    in_f, out_f = (inter, hidden) if part == down else (hidden, inter)
    return _plain(ab, rank, in_f, out_f, scale, dtype, name, fail)


def _stacked(modules: dict[tuple[int, str], LoRA], config: ModelConfig, rank: int, scale: float, dtype
             ) -> tuple[ExpertLoRA | None, ExpertLoRA | None]:
    """Per-expert LoRAs -> the fused layout: gate_up of rank 2r (gate's A over up's, B block-diagonal), down of
    rank r; zeros for an expert (or a projection) the adapter leaves alone."""
    experts, hidden, inter = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
    gate, up, down = config.moe.expert_names
    gate_up, down_lora = None, None
    if any(part in (gate, up) for _, part in modules):
        gate_up = ExpertLoRA(torch.zeros(experts, 2 * rank, hidden, dtype=dtype),
                             torch.zeros(experts, 2 * inter, 2 * rank, dtype=dtype), scale)
    if any(part == down for _, part in modules):
        down_lora = ExpertLoRA(torch.zeros(experts, rank, inter, dtype=dtype),
                               torch.zeros(experts, hidden, rank, dtype=dtype), scale)
    for (expert, part), lora in modules.items():
        if part == down:
            down_lora.a[expert], down_lora.b[expert] = lora.a, lora.b
        else:
            k = 0 if part == gate else 1
            gate_up.a[expert, k * rank:(k + 1) * rank] = lora.a
            gate_up.b[expert, k * inter:(k + 1) * inter, k * rank:(k + 1) * rank] = lora.b
    return gate_up, down_lora


def _plain(ab, rank: int, in_f: int, out_f: int, scale: float, dtype, name: str, fail) -> LoRA:
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
        raise fail(f"{name}: shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit the base model (expected "
                   f"A({rank}, {in_f}) B({out_f}, {rank})): wrong base model?")
    return LoRA(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale)


def _experts(ab, config: ModelConfig, rank: int, scale: float, dtype, name: str, fail) -> tuple[str, ExpertLoRA]:
    """Which expert weight (gate_up / down) a 3-D LoRA is for, by its shapes, in our per-expert layout."""
    experts, hidden, inter = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
    shapes = {"gate_up": ((rank * experts, hidden), (2 * inter, rank * experts)),
              "down": ((rank * experts, inter), (hidden, rank * experts))}
    got = (tuple(ab["A"].shape), tuple(ab["B"].shape))
    kind = next((k for k, want in shapes.items() if got == want), None)
    if kind is None:
        raise fail(f"{name}: shapes A{got[0]} B{got[1]} fit neither experts.gate_up_proj {shapes['gate_up']} nor "
                   f"experts.down_proj {shapes['down']} of rank {rank}: wrong base model?")
    a = ab["A"].reshape(experts, rank, -1)
    b = ab["B"].reshape(ab["B"].shape[0], rank, experts).permute(2, 0, 1)
    return kind, ExpertLoRA(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale)


def _shared_shape(config: ModelConfig, part: str) -> tuple[int, int]:
    hidden, size = config.hidden_size, config.moe.shared_expert_size
    return {"gate_proj": (hidden, size), "up_proj": (hidden, size), "down_proj": (size, hidden),
            "gate": (hidden, 1)}[part]
