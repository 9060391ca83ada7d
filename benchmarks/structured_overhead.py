"""Constrained vs unconstrained decoding in ONE run (and constrained with jump-forward), plus
the grammar's own costs.

    python benchmarks/structured_overhead.py --batch 16 --new-tokens 32 [--grammar-backend xgrammar]

Same prompts, same length of output (`ignore_eos`; the constrained run uses a JSON Schema with
a free-text field long enough not to finish early, or stops where the grammar ends), prefix
caching off so every run pays its own prefill (a later run found its prompts cached): tokens/s
of each and the ratio; the time spent filling and applying bitmasks per step; compile time of
the schema cold and from the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loraplex.platform import LLM, SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags", "summary"],
          "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1900,
                                                                                 "maximum": 2100},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                         "summary": {"type": "string"}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--grammar-backend", default="auto", choices=["auto", "llguidance", "xgrammar", "outlines"])
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch, num_kv_blocks=args.batch * 12,
              grammar_backend=args.grammar_backend, json_close_window=0,  # fixed lengths: no closing steer
              enable_prefix_caching=False)  # each run pays its own prefill: runs compare like with like
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe book number {i} as JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.batch)]
    manager = llm.engine.grammars
    spec = StructuredOutputs(json=SCHEMA)
    manager.compile(StructuredOutputs(json={"type": "integer"}))  # the tokenizer scan: once per engine, not timed
    t = time.perf_counter()
    compiled = manager.compile(spec)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    manager.compile(StructuredOutputs(json=SCHEMA))
    cached = time.perf_counter() - t

    apply_times = []
    real_apply = manager.apply

    def timed_apply(logits, grammars, closing=None):
        start = time.perf_counter()
        real_apply(logits, grammars, closing)
        apply_times.append(time.perf_counter() - start)

    manager.apply = timed_apply

    def run(structured: StructuredOutputs | None) -> tuple[float, int]:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.new_tokens, ignore_eos=True,
                                 structured=structured) for i in range(args.batch)]
        llm.generate(["Warm up.", "Warm up again."], SamplingParams(max_tokens=2))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / (time.perf_counter() - start), tokens

    engine = llm.engine
    engine.core.drafter.jump_forward = False
    free_tps, free_tokens = run(None)
    apply_times.clear()
    json_tps, json_tokens = run(spec)
    engine.core.drafter.jump_forward = True
    jumped_before = engine.core.drafter.num_jump_forward_tokens
    jump_tps, jump_tokens = run(spec)
    jumped = engine.core.drafter.num_jump_forward_tokens - jumped_before
    print(f"model={llm.engine.config.model} dtype={args.dtype} batch={args.batch} new_tokens={args.new_tokens} "
          f"threads={torch.get_num_threads()} grammar backend={compiled.backend}")
    print(f"unconstrained: {free_tps:.1f} tok/s ({free_tokens} tokens)")
    print(f"JSON schema:   {json_tps:.1f} tok/s ({json_tokens} tokens)   ratio {json_tps / free_tps:.2f}x")
    print(f"JSON schema + jump-forward: {jump_tps:.1f} tok/s ({jump_tokens} tokens, {jumped} appended without "
          f"their own forward pass)   ratio {jump_tps / free_tps:.2f}x")
    print(f"bitmask fill + apply per step (batch {args.batch}): median {1e3 * statistics.median(apply_times):.2f} ms, "
          f"p99 {1e3 * sorted(apply_times)[int(0.99 * (len(apply_times) - 1))]:.2f} ms over {len(apply_times)} steps")
    print(f"compile: cold {1e3 * cold:.1f} ms, cached {1e3 * cached:.2f} ms")


if __name__ == "__main__":
    main()
