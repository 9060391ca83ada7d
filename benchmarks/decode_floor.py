"""Batch-1 decode step floor of the default model: `python benchmarks/decode_floor.py none|q4|int8 [--adapter-rank R]
[--async-scheduling]`.

One 40-token prompt decoding 40 tokens, four times, prefix cache off (with `--adapter-rank`: through a random
adapter of that rank on every projection); prints the min, p10 and p50 decode step (ms). Short and self-contained, so that two git worktrees can be compared process by process
(docs/benchmarks-history.md, "Batch 1 settled").
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from loraplex.platform import LLM, SamplingParams
from loraplex.platform.model_store import default_model_dir


def decode_steps(llm: LLM, rounds: int, new_tokens: int, adapter: str | None = None) -> list[float]:
    """Seconds of every decode step (each round's prefill step left out)."""
    engine, steps = llm.engine, []
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(rounds):
        engine.add_request(f"floor-{i}", {"prompt_token_ids": list(range(100, 140))}, params, adapter)
        first = True
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            if not first:
                steps.append(time.perf_counter() - start)
            first = False
    return sorted(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quantization", choices=["none", "q4", "int8"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--adapter-rank", type=int, default=0, help="decode through a random adapter of this rank")
    parser.add_argument("--async-scheduling", action="store_true", help="the engine's --async-scheduling")
    args = parser.parse_args()
    llm = LLM(str(default_model_dir()), quantization=args.quantization, enable_prefix_caching=False,
              **({"async_scheduling": True} if args.async_scheduling else {}))
    adapter = None
    if args.adapter_rank:
        from many_adapters import write_adapter

        with tempfile.TemporaryDirectory() as tmp:
            llm.load_adapter("floor", str(write_adapter(Path(tmp) / "a", llm.engine.model_config, args.adapter_rank, 0)))
        adapter = "floor"
    steps = decode_steps(llm, args.rounds, args.new_tokens, adapter)
    ms = [1e3 * s for s in steps]
    print(f"RESULT {args.quantization} rank {args.adapter_rank} min {ms[0]:.2f} p10 {ms[len(ms) // 10]:.2f} "
          f"p50 {ms[len(ms) // 2]:.2f} n {len(ms)}")


if __name__ == "__main__":
    main()
