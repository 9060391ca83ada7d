"""What a model family is, declared once: a `Family` says how its config.json becomes a `ModelConfig`, how its
checkpoint names map onto our fused projections, which modules LoRA may target, its experts, and which decoder
layer it runs. Weight loading, quantization, LoRA attach and PEFT key parsing read the declaration; nothing
outside a family's declaration decides by architecture string (`registry.py` maps the strings to families).

The declarations themselves live in `families.py`; a family whose layers differ has its decoder layer in a module
of its own (`olmo2.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Our fused projections and the Hugging Face / peft modules each one stacks, in output order.
FUSED_PROJECTIONS = MappingProxyType({
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
})

# Checkpoints that hold q/k/v and gate/up already fused under our names (Phi-3): each projection is one module.
PREFUSED_PROJECTIONS = MappingProxyType({fused: (fused,) for fused in FUSED_PROJECTIONS})

# Which block of a decoder layer owns each fused projection (the checkpoint's and our module path alike).
PROJECTION_BLOCKS = MappingProxyType({"qkv_proj": "self_attn", "o_proj": "self_attn",
                                      "gate_up_proj": "mlp", "down_proj": "mlp"})

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's, by transformers' names
LAYER_TYPES = ("full_attention", "sliding_attention")


def all_full(raw: dict) -> tuple[str, ...]:
    """Every layer attends to its whole context (Llama, Granite)."""
    return ("full_attention",) * raw["num_hidden_layers"]


def one_window(raw: dict) -> tuple[str, ...]:
    """Every layer slides when the config has a window (Mistral, Mixtral, Phi-3)."""
    return ("sliding_attention" if raw.get("sliding_window") else "full_attention",) * raw["num_hidden_layers"]


def given_layer_types(raw: dict) -> tuple[str, ...] | None:
    """The config's own `layer_types`, checked; None where it has none."""
    if not raw.get("layer_types"):
        return None
    n, types = raw["num_hidden_layers"], tuple(raw["layer_types"])
    if len(types) != n or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the {n} layers, got {types}")
    return types


def config_window(raw: dict) -> int | None:
    return raw.get("sliding_window")


def attention_bias(raw: dict) -> bool:
    return bool(raw.get("attention_bias", False))


def no_fields(raw: dict, head_dim: int) -> dict:
    return {}


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family's declaration (`experts.py` turns it and a config.json into a `MoEConfig`)."""

    defaults: Mapping  # transformers' defaults for the MoE keys a config.json may leave out
    size_key: str  # the config key of one expert's intermediate size
    names: tuple[str, str, str]  # one expert's gate, up, down in the per-expert checkpoint layout
    blocks: tuple[str, ...] = ("mlp",)  # the sparse block's checkpoint names, tried in order
    always_renormalize: bool = False  # top-k weights divided by their sum whatever norm_topk_prob says
    float_weights: bool = False  # routing weights kept in float32 when they scale the expert outputs
    sparse_step: bool = True  # dense layers by decoder_sparse_step / mlp_only_layers
    windows: bool = True  # sliding windows servable (else use_sliding_window is refused)


@dataclass(frozen=True)
class Family:
    """One model family. The callables read `raw`, the config.json over `defaults`."""

    name: str
    architectures: tuple[str, ...]
    defaults: Mapping = field(default_factory=dict)  # keys a config.json may leave out, as transformers fills them
    layer_types: Callable[[dict], tuple[str, ...]] = all_full  # each layer's attention, where no layer_types given
    window: Callable[[dict], int | None] = config_window  # the sliding layers' window
    activation_key: str = "hidden_act"  # the config key naming the MLP gate's activation
    qkv_bias: Callable[[dict], bool] = attention_bias
    fields: Callable[[dict, int], dict] = no_fields  # ModelConfig fields this family sets (raw, head_dim)
    projections: Mapping = field(default_factory=lambda: FUSED_PROJECTIONS)  # fused projection -> checkpoint / peft modules it stacks
    rope_aliases: Mapping = field(default_factory=dict)  # older rope_type names -> transformers' current ones
    experts: Experts | None = None
    decoder_layer: type | None = None  # the decoder layer class (None: the shared Llama decoder's)

    def fused_of(self, module: str) -> tuple[str, int] | None:
        """(our fused projection, the module's index in it) of a checkpoint / peft module name; None if none."""
        for fused, parts in self.projections.items():
            if module in parts:
                return fused, parts.index(module)
        return None
