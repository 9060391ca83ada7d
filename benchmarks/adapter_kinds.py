"""Adapter kinds (#63) side by side in ONE run: the base model alone, then batches whose every request has its
own adapter, 16 distinct adapters of one kind at a time: plain LoRA, DoRA, lora_bias, rank_pattern.
Configurations are interleaved over rounds and the median is kept.

    python benchmarks/adapter_kinds.py --batch 16 --new-tokens 32 --rank 16
    python benchmarks/adapter_kinds.py --kinds plain   # what an older checkout can run too (PYTHONPATH=<it>)

Adapters are random PEFT folders (peft's own format, all seven projections) for the default model (or --model).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from loraplex.platform import LLM

from multi_lora import interleaved, make_adapters, prompts_of, report  # run as a script: its folder is on the path

KINDS = {"plain": {}, "dora": {"use_dora": True}, "lora_bias": {"lora_bias": True},
         "rank_pattern": {"rank_pattern": {"q_proj": 4, "down_proj": 8}, "alpha_pattern": {"o_proj": 8}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {list(KINDS)}")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch,
              num_kv_blocks=args.batch * 16, max_loras=args.batch * len(kinds), max_lora_rank=max(args.rank, 16),
              enable_prefix_caching=False)  # every configuration reruns the same prompts
    base_dir = llm.engine.config.model
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-kinds-"))
    try:
        configs = {"base model alone": [None] * args.batch}
        for kind in kinds:
            for i, folder in enumerate(make_adapters(base_dir, tmp / kind, args.batch, args.rank, **KINDS[kind])):
                llm.load_adapter(f"{kind}-{i}", str(folder))
            configs[f"{args.batch} {kind} adapters"] = [f"{kind}-{i}" for i in range(args.batch)]
        samples = interleaved(llm, prompts_of(llm.get_tokenizer(), args.batch), configs, args.new_tokens,
                              args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"model={base_dir} dtype={llm.engine.config.torch_dtype} batch={args.batch} "
          f"new_tokens={args.new_tokens} rank={args.rank} threads={torch.get_num_threads()}")
    report(samples, width=28)


if __name__ == "__main__":
    main()
