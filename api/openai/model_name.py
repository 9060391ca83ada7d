"""The one reading of a request's `model` field: the base model, `base:adapter` or `adapter`."""

from __future__ import annotations


def adapter_of(model: str, base: str) -> str | None:
    """None for the base model, else the adapter's name ('' for `base:`, which names none)."""
    if model == base:
        return None
    return model[len(base) + 1:] if model.startswith(base + ":") else model
