"""What the budget guarantee (grammar/budget.py) costs: decode tokens/s of the same requests unconstrained, under a
JSON Schema without the guard, and with it, in ONE process (warmed up first; runs alternate).

    .venv/bin/python benchmarks/budget_guard.py --batch 16 --new-tokens 64 --rounds 3 [--plain-only]

Unconstrained requests never reach the guard; `--plain-only` times just those, so the same command run against an
older checkout (before the guard existed) gives the before/after of unconstrained decoding.
"""

from __future__ import annotations

import argparse
import statistics
import time

from loraplex.platform import LLM, SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "tags", "summary"],
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                         "summary": {"type": "string"}}}


def rate(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain-only", action="store_true")
    args = parser.parse_args()
    prompts = [f"Describe book number {i} as JSON." for i in range(args.batch)]
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=args.new_tokens, ignore_eos=True)
    json_params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.new_tokens,
                                 structured=StructuredOutputs(json=SCHEMA))
    kinds = {"unconstrained": (dict(), plain)}
    if not args.plain_only:
        kinds["json, guard off"] = (dict(finish_within_budget=False, json_close_window=0), json_params)
        kinds["json, guard on"] = (dict(json_close_window=0), json_params)
    engines = {name: LLM(dtype="float32", enable_prefix_caching=False, **kw) for name, (kw, _) in kinds.items()}
    for name, (_, params) in kinds.items():  # warm-up: kernels, compiles, the grammar's first fill
        rate(engines[name], prompts[:2], params)
    found: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, (_, params) in kinds.items():
            found[name].append(rate(engines[name], prompts, params))
    for name, rates in found.items():
        print(f"{name:<16} {statistics.median(rates):7.1f} tok/s (median of {args.rounds}: "
              f"{', '.join(f'{r:.1f}' for r in rates)})")


if __name__ == "__main__":
    main()
