"""Architecture name (a config.json's `architectures[0]`) -> its family's declaration. Adding a family: its
declaration in `families.py` (and, where its layers differ, its decoder layer in a module of its own)."""

from __future__ import annotations

from loraplex.platform.models.families import DECLARED
from loraplex.platform.models.family import Family

FAMILIES: dict[str, Family] = {arch: family for family in DECLARED for arch in family.architectures}


def family_for(architecture: str) -> Family:
    """The declaration of `architecture`; a ValueError naming what is supported for any other."""
    family = FAMILIES.get(architecture)
    if family is None:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}")
    return family
