"""What --deterministic costs: the same engine with and without it, in ONE run, at batch 1, 16 and 64.

    python benchmarks/deterministic.py [--batches 1,16,64] [--max-tokens 64] [--repeats 2] [--threads N]
                                       [--dtype auto] [--json out.json]

Two engines on the default model (or --model), identical but for `deterministic`, prefix caching off on both (each
run pays its own prefill). Each batch of distinct prompts (a numbered question each, about 30 tokens) runs on both
engines in turn, the order alternating, so load from elsewhere on the machine falls on both sides alike. Per batch:
output tokens/s of each side (median over --repeats, wall time of the whole call: prefill and decode), the ratio
off/on ("x slower"), and whether the greedy outputs are the same (they may differ: the mode sums in another order,
so a near tie can go the other way; the count of differing requests is printed). Target (the issue): at most 1.25x
slower.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform as host
import statistics
import subprocess
import time

import torch

from loraplex.platform import LLM, SamplingParams

log = logging.getLogger("deterministic-bench")
TOPICS = ["the moon", "rivers", "bread", "volcanoes", "bees", "glass", "trains", "clouds"]


def prompts(batch: int, salt: int) -> list[dict]:
    """`batch` distinct chat prompts; `salt` keeps repeats apart."""
    return [[{"role": "user", "content": f"Question {salt}-{i}: write a short paragraph about "
                                         f"{TOPICS[i % len(TOPICS)]} for a child of {5 + i % 7}."}]
            for i in range(batch)]


def timed(llm: LLM, batch: list, params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.chat(batch, params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [o.outputs[0].token_ids for o in outs]


def measure(engines: dict[str, LLM], batch: int, repeats: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    speeds = {name: [] for name in engines}
    differ = 0
    for r in range(repeats):
        messages = prompts(batch, r)
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        outputs = {}
        for name in order:
            tok_s, outputs[name] = timed(engines[name], messages, params)
            speeds[name].append(tok_s)
        differ = max(differ, sum(a != b for a, b in zip(outputs["off"], outputs["on"])))
    off, on = (statistics.median(speeds[n]) for n in ("off", "on"))
    return {"batch": batch, "off_tok_s": round(off, 1), "on_tok_s": round(on, 1), "slower": round(off / on, 3),
            "outputs_differ": differ, "runs": speeds}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        return host.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=max(batches))
    engines = {name: LLM(args.model, deterministic=name == "on", **common) for name in ("off", "on")}
    for llm in engines.values():  # warm: first calls build kernels and caches
        llm.chat(prompts(2, -1), SamplingParams(temperature=0, max_tokens=4))
    dtype = str(engines["on"].engine.resolved.kernels.dtype).removeprefix("torch.")
    log.info("%s, %d torch threads, dtype %s", cpu_name(), torch.get_num_threads(), dtype)
    rows = []
    for batch in batches:
        row = measure(engines, batch, args.repeats, args.max_tokens)
        rows.append(row)
        log.info("batch %3d: off %7.1f tok/s, on %7.1f tok/s = %.2fx slower (target <= 1.25x); outputs differ in "
                 "%d of %d", batch, row["off_tok_s"], row["on_tok_s"], row["slower"], row["outputs_differ"], batch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
