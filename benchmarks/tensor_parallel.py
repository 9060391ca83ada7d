"""Tensor parallelism end to end on this machine: the default model (or `--model`) at TP=1 and TP=2, side by side
in one run: decode tokens/s at batch 1 and 16 (greedy, prefill excluded) and the time of a step, with the greedy
outputs checked equal. TP=1 uses every core; each TP=2 rank half of them (the executor splits the engine's torch
threads), so the ratio is what splitting the same cores over two processes costs or gains.

    .venv/bin/python benchmarks/tensor_parallel.py [--batches 1,16] [--new-tokens 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

from loraplex.platform import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_rate(llm: LLM, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s: the steps after every request has its first token; and the greedy outputs."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    tag = f"b{time.perf_counter_ns()}"
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", f"{PROMPT} ({i})", params)
    tokens: dict[str, list[int]] = {}
    while len(tokens) < batch:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    began, decoded = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
            decoded += len(out.outputs[0].token_ids)
    return decoded / (time.perf_counter() - began), [tokens[f"{tag}-{i}"] for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the default model)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[int, dict[int, float]] = {}
    outputs: dict[int, dict[int, list]] = {}
    for tp in (1, 2):
        llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=tp, enable_prefix_caching=False,
                  grammar_compile_workers=0)
        decode_rate(llm, 1, 4)  # warm-up
        rates[tp], outputs[tp] = {}, {}
        for batch in batches:
            rates[tp][batch], outputs[tp][batch] = decode_rate(llm, batch, args.new_tokens)
        llm.engine.close()
    print("| batch | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 | TP=1 step ms | TP=2 step ms | outputs equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in batches:
        one, two = rates[1][batch], rates[2][batch]
        same = sum(a == b for a, b in zip(outputs[1][batch], outputs[2][batch]))
        print(f"| {batch} | {one:.1f} | {two:.1f} | {two / one:.2f}x | {1e3 * batch / one:.1f} | "
              f"{1e3 * batch / two:.1f} | {same}/{batch} |")


if __name__ == "__main__":
    main()
