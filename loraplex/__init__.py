"""loraplex: serve hundreds of LoRA adapters on one base model, with structured outputs.

The five sub-packages are folders without an `__init__.py` (a
`platform/__init__.py` would shadow the standard library's `platform` module whenever Python
runs from the repo root). They import as namespace packages; the names below give each its
package-level API (`from loraplex.platform import LLM`), resolved lazily on first use so that
`import loraplex` stays cheap.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__version__ = "0.1.0"

# In an editable install the five folders sit beside this one (in a wheel, inside it).
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "platform" / "config.py").is_file():
    __path__.append(str(_checkout))

_EXPORTS: dict[str, dict[str, str]] = {
    "platform": {
        "LLM": "engine.llm",
        "SamplingParams": "request",
        "RequestOutput": "request",
        "CompletionOutput": "request",
        "Logprob": "request",
        "EngineConfig": "config",
        "Engine": "engine.llm_engine",
        "AsyncEngine": "engine.async_engine",
        "StructuredOutputs": "request",
    },
    "grammar": {"StructuredOutputs": "backend", "GrammarError": "backend"},
}


def _export(subpackage: str, names: dict[str, str]) -> None:
    package = importlib.import_module(f"{__name__}.{subpackage}")

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package.__name__}.{names[name]}"), name)

    package.__getattr__ = __getattr__
    package.__all__ = sorted(names)


for _sub, _names in _EXPORTS.items():
    _export(_sub, _names)
