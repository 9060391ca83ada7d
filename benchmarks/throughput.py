"""Offline throughput: loraplex vs transformers `generate` vs the matmul floor, in ONE run.

Same prompts (mixed lengths), same dtype, greedy, `ignore_eos`. For each batch size it prints
the decode time per step and tokens/s of each, and their ratios. The matmul floor is the
model's own linear layers (same weights, same dtype, the decode batch's shapes) called back to
back with nothing else: what a step cannot go below without faster matmuls.

    python benchmarks/throughput.py --batch-sizes 1 16 64 --new-tokens 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loraplex.platform import LLM, SamplingParams

WORDS = ("the quick brown fox jumps over the lazy dog while paged attention keeps every block "
         "of keys and values in a pool shared by all requests of the batch").split()


def make_prompts(tokenizer, batch: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts of mixed lengths (roughly 20 to 200 user words)."""
    rng = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch):
        n = int(torch.randint(20, 200, (1,), generator=rng))
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=rng)]
        msg = [{"role": "user", "content": f"Request {i}: " + " ".join(words)}]
        prompts.append(tokenizer.apply_chat_template(msg, tokenize=True, add_generation_prompt=True, return_dict=False))
    return prompts


def bench_loraplex(llm: LLM, prompts, new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    decode_steps = []
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        sched_tokens = len(engine.scheduler.running)
        engine.step()
        if sched_tokens == len(prompts):  # every request decoding: a pure decode step
            decode_steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    return {"step_ms": 1e3 * statistics.median(decode_steps[1:] or decode_steps),
            "tok_s": len(prompts) * new_tokens / total, "total_s": total}


def bench_hf(model, tokenizer, prompts, new_tokens: int) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generation_config.eos_token_id = None

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t

    first = run(1)
    total = run(new_tokens)
    return {"step_ms": 1e3 * (total - first) / (new_tokens - 1), "tok_s": len(prompts) * new_tokens / total,
            "total_s": total}


def bench_matmul_floor(llm: LLM, batch: int, repeats: int = 10) -> dict:
    """The decode step's linear layers alone, back to back."""
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dtype = model.embed_tokens.weight.dtype
    x_in = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for m in linears:
                m(x_in[m.in_features])
            times.append(time.perf_counter() - t)
    return {"step_ms": 1e3 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=4096, num_kv_blocks=max(args.batch_sizes) * 20)
    folder = llm.engine.config.model
    tokenizer = llm.get_tokenizer()
    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    print(f"model={folder} dtype={args.dtype} new_tokens={args.new_tokens} threads={torch.get_num_threads()}")
    header = f"{'batch':>5} | {'floor ms/step':>13} | {'loraplex ms/step':>16} {'tok/s':>7} | {'HF ms/step':>10} {'tok/s':>7} | {'HF/loraplex':>11} {'loraplex/floor':>14}"
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch)
        bench_loraplex(llm, prompts[:1], 4)  # warm-up
        lp = bench_loraplex(llm, prompts, args.new_tokens)
        floor = bench_matmul_floor(llm, batch)
        line = f"{batch:>5} | {floor['step_ms']:>13.1f} | {lp['step_ms']:>16.1f} {lp['tok_s']:>7.1f} | "
        if hf is not None:
            ref = bench_hf(hf, tokenizer, prompts, args.new_tokens)
            line += f"{ref['step_ms']:>10.1f} {ref['tok_s']:>7.1f} | {ref['step_ms'] / lp['step_ms']:>11.2f} "
        else:
            line += f"{'-':>10} {'-':>7} | {'-':>11} "
        line += f"{lp['step_ms'] / floor['step_ms']:>14.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
