"""peft's trainable tokens (`trainable_token_indices`): new values for some rows of the embedding table (and of
the head), used for the adapter's own requests.

The config lists the token ids, as a list (the embedding's) or per module (`{"embed_tokens": [...],
"lm_head": [...]}`); the folder holds, per module, `<module>.token_adapter.trainable_tokens_delta` [n, hidden]:
despite its name each row is the token's whole new row, which replaces the base's (peft's `index_copy`). On a
model whose head is the embedding table, peft ties the head's rows to the embedding's, and so is it served.
A row outside the base model's vocabulary (a resized vocabulary) cannot be served and is refused by name.
"""

from __future__ import annotations

import re

import torch

from loraplex.platform.models.model_config import ModelConfig

TOKENS_PART = re.compile(r"^token_adapter\.trainable_tokens_delta(?:\.[\w-]+)?$")
_MODULES = {"embed_tokens": "embed_tokens", "model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}


def token_indices(raw: dict, fail) -> dict[str, list[int]]:
    """module -> the token ids its rows are trained for, from `trainable_token_indices`."""
    value = raw.get("trainable_token_indices")
    if not value:
        return {}
    per_module = {"embed_tokens": value} if isinstance(value, list) else value
    if not isinstance(per_module, dict):
        raise fail(f"trainable_token_indices must be a list of token ids or a dict of them per module, got {value!r}")
    out = {}
    for name, ids in per_module.items():
        if name not in _MODULES:
            raise fail(f"trainable_token_indices on {name!r} is not supported (only {sorted(set(_MODULES))})")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in ids):
            raise fail(f"trainable_token_indices[{name!r}] must be a non-empty list of token ids, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise fail(f"trainable_token_indices[{name!r}] lists a token id twice")
        out[_MODULES[name]] = ids
    return out


def read_trainable_tokens(tensors: dict[str, torch.Tensor], indices: dict[str, list[int]], config: ModelConfig,
                          dtype: torch.dtype, fail) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (token ids sorted [n] int64, their rows [n, hidden] in `dtype`), from the folder's
    `token_adapter` tensors (`tensors`: module -> tensor); a tied model's head takes the embedding's rows."""
    if set(tensors) != set(indices):
        raise fail(f"trainable_token_indices names {sorted(indices)}, but the folder holds trainable token rows for "
                   f"{sorted(tensors)}")
    out = {}
    for module, ids in indices.items():
        rows = tensors[module]
        if tuple(rows.shape) != (len(ids), config.hidden_size):
            raise fail(f"{module}'s trainable token rows of shape {tuple(rows.shape)} do not fit "
                       f"{len(ids)} tokens of width {config.hidden_size}")
        outside = sorted(i for i in ids if not 0 <= i < config.vocab_size)
        if outside:
            raise fail(f"trainable tokens {outside[:5]} fall outside the base model's vocabulary of "
                       f"{config.vocab_size} rows (a resized vocabulary): they cannot be served")
        order = torch.argsort(torch.tensor(ids))
        out[module] = (torch.tensor(ids)[order], rows[order].to(dtype).contiguous())
    if config.tie_word_embeddings and "embed_tokens" in out:
        if "lm_head" in out:
            raise fail("trainable tokens on both embed_tokens and lm_head of a model whose head is its table")
        out["lm_head"] = out["embed_tokens"]
    return out


def token_rows(tokens: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in `ids` whose token has a trained row, those rows' indices into the adapter's rows)."""
    sorted_ids = tokens[0].to(ids.device)
    at = torch.searchsorted(sorted_ids, ids).clamp_(max=len(sorted_ids) - 1)
    hit = sorted_ids.index_select(0, at) == ids
    return hit.nonzero().squeeze(1), at[hit]
