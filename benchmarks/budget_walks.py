"""The budget guarantee (grammar/budget.py) against random picks on real-world schemas: the start plan of each
schema the llguidance backend compiles, then seeded random walks (each step a random allowed token, checked by the
guard, taken back where it would not fit) at budgets of the plan's length, +3, and max(48, +16). Every walk must
end complete inside its budget; exits 1 on any that does not.

    .venv/bin/python benchmarks/budget_walks.py ../shared/data/jsonschema [--num 400]

Random tokens never want to close (a model does): the guard's costly cases, so the `fits` percentiles are an upper
side of what serving sees.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import llguidance.torch
import torch
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.platform.model_store import default_model_dir


def walk(manager: GrammarManager, compiled, budget: int, rng: random.Random, vocab: int) -> tuple[bool, list[float]]:
    grammar, times = manager.new_grammar(compiled), []
    bitmask = torch.zeros((1, -(-vocab // 32)), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    for left in range(budget, 0, -1):
        llguidance.torch.fill_next_token_bitmask(grammar.matcher, bitmask, 0)
        allowed = ((bitmask[0][:, None] >> shifts) & 1).flatten()[:vocab].nonzero().flatten().tolist()
        chosen = None
        for token in rng.sample(allowed, min(4, len(allowed))):
            start = time.perf_counter()
            fits = grammar.guard.fits((token,), left)
            times.append(time.perf_counter() - start)
            if fits:
                chosen = token
                break
        if chosen is None:
            chosen = grammar.guard.fallback()
        assert grammar.accept_token(chosen)
        if grammar.is_terminated():
            return True, times
    return grammar.matcher.is_accepting(), times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--num", type=int, default=400)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    manager = GrammarManager(tok, len(tok), [tok.eos_token_id], backend="llguidance", within_budget=True)
    rng, lengths, starts, fits_s, ended, failed, unplanned = random.Random(0), [], [], [], 0, [], 0
    for path in sorted(args.corpus.glob("*.json"))[:args.num]:
        try:
            compiled = manager.compile(StructuredOutputs(json=json.loads(path.read_text())["schema"]))
        except GrammarError:
            continue
        start = time.perf_counter()
        manager._plan(compiled)  # timed again: the compile already planned it, once, on its own thread
        starts.append(time.perf_counter() - start)
        need = manager.shortest(compiled)
        if need is None:
            unplanned += 1
            continue
        lengths.append(need)
        for budget in (need, need + 3, max(48, need + 16)):
            ok, times = walk(manager, compiled, budget, rng, len(tok))
            fits_s += times
            ended += ok
            failed += [] if ok else [f"{path.name} at {budget}"]
    fits_s.sort()
    pct = lambda q: 1e3 * fits_s[int(q * (len(fits_s) - 1))]  # noqa: E731
    print(f"{len(starts)} schemas compiled by llguidance; start plans: {len(lengths)} (none: {unplanned}), mean "
          f"{statistics.mean(lengths):.1f} tokens, planned in {1e3 * statistics.mean(starts):.1f} ms mean, "
          f"{1e3 * max(starts):.0f} ms max")
    print(f"walks: {ended} of {ended + len(failed)} ended complete inside their budget; fits per check: p50 "
          f"{pct(.5):.2f} ms, p90 {pct(.9):.2f}, p99 {pct(.99):.1f}, max {pct(1):.1f}")
    for name in failed:
        print(f"  NOT COMPLETE: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
