"""An adapter's weights for the two vocabulary-sized modules outside the decoder layers: the token
embedding table (`embed_tokens`) and the LM head (`lm_head`).

peft writes three kinds of weights for them, all read here:
- a LoRA: on `embed_tokens` `lora_embedding_A` [r, vocab] and `lora_embedding_B` [hidden, r] (a token's delta
  is row `id` of A^T times B^T, times the scaling), on `lm_head` an ordinary `lora_A` / `lora_B`;
- a full copy listed in `modules_to_save` (`model.embed_tokens.weight`, `lm_head.weight`, older peft with
  `.modules_to_save.` in the name): the adapter's own table or head, used for its tokens;
- the base layer of a targeted embedding or head (`....base_layer.weight`, what peft's save_embedding_layers
  writes): peft loads it into the model, so where it differs from the served model's it is the adapter's own
  weight too. On a tied model it is the one table both modules read (peft loads it into the shared tensor).
A copy equal to what the served model has is dropped (`BaseTables`): most adapters carry an unchanged base
layer, and keeping a vocab x hidden tensor per adapter for nothing would crowd the adapter cache.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from loraplex.adapters.saved_norms import is_norm_entry
from loraplex.adapters.saved_projections import is_projection_entry
from loraplex.adapters.trainable_tokens import TOKENS_PART, read_trainable_tokens, token_indices
from loraplex.platform.models.model_config import ModelConfig

VOCAB_MODULES = ("embed_tokens", "lm_head")
# peft's module names for them (with ensure_weight_tying peft also lists "model.embed_tokens" itself)
SAVE_NAMES = {"embed_tokens": "embed_tokens", "model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}
VOCAB_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\.(.+)$")
# the part after the module name -> (what it is, which factor)
_PARTS = [
    (re.compile(r"^lora_embedding_([AB])(?:\.[\w-]+)?(?:\.weight)?$"), "embedding_lora"),
    (re.compile(r"^lora_([AB])(?:\.[\w-]+)?\.weight$"), "linear_lora"),
    (re.compile(r"^base_layer\.weight$"), "base_layer"),
    (re.compile(r"^(?:modules_to_save(?:\.[\w-]+)?\.)?weight$"), "saved"),
]


class BaseTables:
    """The served model's embedding table and head, as dense [vocab, hidden] weights in its dtype, read the
    first time an adapter carries a copy of one; only their digests are kept. `served(module, weight)`: the
    dense values the model would serve for `weight` in that module (a quantized head's, rounded as it was).
    `projection(layer, fused)`: a decoder projection's served weight [out_total, in], for DoRA's norms (None
    where this process holds only a shard of it)."""

    def __init__(self, dtype: torch.dtype, dense: Callable[[str], torch.Tensor],
                 served: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 projection: Callable[[int, str], torch.Tensor] | None = None) -> None:
        self.dtype, self._dense, self.projection = dtype, dense, projection
        self._served = served or (lambda module, weight: weight)
        self._digests: dict[str, str] = {}
        self._lock = threading.Lock()  # adapters are read in callers' threads

    def same(self, module: str, weight: torch.Tensor) -> bool:
        return _digest(self._served(module, weight).to(self.dtype)) == self._digest(module)

    def _digest(self, module: str) -> str:
        with self._lock:
            if module not in self._digests:
                self._digests[module] = _digest(self._dense(module).to(self.dtype))
            return self._digests[module]


def _digest(weight: torch.Tensor) -> str:
    data = weight.detach().contiguous().cpu()
    return f"{tuple(data.shape)}:" + hashlib.sha256(data.view(torch.uint8).numpy()).hexdigest()


@dataclass
class VocabWeights:
    # embed_tokens: (A^T [vocab, r], B^T [r, hidden]): a token's rows are gathered, then one small matmul
    embedding: tuple[torch.Tensor, torch.Tensor] | None
    # lm_head: (A [r, hidden], B^T [r, vocab]), the layout of a fused projection's table
    head: tuple[torch.Tensor, torch.Tensor] | None
    # "embed_tokens" / "lm_head" -> the adapter's own [vocab, hidden] weight (one tensor where both read it)
    replacements: dict[str, torch.Tensor]
    modules_to_save: frozenset[str]
    # "embed_tokens" / "lm_head" -> (token ids sorted, their trained rows): trainable_tokens.py
    tokens: dict[str, tuple[torch.Tensor, torch.Tensor]]


def vocab_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """LoRA shapes (A, B) of the embedding and the head, in peft's layout, for rank 1."""
    v, h = config.vocab_size, config.hidden_size
    return {"embed_tokens": ((1, v), (h, 1)), "lm_head": ((1, h), (v, 1))}


def modules_to_save(raw: dict, fail) -> frozenset[str]:
    """The vocabulary modules named by `modules_to_save`; an entry that names neither them nor norms
    (`saved_norms.py`) is refused by name."""
    value = raw.get("modules_to_save") or []
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise fail(f"modules_to_save must be a list of module names, got {value!r}")
    unknown = sorted(m for m in set(value) - set(SAVE_NAMES) if not is_norm_entry(m) and not is_projection_entry(m))
    if unknown:
        raise fail(f"modules_to_save {unknown} is not supported (full weights are served per adapter only for "
                   f"{list(VOCAB_MODULES)}, norms and the decoder layers' projections)")
    return frozenset(SAVE_NAMES[m] for m in value if m in SAVE_NAMES)


def layer_entries(raw: dict) -> list[str]:
    """The `modules_to_save` entries inside the decoder layers (norms, projections, blocks; checked by
    `modules_to_save`)."""
    value = raw.get("modules_to_save") or []
    return sorted(m for m in set(value) if m not in SAVE_NAMES)


def read_vocab_weights(tensors: dict[str, torch.Tensor], raw: dict, targets: set[str], rank: int,
                       config: ModelConfig, dtype: torch.dtype, base: BaseTables | None, fail) -> VocabWeights:
    """From the folder's embedding / head tensors (keys matching VOCAB_KEY): LoRA factors in `dtype`, full
    weights in the served model's dtype (`base.dtype`; `dtype` where no model is known)."""
    saved_modules = modules_to_save(raw, fail)
    tie_saved = config.tie_word_embeddings and bool(raw.get("ensure_weight_tying"))
    if tie_saved and saved_modules:  # peft ties the two copies into one (listing one, saving both)
        saved_modules = frozenset(VOCAB_MODULES)
    both = saved_modules & targets
    if both:
        raise fail(f"{sorted(both)} is both a LoRA target and in modules_to_save")
    token_keys = {key: VOCAB_KEY.match(key) for key in tensors if TOKENS_PART.match(VOCAB_KEY.match(key)[2])}
    indices = token_indices(raw, fail)
    clash = sorted(set(indices) & (saved_modules | targets))
    if clash:
        raise fail(f"{clash} has trainable tokens and a LoRA or a full weight of its own: peft trains one of them")
    served_dtype = base.dtype if base is not None else dtype
    tokens = read_trainable_tokens({m[1].rsplit(".", 1)[-1]: tensors[k] for k, m in token_keys.items()}, indices,
                                   config, served_dtype, fail)
    loras, copies, saved = _sort_keys({k: t for k, t in tensors.items() if k not in token_keys}, targets,
                                      saved_modules, fail)
    missing = sorted(saved_modules - set(saved))
    if missing:
        raise fail(f"modules_to_save lists {missing}, but the folder holds no weight for it")
    for module, weight in {**copies, **saved}.items():
        if tuple(weight.shape) != (config.vocab_size, config.hidden_size):
            raise fail(f"{module} weight of shape {tuple(weight.shape)} does not fit the base model "
                       f"({config.vocab_size}, {config.hidden_size}): a resized vocabulary or a wrong base model")
    embedding, head = (_lora(module, loras.get(module), rank, config, dtype, fail) for module in VOCAB_MODULES)
    full = _replacements(copies, saved, tie_saved, config, base, fail)
    return VocabWeights(embedding, head, _cast(full, served_dtype), saved_modules, tokens)


def _sort_keys(tensors, targets, saved_modules, fail):
    """(module -> {A, B}, module -> base-layer copy, module -> modules_to_save copy)."""
    loras: dict[str, dict[str, torch.Tensor]] = {}
    copies: dict[str, torch.Tensor] = {}
    saved: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module_path, rest = VOCAB_KEY.match(key).groups()
        module = module_path.rsplit(".", 1)[-1]
        kind, which = _part(rest)
        lora_kind = "embedding_lora" if module == "embed_tokens" else "linear_lora"
        if kind == "saved" and module in saved_modules:
            saved[module] = tensor
        elif kind in (lora_kind, "base_layer") and module in targets:
            if kind == "base_layer":
                copies[module] = tensor
            else:
                loras.setdefault(module, {})[which] = tensor
        else:
            raise fail(f"unexpected weight {key!r} (target_modules {sorted(targets)}, modules_to_save "
                       f"{sorted(saved_modules)})")
    return loras, copies, saved


def _part(rest: str) -> tuple[str | None, str | None]:
    for pattern, kind in _PARTS:
        match = pattern.match(rest)
        if match:
            return kind, match.group(1) if pattern.groups else None
    return None, None


def _lora(module: str, ab: dict[str, torch.Tensor] | None, rank: int, config: ModelConfig, dtype: torch.dtype,
          fail) -> tuple[torch.Tensor, torch.Tensor] | None:
    if ab is None:
        return None
    if set(ab) != {"A", "B"}:
        raise fail(f"{module}: both LoRA factors A and B must be present")
    (a_rows, a_cols), (b_rows, b_cols) = vocab_shapes(config)[module]
    want_a, want_b = (a_rows * rank, a_cols), (b_rows, b_cols * rank)
    if tuple(ab["A"].shape) != want_a or tuple(ab["B"].shape) != want_b:
        raise fail(f"{module}: shapes A{tuple(ab['A'].shape)} B{tuple(ab['B'].shape)} do not fit the base model "
                   f"(expected A{want_a} B{want_b}): wrong base model?")
    a, b_t = ab["A"].to(dtype), ab["B"].T.to(dtype).contiguous()
    return (a.T.contiguous(), b_t) if module == "embed_tokens" else (a.contiguous(), b_t)


def _replacements(copies: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], tie_saved: bool,
                  config: ModelConfig, base: BaseTables | None, fail) -> dict[str, torch.Tensor]:
    """module -> the adapter's own weight, as peft would have it: a modules_to_save copy is the module's own
    (tied by peft only under ensure_weight_tying); a base-layer copy replaces the base weight, which on a tied
    model both modules read. Copies equal to the served model's are left out."""
    tied = config.tie_word_embeddings
    out: dict[str, torch.Tensor] = {}
    changed = {m: w for m, w in copies.items() if base is None or not base.same("embed_tokens" if tied else m, w)}
    if tied and changed:
        out = dict.fromkeys(VOCAB_MODULES, _one_table(changed, "base_layer copies", fail))
    else:
        out.update(changed)
    if tie_saved and saved:
        saved = dict.fromkeys(VOCAB_MODULES, _one_table(saved, "modules_to_save copies (ensure_weight_tying)", fail))
    out.update({m: w for m, w in saved.items() if base is None or not base.same(m, w)})
    if len(out) == 2 and out["embed_tokens"] is not out["lm_head"] and torch.equal(*out.values()):
        out["lm_head"] = out["embed_tokens"]  # equal values: held once
    return out


def _one_table(weights: dict[str, torch.Tensor], what: str, fail) -> torch.Tensor:
    """The one table a tied model reads; two copies that differ have no single meaning (peft keeps whichever
    it loads last)."""
    first, *others = weights.values()
    if any(not torch.equal(first, other) for other in others):
        raise fail(f"the tied embedding table gets two different {what} ({sorted(weights)})")
    return first


def _cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each in `dtype`, contiguous; a tensor both modules share stays one tensor."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    for module, weight in weights.items():
        if id(weight) not in done:
            done[id(weight)] = weight.to(dtype).contiguous()
        out[module] = done[id(weight)]
    return out
