"""JSON Schema coverage and soundness, per backend, over real-world schemas or the official
JSON-Schema-Test-Suite.

    python benchmarks/schema_coverage.py ../shared/data/jsonschema                      # auto
    python benchmarks/schema_coverage.py ../shared/data/jsonschema --backend all
    python benchmarks/schema_coverage.py ../shared/data/json-schema-test-suite --backend all

For each schema: compiled, refused (a keyword the backend would not enforce, named), or a
compile error (an unresolvable `$ref`, a schema the backend finds unsatisfiable, ...). For each
compiled grammar, the oracle of `loraplex.grammar.schema.oracle`: does it accept every valid instance
and reject every invalid one? Compile time p50 / p99 (first compile of each schema, cold
cache). Over the suite, the share compiled per keyword (its file). Uses the default model's
tokenizer.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from loraplex.grammar.schema import oracle
from loraplex.grammar.manager import BACKENDS, GrammarManager


def run(manager: GrammarManager, tok, cases: list[oracle.Case], label: str, by_keyword: bool) -> dict:
    outcome = collections.Counter()
    refused_by = collections.Counter()
    per_group = collections.defaultdict(collections.Counter)
    compile_ms, wrong = [], []
    totals = collections.Counter()
    start = time.perf_counter()
    for case in cases:
        result = oracle.check(manager, tok, case, tok.eos_token_id)
        group = case.keyword if by_keyword else case.source.split("__")[0]
        outcome[result.status] += 1
        per_group[group][result.status] += 1
        if result.status == "refused":
            refused_by[result.message.split("'")[1]] += 1
            continue
        if result.status != "compiled":
            continue
        compile_ms.append(1e3 * result.compile_s)
        totals.update(valid=result.valid_total, valid_ok=result.valid_accepted, invalid=result.invalid_total,
                      invalid_ok=result.invalid_rejected, right=not result.wrong)
        wrong += [(case.source, case.description, w) for w in result.wrong]
    n = len(cases)
    print(f"\n== backend {label}: {n} schemas ({time.perf_counter() - start:.0f} s)")
    print(f"compiled {outcome['compiled']} ({100 * outcome['compiled'] / n:.1f}%), refused {outcome['refused']}, "
          f"compile errors {outcome['error']}")
    print(f"valid instances accepted: {totals['valid_ok']}/{totals['valid']}; "
          f"invalid instances rejected: {totals['invalid_ok']}/{totals['invalid']} "
          f"(accepted: {totals['invalid'] - totals['invalid_ok']})")
    print(f"compiled schemas right on every instance: {totals['right']}/{outcome['compiled']}")
    if compile_ms:
        q = statistics.quantiles(compile_ms, n=100, method="inclusive")
        print(f"compile ms: p50 {statistics.median(compile_ms):.1f}, p99 {q[98]:.1f}, max {max(compile_ms):.1f}")
    print(f"refused keywords: {dict(refused_by.most_common(12))}")
    width = max(len(g) for g in per_group)
    print(f"{'keyword' if by_keyword else 'split':<{width}}  compiled / all")
    for group, counts in sorted(per_group.items()):
        print(f"{group:<{width}}  {counts['compiled']:>4} / {sum(counts.values()):<4}")
    for source, description, (text, valid, what) in wrong[:20]:
        print(f"  WRONG {source} {description!r}: {'valid rejected' if valid else 'INVALID ACCEPTED'} "
              f"{text[:100]} ({what})")
    return {"compiled": outcome["compiled"], "n": n, "invalid_accepted": totals["invalid"] - totals["invalid_ok"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path, help="a folder of corpus files, or the JSON-Schema-Test-Suite")
    parser.add_argument("--model", default=None, help="tokenizer folder (default: the default model)")
    parser.add_argument("--backend", default="auto", choices=[*BACKENDS, "all"])
    parser.add_argument("--every", type=int, default=1, help="take every k-th schema (outlines is slow here)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per compile")
    args = parser.parse_args()
    if args.model is None:
        from loraplex.platform.model_store import materialize_default_model

        args.model = str(materialize_default_model())
    tok = AutoTokenizer.from_pretrained(args.model)
    suite = (args.corpus / "tests").is_dir()
    cases = (oracle.suite_cases(args.corpus) if suite else oracle.corpus_cases(args.corpus))[::args.every]
    if not cases:
        print(f"no schemas in {args.corpus}")
        return 1
    backends = ["auto", "llguidance", "xgrammar", "outlines"] if args.backend == "all" else [args.backend]
    unsound = 0
    for name in backends:
        manager = GrammarManager(tok, len(tok), [tok.eos_token_id], backend=name, timeout_s=args.timeout)
        unsound += run(manager, tok, cases, name, by_keyword=suite)["invalid_accepted"]
    return 1 if unsound else 0


if __name__ == "__main__":
    sys.exit(main())
