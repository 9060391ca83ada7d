"""Adapter mixes (#41), side by side in ONE run: the base model alone; each request on one of eight
adapters; each request mixing two of the eight with weights (`adapter=[(a, w), (b, w')]`, two LoRA
passes per projection); output tok/s of 16 concurrent requests, and each configuration / base.

    python benchmarks/adapter_mix.py --batch 16 --new-tokens 32 --rounds 5

Eight random PEFT adapters (all seven projections, ranks 8 and 16 alternating) on the default model
(or --model). Configurations are interleaved over rounds, median per configuration; prefix caching off
(every configuration reruns the same prompts).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.multi_lora import interleaved, make_adapters, prompts_of, report
from loraplex.platform import LLM


def mixes(batch: int, names: list[str], seed: int) -> list[list[tuple[str, float]]]:
    """Each request: two distinct adapters of `names`, weights in [-1, 1] away from 0."""
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        a, b = rng.sample(names, 2)
        out.append([(a, round(rng.uniform(0.2, 1.0), 2)), (b, round(rng.choice((-1, 1)) * rng.uniform(0.2, 1.0), 2))])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch,
              num_kv_blocks=args.batch * 16, max_loras=8, max_lora_rank=16, enable_prefix_caching=False)
    base_dir = llm.engine.config.model
    prompts = prompts_of(llm.get_tokenizer(), args.batch)
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-mix-bench-"))
    try:
        names = []
        for rank in (8, 16):
            for i, folder in enumerate(make_adapters(base_dir, tmp / f"r{rank}", 4, rank)):
                names.append(f"r{rank}-{i}")
                llm.load_adapter(names[-1], str(folder))
        configs = {"base model alone": [None] * args.batch,
                   "one of 8 adapters per request": [names[i % len(names)] for i in range(args.batch)],
                   "2 of 8 adapters mixed per request": mixes(args.batch, names, seed=0)}
        print(f"model={base_dir} dtype={llm.engine.config.torch_dtype} batch={args.batch} "
              f"new_tokens={args.new_tokens} ranks=8,16 threads={torch.get_num_threads()} rounds={args.rounds}")
        samples = interleaved(llm, prompts, configs, args.new_tokens, args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(samples)


if __name__ == "__main__":
    main()
