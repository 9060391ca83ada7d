"""KV cache efficiency and engine memory on a mixed workload, default model.

Requests with mixed prompt lengths and output lengths (`ignore_eos`, so each runs to its
length) go through the real engine. After every step it counts, over the running requests:
- tokens stored: tokens whose K/V sit in the cache;
- slots allocated: paged blocks held x block size (a block shared through the prefix cache
  counts once);
- what a contiguous engine would reserve for the same running requests: max_model_len each
  (a static per-sequence cache), or prompt + max_tokens each (reserve-to-completion).
Efficiency = stored / allocated, averaged over steps (and its worst step). Memory: resident
set of this process after start-up and at its peak, beside the weights' and the KV pool's sizes.

    python benchmarks/kv_memory.py --requests 48 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch

from loraplex.platform import LLM, SamplingParams
from loraplex.platform.worker.model_runner import kv_bytes_per_block


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def occupancy(engine) -> dict:
    """Tokens stored and slots allocated over the running requests, shared blocks once."""
    bs = engine.config.block_size
    filled: dict[int, int] = {}
    reserve_max = reserve_own = logical = 0
    for req in engine.core.scheduler.running:
        for j, block in enumerate(engine.core.kv.block_ids(req)):
            n = max(0, min(bs, req.num_computed_tokens - j * bs))
            filled[block] = max(filled.get(block, 0), n)
        logical += req.num_computed_tokens
        reserve_max += engine.max_model_len
        reserve_own += len(req.prompt_token_ids) + req.params.max_tokens
    return {"stored": sum(filled.values()), "allocated": len(filled) * bs, "logical": logical,
            "reserve_max": reserve_max, "reserve_own": reserve_own, "running": len(engine.core.scheduler.running)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 768], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rss_start = rss_mib()
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              block_size=args.block_size)
    engine = llm.engine
    rss_ready = rss_mib()
    unique = {t.data_ptr(): t for t in engine.core.executor.worker.model.state_dict().values()}  # tied embeddings once
    weights_mib = sum(t.numel() * t.element_size() for t in unique.values()) / 2**20
    packed = [t for m in engine.core.executor.worker.model.modules() for t in (getattr(m, "packed", None), getattr(m, "amx_packed", None))
              if t is not None]  # oneDNN's layout, or the AMX kernel's tiles
    packed_mib = sum(t.numel() * t.element_size() for t in packed) / 2**20
    pool_mib = engine.core.kv.pool.num_blocks * kv_bytes_per_block(engine.model_config, args.block_size,
                                                              engine.config.torch_dtype) / 2**20

    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    lengths = []
    for i in range(args.requests):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*args.prompt_len))]
        out_len = rng.randint(*args.output_len)
        lengths.append((len(prompt), out_len))
        engine.add_request(f"kv-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    samples, peak_rss = [], rss_ready
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        occ = occupancy(engine)
        if occ["running"]:
            samples.append(occ)
        peak_rss = max(peak_rss, rss_mib())
    elapsed = time.perf_counter() - start

    def efficiency(key: str) -> tuple[float, float]:
        ratios = [s["stored"] / s[key] for s in samples if s[key]]
        return 100 * statistics.mean(ratios), 100 * min(ratios)

    paged_mean, paged_min = efficiency("allocated")
    max_mean, max_min = efficiency("reserve_max")
    own_mean, own_min = efficiency("reserve_own")
    peak = max(samples, key=lambda s: s["stored"])
    print(f"model={engine.config.model} dtype={engine.config.torch_dtype} block_size={args.block_size} "
          f"max_model_len={engine.max_model_len} max_num_seqs={args.max_num_seqs}")
    print(f"{args.requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]} tokens "
          f"(mean {statistics.mean(p for p, _ in lengths):.0f}), output {args.output_len[0]}-{args.output_len[1]} "
          f"(mean {statistics.mean(o for _, o in lengths):.0f}); {len(samples)} steps in {elapsed:.1f} s")
    print()
    print(f"{'allocation':<38} {'efficiency mean':>15} {'worst step':>10} {'slots at peak':>14}")
    print(f"{'loraplex paged blocks':<38} {paged_mean:>14.1f}% {paged_min:>9.1f}% {peak['allocated']:>14}")
    print(f"{'contiguous, max_model_len each':<38} {max_mean:>14.1f}% {max_min:>9.1f}% {peak['reserve_max']:>14}")
    print(f"{'contiguous, prompt + max_tokens each':<38} {own_mean:>14.1f}% {own_min:>9.1f}% {peak['reserve_own']:>14}")
    print(f"(peak step: {peak['running']} running, {peak['stored']} tokens stored)")
    print()
    print(f"resident memory: {rss_start:.0f} MiB before the engine, {rss_ready:.0f} MiB ready, "
          f"{peak_rss:.0f} MiB peak (ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    print(f"  weights (plain tensors) {weights_mib:.0f} MiB + prepacked linears {packed_mib:.0f} MiB; "
          f"KV pool {pool_mib:.0f} MiB ({engine.core.kv.pool.num_blocks} blocks); threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
