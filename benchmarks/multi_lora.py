"""Multi-LoRA throughput, side by side in ONE run: the base model alone; 1, 8, 16 and 64
distinct adapters in one batch; peft's mixed batch (`adapter_names=`); peft one adapter at a
time. Plus adapter load latency (disk -> registered, and -> in a device slot).

    python benchmarks/multi_lora.py --batch 16 --new-tokens 32 --rank 16 --dtype float32

Adapters are random PEFT folders (peft's own format, all seven projections, non-zero B) made
in a temporary folder for the default model (or --model).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loraplex.platform import LLM, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base_dir: str, out: Path, count: int, rank: int, targets: list[str] = TARGETS,
                  **lora_config) -> list[Path]:
    """One adapter through peft (`lora_config`: more of LoraConfig, as use_dora), the others by re-drawing its
    tensors (same keys and shapes; DoRA's magnitudes near their start, as trained ones are)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            init_lora_weights=False, **lora_config))
    first = out / "lora-0"
    model.save_pretrained(first)
    tensors = load_file(first / "adapter_model.safetensors")
    folders = [first]
    for i in range(1, count):
        folder = out / f"lora-{i}"
        shutil.copytree(first, folder)
        g = torch.Generator().manual_seed(i)
        fresh = {k: v * (1 + 0.05 * torch.randn(v.shape, generator=g)) if "magnitude" in k else
                 torch.randn(v.shape, generator=g) * v.std() for k, v in tensors.items()}
        save_file(fresh, folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders


def timed_load(llm: LLM, name: str, folder: Path) -> float:
    start = time.perf_counter()
    llm.load_adapter(name, str(folder))
    return time.perf_counter() - start


def prompts_of(tokenizer, batch: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Question {i}: tell me about paged "
                                            f"attention and LoRA adapters in {10 + i} words."}],
                                          tokenize=True, add_generation_prompt=True, return_dict=False)
            for i in range(batch)]


def run_loraplex(llm: LLM, prompts, adapters, new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=2), adapter=adapters[:2])
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapter=adapters)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def interleaved(llm: LLM, prompts, configs: dict[str, list], new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Each configuration's tok/s per round, the configurations taking turns within each round (in a rotating
    order): this machine's speed drifts by tens of percent within minutes, which one pass would charge to one
    configuration."""
    samples: dict[str, list[float]] = {name: [] for name in configs}
    order = list(configs)
    for k in range(rounds):  # each round starts one configuration later: none is always run first or last
        for name in order[k % len(order):] + order[:k % len(order)]:
            samples[name].append(run_loraplex(llm, prompts, configs[name], new_tokens))
    return samples


def report(samples: dict[str, list[float]], width: int = 36) -> None:
    """Median tok/s and its ratio to "base model alone" per configuration, and each round's ratio."""
    base = statistics.median(samples["base model alone"])
    print(f"{'configuration':<{width}} {'tok/s':>8} {'x base':>7}  (rounds: x base)")
    for name, values in samples.items():
        rounds = " ".join(f"{v / b:.2f}" for v, b in zip(values, samples["base model alone"]))
        print(f"{name:<{width}} {statistics.median(values):>8.1f} {statistics.median(values) / base:>7.2f}  ({rounds})")


def run_hf(model, tokenizer, prompts, new_tokens: int, **generate_kwargs) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad, **generate_kwargs)

    generate(2)  # warm-up, as loraplex gets one: first-call allocations and kernel choices
    start = time.perf_counter()
    generate(new_tokens)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 where the CPU multiplies it natively, else float32")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the loraplex configurations")
    parser.add_argument("--skip-peft-single", action="store_true", help="skip peft one adapter at a time (slow)")
    args = parser.parse_args()
    counts = [1, 8, 16, 64]
    widest = max(args.batch, max(counts))
    # prefix caching off: every configuration reruns the same prompts, and a cache hit for one
    # (the same prompt under the same adapter) would skip prefill that the others pay
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=widest, num_kv_blocks=widest * 16,
              max_loras=max(counts), max_lora_rank=max(args.rank, 16), enable_prefix_caching=False)
    dtype = llm.engine.config.torch_dtype
    base_dir = llm.engine.config.model
    tokenizer = llm.get_tokenizer()
    prompts = prompts_of(tokenizer, args.batch)
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    try:
        load_ms = {}
        for rank in sorted({8, 16} - {args.rank}):  # load latency only, then unloaded
            times = [timed_load(llm, f"r{rank}-{i}", f) for i, f in enumerate(make_adapters(base_dir, tmp / f"r{rank}", 8, rank))]
            load_ms[rank] = 1e3 * statistics.median(times)
            for i in range(8):
                llm.unload_adapter(f"r{rank}-{i}")
        folders = make_adapters(base_dir, tmp / "main", max(counts), args.rank)
        load_ms[args.rank] = 1e3 * statistics.median([timed_load(llm, f"lora-{i}", f) for i, f in enumerate(folders)])
        llm.engine.adapters.assign_slots({"lora-0"})
        t = time.perf_counter()
        llm.engine.adapters.assign_slots({"lora-1"})
        slot_s = time.perf_counter() - t

        print(f"model={base_dir} dtype={dtype} batch={args.batch} new_tokens={args.new_tokens} "
              f"rank={args.rank} threads={torch.get_num_threads()}")
        configs = [("base model alone", prompts, [None] * args.batch)]
        configs += [(f"loraplex, {n} distinct adapters", prompts, [f"lora-{i % n}" for i in range(args.batch)])
                    for n in counts if n <= args.batch]
        for n in (c for c in counts if c > args.batch):  # more adapters than requests: a batch as wide as them
            wide_prompts = prompts_of(tokenizer, n)
            configs += [(f"(batch {n}) base model alone", wide_prompts, [None] * n),
                        (f"(batch {n}) loraplex, {n} adapters", wide_prompts, [f"lora-{i}" for i in range(n)])]
        # configurations interleaved over rounds, median per configuration: this machine's speed
        # drifts by tens of percent within minutes, which one pass would charge to one configuration
        samples: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        for _ in range(args.rounds):
            for name, ps, adapters in configs:
                samples[name].append(run_loraplex(llm, ps, adapters, args.new_tokens))
        rows = [(name, statistics.median(values)) for name, values in samples.items()]

        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        rows.append(("transformers base", run_hf(hf, tokenizer, prompts, args.new_tokens)))
        n_mixed = min(16, args.batch)
        peft = PeftModel.from_pretrained(hf, str(folders[0]), adapter_name="lora-0")
        for i in range(1, n_mixed):
            peft.load_adapter(str(folders[i]), adapter_name=f"lora-{i}")
        peft.eval()
        mixed = [f"lora-{i % n_mixed}" for i in range(args.batch)]
        rows.append((f"peft mixed batch, {n_mixed} adapters", run_hf(peft, tokenizer, prompts, args.new_tokens,
                                                                      adapter_names=mixed)))
        if not args.skip_peft_single:
            start = time.perf_counter()
            for i, p in enumerate(prompts):
                peft.set_adapter(mixed[i])
                run_hf(peft, tokenizer, [p], args.new_tokens)
            rows.append((f"peft one adapter at a time", args.batch * args.new_tokens / (time.perf_counter() - start)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = rows[0][1]
    print(f"{'configuration':<36} {'tok/s':>8} {'x base':>7}")
    for name, tps in rows:
        ref = dict(rows)[name.split(")")[0] + ") base model alone"] if name.startswith("(batch") else base
        print(f"{name:<36} {tps:>8.1f} {tps / ref:>7.2f}")
    lp16 = dict(rows).get("loraplex, 16 distinct adapters")
    for label in ("peft mixed", "peft one adapter"):
        peft_tps = next((t for n, t in rows if n.startswith(label)), None)
        if lp16 and peft_tps:
            print(f"loraplex 16 adapters / {label}: {lp16 / peft_tps:.1f}x")
    for rank, ms in sorted(load_ms.items()):
        print(f"adapter load (disk -> registered, rank {rank}): median {ms:.0f} ms")
    print(f"into a slot (rank {args.rank}; a pointer to its weights, no copy): {1e3 * slot_s:.3f} ms")


if __name__ == "__main__":
    main()
