"""Latency on the default model: time to first token, and inter-token latency of running
requests while long prompts keep arriving (chunked prefill).

1. TTFT: one request alone, a 100- and a 1,000-token prompt (random tokens, so no prefix hit),
   median of `--repeats`.
2. ITL under load: `--decoders` requests decode (short prompts, `--decode-tokens` each) while
   1,000-token prompts arrive as a Poisson process (`--long-rate` per second, same seeded
   arrival times for every run). Each step's token budget (`max_num_batched_tokens`, decodes
   included) caps how much prefill rides along with the decodes: one run per budget in
   `--budgets`. Reported: ITL median, p99, p99 / median, max, and the long prompts' TTFT.

    python benchmarks/latency.py --budgets 2048 256 128 80
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from loraplex.platform import LLM, SamplingParams


def random_prompt(rng: random.Random, n: int, vocab: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(n)]}


def ttft(llm: LLM, prompt_len: int, repeats: int, rng: random.Random) -> float:
    engine = llm.engine
    times = []
    for i in range(repeats):
        engine.add_request(f"ttft-{prompt_len}-{i}", random_prompt(rng, prompt_len, engine.model_config.vocab_size),
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while not engine.step():  # a step returns outputs only for requests that got a token
            pass
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return 1e3 * statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def itl_under_prefill(llm: LLM, decoders: int, decode_tokens: int, long_len: int, rate: float,
                      rng: random.Random) -> dict:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    decode_ids = {f"dec-{i}" for i in range(decoders)}
    for rid in sorted(decode_ids):
        engine.add_request(rid, random_prompt(rng, 32, vocab),
                           SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.core.scheduler.running) \
            or engine.core.scheduler.waiting:  # the decoders' own prefill is not what we measure
        engine.step()
    start = time.perf_counter()
    last_token_at: dict[str, float] = {rid: start for rid in decode_ids}
    next_arrival = start + rng.expovariate(rate)
    gaps, long_ttft, long_started = [], [], {}
    while last_token_at:
        now = time.perf_counter()
        while now >= next_arrival:  # Poisson arrivals of long prompts
            rid = f"long-{len(long_started) + len(long_ttft)}"
            engine.add_request(rid, random_prompt(rng, long_len, vocab),
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            long_started[rid] = next_arrival
            next_arrival += rng.expovariate(rate)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in last_token_at:
                gaps.append(now - last_token_at[out.request_id])
                last_token_at[out.request_id] = now
                if out.finished:
                    del last_token_at[out.request_id]
            elif out.request_id in long_started and out.finished:
                long_ttft.append(now - long_started.pop(out.request_id))
    while engine.has_unfinished():
        engine.step()
    median, p99 = statistics.median(gaps), percentile(gaps, 99)
    return {"median": 1e3 * median, "p99": 1e3 * p99, "ratio": p99 / median, "max": 1e3 * max(gaps),
            "long_prompts": len(long_ttft), "long_ttft": 1e3 * statistics.median(long_ttft) if long_ttft else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 256, 128, 80])
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--long-len", type=int, default=1000)
    parser.add_argument("--long-rate", type=float, default=0.1, help="long prompts per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    llm = LLM(args.model, max_model_len=2048, max_num_batched_tokens=2048)
    print(f"model={llm.engine.config.model} dtype={llm.engine.config.torch_dtype} threads={torch.get_num_threads()}")
    ttft(llm, 16, 1, rng)  # warm-up
    for n in () if args.skip_ttft else (100, 1000):
        print(f"TTFT, {n}-token prompt alone: {ttft(llm, n, args.repeats, rng):.0f} ms (median of {args.repeats})")
    del llm
    print()
    print(f"ITL of {args.decoders} requests decoding {args.decode_tokens} tokens each while {args.long_len}-token "
          f"prompts arrive ({args.long_rate}/s, Poisson)")
    print(f"{'step budget':>11} | {'ITL median ms':>13} {'p99 ms':>8} {'p99/median':>10} {'max ms':>8} | "
          f"{'long prompts':>12} {'their TTFT ms':>13}")
    for budget in args.budgets:
        llm = LLM(args.model, max_model_len=2048, max_num_batched_tokens=budget)
        r = itl_under_prefill(llm, args.decoders, args.decode_tokens, args.long_len, args.long_rate,
                              random.Random(args.seed))
        print(f"{budget:>11} | {r['median']:>13.0f} {r['p99']:>8.0f} {r['ratio']:>10.2f} {r['max']:>8.0f} | "
              f"{r['long_prompts']:>12} {r['long_ttft']:>13.0f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
