"""Offline throughput: loraplex vs transformers `generate` vs the matmul floor, in ONE run.

Same prompts (mixed lengths), greedy, `ignore_eos`. For each batch size it prints the decode
time per step and tokens/s of each, and their ratios (decode step and whole run). The matmul
floor is the model's own linear layers (same weights, same dtype, the decode batch's shapes)
called back to back with nothing else: what a step cannot go below without faster matmuls.

Like for like: loraplex runs with prefix caching off (every prompt is prefilled, as
transformers does), each batch size on its own prompts, the warm-up on a prompt of its own.
transformers runs in each of `--hf-dtypes` (default: float32, plus bfloat16 where the CPU
multiplies it natively) and is compared in whichever is faster for it.

    python benchmarks/throughput.py --batch-sizes 1 16 64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from loraplex.platform import LLM, SamplingParams
from loraplex.kernels.cpu_kernels import native_bf16
from loraplex.platform.models.linear import Linear

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
        sched_tokens = len(engine.core.scheduler.running)
        engine.step()
        if sched_tokens == len(prompts):  # every request decoding: a pure decode step
            decode_steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    return {"step_ms": 1e3 * statistics.median(decode_steps[1:] or decode_steps),
            "tok_s": len(prompts) * new_tokens / total, "total_s": total}


def bench_hf(model, tokenizer, prompts, new_tokens: int) -> dict:
    """transformers `generate`: tok/s over the whole run, and the median decode step timed
    between successive calls of a logits processor (one per step), as loraplex's is."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generation_config.eos_token_id = None
    clock = Clock()
    with torch.inference_mode():
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        total = time.perf_counter() - start
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return {"step_ms": 1e3 * statistics.median(steps), "tok_s": len(prompts) * new_tokens / total, "total_s": total}


def bench_matmul_floor(llm: LLM, batch: int, packed: bool, repeats: int = 10) -> dict:
    """The decode step's linear layers alone, back to back: through the layers themselves
    (`packed`: what loraplex runs, prepacked for oneDNN or, bf16 on AMX, for our tile kernel) or as
    `F.linear` on the plain weights (what an unpacked engine, transformers included, runs)."""
    model = llm.engine.core.executor.worker.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    dtype = model.norm.weight.dtype  # the model's (a tied table may live in the head's AMX tiles only)
    x_in = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}
    if packed:
        calls = [(m, x_in[m.in_features]) for m in linears]
    else:
        calls = [(functools.partial(F.linear, weight=m.dense_weight(), bias=m.bias), x_in[m.in_features])
                 for m in linears]
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for fn, x in calls:
                fn(x)
            times.append(time.perf_counter() - t)
    return {"step_ms": 1e3 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="loraplex's dtype (auto: as the engine decides it)")
    parser.add_argument("--hf-dtypes", nargs="+", default=None, choices=["float32", "bfloat16", "float16"],
                        help="transformers' candidates; compared in its faster (default: float32, "
                             "and bfloat16 where native)")
    parser.add_argument("--no-pack", action="store_true", help="loraplex on plain weights (F.linear)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "fp8"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="with --ablation: interleaved rounds, median")
    parser.add_argument("--ablation", action="store_true",
                        help="only the speed steps side by side: plain weights + PyTorch attention, "
                             "+ prepacked weights, + C kernels, the C kernels on plain weights, + float16 KV "
                             "cache, + fp8 KV cache")
    args = parser.parse_args()
    if args.ablation:
        return ablation(args)

    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=4096, num_kv_blocks=max(args.batch_sizes) * 20, pack_weights=not args.no_pack,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)
    folder = llm.engine.config.model
    dtype = llm.engine.config.torch_dtype
    tokenizer = llm.get_tokenizer()
    hf_dtypes = args.hf_dtypes or (["float32", "bfloat16"] if native_bf16() else ["float32"])
    hf = {} if args.skip_hf else {name: AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, name)).eval()
                                  for name in hf_dtypes}
    print(f"model={folder} dtype={dtype} packed={llm.engine.config.pack_weights} "
          f"kv_cache_dtype={args.kv_cache_dtype} new_tokens={args.new_tokens} threads={torch.get_num_threads()} "
          f"native_bf16={native_bf16()} prefix_caching=off hf_dtypes={hf_dtypes}")
    print("ms/step: median decode step; tok/s: output tokens over the whole run (prefill included); "
          "HF: transformers in its faster dtype (named)")
    header = (f"{'batch':>5} | {'plain floor':>11} {'our floor':>9} | {'loraplex ms':>11} {'tok/s':>6} | "
              f"{'HF dtype':>8} {'HF ms':>7} {'tok/s':>6} | {'tok/s vs HF':>11} {'step vs HF':>10} | "
              f"{'step/our floor':>14} {'step/plain floor':>16}")
    print(header)
    print("-" * len(header))
    warm = make_prompts(tokenizer, 1, seed=-1)  # a prompt no measured run uses
    for batch in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch, seed=batch)
        bench_loraplex(llm, warm, 4)
        lp = bench_loraplex(llm, prompts, args.new_tokens)
        plain = bench_matmul_floor(llm, batch, packed=False)["step_ms"]
        ours = bench_matmul_floor(llm, batch, packed=True)["step_ms"]
        line = f"{batch:>5} | {plain:>11.1f} {ours:>9.1f} | {lp['step_ms']:>11.1f} {lp['tok_s']:>6.1f} | "
        if hf:
            runs = {name: bench_hf(model, tokenizer, prompts, args.new_tokens) for name, model in hf.items()}
            best = max(runs, key=lambda name: runs[name]["tok_s"])
            ref = runs[best]
            line += (f"{best:>8} {ref['step_ms']:>7.1f} {ref['tok_s']:>6.1f} | {lp['tok_s'] / ref['tok_s']:>10.2f}x "
                     f"{ref['step_ms'] / lp['step_ms']:>9.2f}x | ")
        else:
            line += f"{'-':>8} {'-':>7} {'-':>6} | {'-':>11} {'-':>10} | "
        line += f"{lp['step_ms'] / ours:>13.2f}x {lp['step_ms'] / plain:>15.2f}x"
        print(line, flush=True)


def ablation(args) -> None:
    """Each speed step's effect, side by side in one process: the variants take turns for
    `--rounds` rounds and each cell is the median of its rounds' median decode steps."""
    engine_args = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batch_sizes),
                       max_num_batched_tokens=4096, num_kv_blocks=max(args.batch_sizes) * 20,
                       enable_prefix_caching=False)

    def engine(setting: str, **extra) -> LLM:
        """An engine whose kernels are chosen under LORAPLEX_KERNELS=setting (read once, as it is built)."""
        os.environ["LORAPLEX_KERNELS"] = setting
        try:
            return LLM(args.model, **engine_args, **extra)
        finally:
            os.environ.pop("LORAPLEX_KERNELS")

    packed = engine("auto")
    variants = [("plain weights, PyTorch attention", engine("torch", pack_weights=False), "torch"),
                ("+ prepacked weights", engine("torch"), "torch"),
                ("+ C kernels (attention in place)", packed, "auto"),
                ("C kernels, plain weights", engine("auto", pack_weights=False), "auto"),  # float32: our rows kernel
                ("+ kv_cache_dtype=float16 (opt-in)", engine("auto", kv_cache_dtype="float16"), "auto"),
                ("+ kv_cache_dtype=fp8 (opt-in)", engine("auto", kv_cache_dtype="fp8"), "auto")]
    print(f"dtype={packed.engine.config.torch_dtype} new_tokens={args.new_tokens} threads={torch.get_num_threads()}")
    print(f"{'batch':>5} | " + " | ".join(f"{name:>32}" for name, _, _ in variants) + " | (median decode step ms, x first)")
    for batch in args.batch_sizes:
        prompts = make_prompts(packed.get_tokenizer(), batch, seed=batch)
        warm = make_prompts(packed.get_tokenizer(), 1, seed=-1)
        runs: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for _ in range(args.rounds):  # variants interleaved, so drift hits each alike
            for name, llm, _ in variants:
                bench_loraplex(llm, warm, 4)  # warm-up
                runs[name].append(bench_loraplex(llm, prompts, args.new_tokens)["step_ms"])
        medians = [statistics.median(runs[name]) for name, _, _ in variants]
        print(f"{batch:>5} | " + " | ".join(f"{ms:>24.1f} ({ms / medians[0]:.2f}x)" for ms in medians), flush=True)


if __name__ == "__main__":
    main()
