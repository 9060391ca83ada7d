"""Command-line flags generated from a settings dataclass's fields (`EngineConfig`,
`ServerConfig`, `ClusterConfig`): name, type, default and help come from the field, so a new
setting is on the command line without being declared twice."""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, fields

SCALARS = {"int": int, "float": float, "str": str}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1GiB' or '2GB'."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit) and lowered[:-len(unit)].strip():
            return int(float(lowered[:-len(unit)]) * factor)
    return int(lowered)


def _flagged(cls, skip: tuple[str, ...] = ()) -> list[Field]:
    return [f for f in fields(cls) if f.name not in skip and f.metadata.get("flag", "") is not None]


def _dest(f: Field) -> str:
    return f.metadata.get("dest", f.name)


def add_flags(parser, cls, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` (but `skip` and fields marked flag=None)."""
    for f in _flagged(cls, skip):
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        parser.add_argument(flag, dest=_dest(f), help=meta["help"], **_kind(f))


def _kind(f: Field) -> dict:
    """argparse's arguments for the field's type."""
    meta, kind = f.metadata, str(f.type).replace(" | None", "")
    if kind == "bool":
        if meta.get("invert"):  # `--disable-x` turns off a setting that is on by default
            return {"action": "store_false", "default": f.default}
        return {"action": argparse.BooleanOptionalAction, "default": f.default}
    if kind.startswith("tuple["):
        return {"action": "append", "default": [], "metavar": meta.get("metavar")}
    kwargs = {"default": f.default, "type": parse_size if meta.get("size") else SCALARS[kind]}
    for key in ("choices", "metavar"):
        if key in meta:
            kwargs[key] = meta[key]
    return kwargs


def values(cls, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    """The parsed flags of `cls`'s fields, as its keyword arguments (an unset flag with an `env`
    variable takes the variable's value)."""
    out = {}
    for f in _flagged(cls, skip):
        value = getattr(args, _dest(f))
        if isinstance(value, list):
            value = tuple(value)
        if "env" in f.metadata:  # an empty key is no key
            value = value or os.environ.get(f.metadata["env"]) or None
        out[f.name] = value
    return out
