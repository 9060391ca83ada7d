"""JSON Schema coverage over a corpus of real-world schemas with valid and invalid instances.

    python benchmarks/schema_coverage.py ../shared/data/jsonschema

For each schema: compiled, refused (a keyword the backend would not enforce, named), or a
compile error. For each compiled grammar: does it accept every valid instance and reject every
invalid one (the instance serialized compactly, as the bounded-whitespace grammar emits it)?
Compile time p50 / p99. Uses the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.json_schema import UnsupportedKeywordError
from loraplex.grammar.manager import GrammarManager


def accepts(manager: GrammarManager, compiled, text: str, tok) -> bool:
    grammar = manager.new_grammar(compiled)
    if hasattr(grammar, "matcher"):  # xgrammar matches the string itself
        return grammar.matcher.accept_string(text) and grammar.matcher.is_completed()
    # outlines: its index holds every tokenization of the language, so any one will do
    ids = tok.encode(text, add_special_tokens=False)
    return all(grammar.accept_token(t) for t in ids) and grammar.accept_token(tok.eos_token_id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--model", default=None, help="tokenizer folder (default: the default model)")
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "outlines", "auto"])
    parser.add_argument("--every", type=int, default=1, help="take every k-th schema (outlines is slow here)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per compile")
    args = parser.parse_args()
    if args.model is None:
        from loraplex.platform.model_store import materialize_default_model

        args.model = str(materialize_default_model())
    tok = AutoTokenizer.from_pretrained(args.model)
    manager = GrammarManager(tok, len(tok), [tok.eos_token_id], backend=args.backend, timeout_s=args.timeout)
    files = sorted(args.corpus.glob("*.json"))[::args.every]
    if not files:
        print(f"no *.json in {args.corpus}")
        return 1
    outcome = collections.Counter()
    refused_by = collections.Counter()
    per_split = collections.defaultdict(collections.Counter)
    compile_ms = []
    valid_total = valid_ok = invalid_total = invalid_ok = 0
    schemas_all_right = 0
    for path in files:
        item = json.loads(path.read_text())
        split = path.name.split("__")[0]
        try:
            spec = StructuredOutputs(json=item["schema"])
            start = time.perf_counter()
            compiled = manager.compile(spec)
            compile_ms.append(1e3 * (time.perf_counter() - start))
        except GrammarError as exc:
            kind = "refused" if isinstance(exc, UnsupportedKeywordError) else \
                "timeout" if "took longer" in str(exc) else "error"
            outcome[kind] += 1
            per_split[split][kind] += 1
            if kind == "refused":
                refused_by[str(exc).split("'")[1]] += 1
            continue
        outcome["compiled"] += 1
        per_split[split]["compiled"] += 1
        right = True
        for test in item.get("tests", []):
            text = json.dumps(test["data"])
            ok = accepts(manager, compiled, text, tok) == test["valid"]
            right &= ok
            if test["valid"]:
                valid_total += 1
                valid_ok += ok
            else:
                invalid_total += 1
                invalid_ok += ok
        schemas_all_right += right
    print(f"backend {args.backend}, {len(files)} schemas from {args.corpus}")
    print(f"compiled {outcome['compiled']}, refused {outcome['refused']}, compile errors {outcome['error']}, "
          f"compile timeouts ({args.timeout:g} s) {outcome['timeout']}")
    for split, counts in sorted(per_split.items()):
        print(f"  {split:<16} compiled {counts['compiled']:>4} refused {counts['refused']:>4} errors {counts['error']:>4}")
    print(f"refused keywords: {dict(refused_by.most_common())}")
    print(f"valid instances accepted: {valid_ok}/{valid_total}; invalid instances rejected: {invalid_ok}/{invalid_total}")
    print(f"compiled schemas right on every instance: {schemas_all_right}/{outcome['compiled']}")
    if compile_ms:
        q = statistics.quantiles(compile_ms, n=100, method="inclusive")
        print(f"compile ms: p50 {statistics.median(compile_ms):.1f}, p99 {q[98]:.1f}, max {max(compile_ms):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
