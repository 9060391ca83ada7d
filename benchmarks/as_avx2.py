"""Run a benchmark (or any script) with the code paths an AVX2-only CPU takes, on a newer CPU.

An indication, not the real thing: the memory system and clocks are this machine's. What it
changes: loraplex's C kernels are built for Haswell (`-march=haswell` instead of native, via
`LORAPLEX_CC`, into a cache of their own so the native build and the dtype probe's cache stay
apart), torch sees no AVX512-BF16 / AMX (so `dtype=auto` and every bf16 choice see a CPU without
them), and torch's own kernels, oneDNN and MKL are capped at AVX2 (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`). llama.cpp (benchmarks/quantized.py) keeps
its native build.

    .venv/bin/python benchmarks/as_avx2.py benchmarks/throughput.py --batch-sizes 1 16 64 --new-tokens 64
"""

from __future__ import annotations

import os
import runpy
import stat
import sys
from pathlib import Path

CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def compiler_for_haswell(folder: Path) -> Path:
    """A `cc` that builds for Haswell whatever -march it is given."""
    script = folder / "cc-haswell"
    script.write_text('#!/bin/sh\nfor a; do shift; case "$a" in -march=*) a=-march=haswell;; esac; set -- "$@" "$a"; '
                      'done\nexec cc "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.environ.update(CAPS)  # before torch is imported: it reads ATEN_CPU_CAPABILITY once
    root = Path(os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex")
    cache = root / "as-avx2"  # its own C build and dtype probe; the converted default model shared
    cache.mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(parents=True, exist_ok=True)
    if not (cache / "models").exists():
        (cache / "models").symlink_to(root / "models", target_is_directory=True)
    os.environ["LORAPLEX_CACHE"] = str(cache)
    os.environ["LORAPLEX_CC"] = str(compiler_for_haswell(cache))
    import torch

    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
