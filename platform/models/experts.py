"""A mixture-of-experts model's settings, read from its config.json as its family declares (`family.Experts`),
and which adapters it refuses: LoRA on a dense MLP module of a sparse layer. The experts' computation is
`moe.py`'s; this module holds no weights, so the adapter reader can ask it without building a model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.platform.models.family import Experts


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
    def from_raw(raw: dict, declared: Experts | None, name: str) -> "MoEConfig | None":
        """The MoE settings of a config.json (`name`: its architecture, for errors); None for a dense family."""
        if declared is None:
            return None
        raw = {**declared.defaults, **raw}
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{name}: experts with hidden_act {raw['hidden_act']!r} are not supported (silu is)")
        if not declared.windows and raw.get("use_sliding_window"):
            raise ValueError(f"{name}: use_sliding_window is not supported")
        # Qwen3-MoE's config class saves num_experts under Mixtral's name
        experts = raw.get("num_local_experts", raw.get("num_experts"))
        top_k = raw["num_experts_per_tok"]
        if not 0 < top_k <= experts:
            raise ValueError(f"{name}: num_experts_per_tok={top_k} with {experts} experts is not supported")
        return MoEConfig(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=raw[declared.size_key],
            renormalize=declared.always_renormalize or bool(raw.get("norm_topk_prob", False)),
            float_weights=declared.float_weights,
            shared_expert_size=raw.get("shared_expert_intermediate_size", 0),
            dense_layers=_dense_layers(raw) if declared.sparse_step else (),
            blocks=declared.blocks,
            expert_names=declared.names,
        )

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


def _dense_layers(raw: dict) -> tuple[int, ...]:
    """transformers' rule: a layer is sparse unless listed in mlp_only_layers or off the sparse step."""
    step, only = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
    return tuple(i for i in range(raw["num_hidden_layers"]) if i in only or (i + 1) % step)


def is_sparse_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` of the model (`ModelConfig`) gets a sparse block instead of a dense MLP."""
    return config.moe is not None and config.moe.is_sparse(layer)


# ---- adapters: what LoRA on a MoE layer can reach and what it cannot ------------------------------------------

MLP_MODULES = {"gate_proj", "up_proj", "down_proj"}
_LORA_KEY = re.compile(r"^base_model\.model\.|(\.base_layer)?\.lora_[AB](\.[\w-]+)?\.weight$")  # key -> module


def lora_refusal(config, raw: dict, keys: Iterable[str] = ()) -> str | None:
    """Why an adapter cannot be served on this MoE model (`ModelConfig`; None: it can, or the model is dense): its
    `target_modules` or weight `keys` name a dense MLP module of a layer that has experts instead (a wrong base
    model's adapter; its shared expert's and its experts' own, per expert or fused, are fine)."""
    moe: MoEConfig | None = config.moe
    if moe is None:
        return None
    listed = [str(name) for name in (raw.get("target_modules") if isinstance(raw.get("target_modules"), list) else ())]
    hit = sorted({_LORA_KEY.sub("", name) for name in [*listed, *keys] if _unservable(moe, name)})
    if not hit:
        return None
    more = f" and {len(hit) - 6} more" if len(hit) > 6 else ""
    return (f"it targets a dense MLP where {config.architecture} has experts ({', '.join(hit[:6])}{more}): "
            f"wrong base model?")


def _unservable(moe: MoEConfig, name: str) -> bool:
    parts = name.split(".")
    if not MLP_MODULES & set(parts) or "shared_expert" in parts or "experts" in parts:
        return False
    layer = next((int(b) for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()), None)
    return layer is not None and moe.is_sparse(layer)
