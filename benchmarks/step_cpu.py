"""CPU milliseconds per decode step (`time.process_time`, so time the VM steals from the process is not counted):
a tiny random Llama at batch 16 (the engine's own work is most of its step) and the default model at batch 1 and 16.
For an old-vs-new comparison of two trees, run it once per tree, taking turns, each from its own checkout:

    git worktree add /tmp/base <old commit>
    for i in 1 2 3 4 5 6; do for root in /tmp/base "$PWD"; do
      (cd $root && PYTHONPATH=$root "$OLDPWD"/.venv/bin/python "$OLDPWD"/benchmarks/step_cpu.py); done; done
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import tiny_model  # noqa: E402

from loraplex.platform import LLM, SamplingParams  # noqa: E402
from loraplex.platform.model_store import default_model_dir  # noqa: E402


def cpu_ms_per_step(llm: LLM, batch: int, tokens: int) -> float:
    """Decode steps only: the prompts' prefill step is not counted."""
    llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"b{i}", {"prompt_token_ids": [10 + i, 20 + i, 30 + i, 40 + i]}, params)
    engine.step()
    start, steps = time.process_time(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return 1e3 * (time.process_time() - start) / steps


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tiny = LLM(tiny_model(Path(tmp) / "tiny", 512), dtype="float32", max_num_seqs=16, num_kv_blocks=320)
        row = [("tiny16", cpu_ms_per_step(tiny, 16, 200))]
    default = LLM(str(default_model_dir()), dtype="float32", num_kv_blocks=256)
    row += [("smol1", cpu_ms_per_step(default, 1, 48)), ("smol16", cpu_ms_per_step(default, 16, 48))]
    print(" ".join(f"{name} {ms:.3f}" for name, ms in row))


if __name__ == "__main__":
    main()
