"""Architecture name (a config.json's `architectures[0]`) -> its family's declaration. Adding a family: its
declaration (`families.py`, or a module of its own where its layers differ) and one entry below."""

from __future__ import annotations

from loraplex.platform.models.families import DECLARED
from loraplex.platform.models.family import Family
from loraplex.platform.models.olmo2 import OLMO2
from loraplex.platform.models.smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {arch: family for family in (*DECLARED, OLMO2, SMOLLM3) for arch in family.architectures}


def family_for(architecture: str) -> Family:
    """The declaration of `architecture`; a ValueError naming what is supported for any other."""
    family = FAMILIES.get(architecture)
    if family is None:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}")
    return family
