"""The engine on a GPU, checked in one go: parity, speed, adapters, kernels; one table at the end.

    make setup-gpu && .venv/bin/python benchmarks/gpu_check.py            # CUDA machine, ~5 min
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick          # the same code, dry run on CPU

1. Greedy parity vs transformers: float32, TF32 off, 8 prompts x 32 tokens, loraplex batched
   (decode graphs on) vs transformers one prompt at a time: equal token ids.
2. Greedy parity vs peft with 8 adapters (rank 16, all projections) in one mixed batch.
3. Throughput vs transformers `generate` at batch 1 / 16 / 64 (the engine's dtype, bfloat16 on
   CUDA; transformers in the same dtype, its default attention), and decode graphs vs
   --enforce-eager at batch 16.
4. 64 distinct adapters in one batch of 64 vs the base model alone (target >= 0.8x).
5. The device audit over a mixed workload (sampling, grammars, adapters, forks): host tensors
   fed to device ops, tensors made without a device.
6. Kernels (CUDA only): Triton vs references, SGMV bandwidth vs the bytes it must move, paged
   attention vs SDPA (benchmarks/gpu_kernels.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_kernels  # noqa: E402
from multi_lora import make_adapters  # noqa: E402
from throughput import make_prompts  # noqa: E402

from loraplex.platform import LLM, SamplingParams  # noqa: E402

ROWS: list[tuple[str, str, str]] = []  # (check, result, target)


def row(check: str, result: str, target: str = "") -> None:
    ROWS.append((check, result, target))
    print(f"  {check}: {result}" + (f"   [target {target}]" if target else ""), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_model(folder: str, dtype: torch.dtype, device: torch.device, adapter: str | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt], device=device), max_new_tokens=new_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, prompts, new_tokens: int, adapters=None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapter=adapters)
    return [o.outputs[0].token_ids for o in outs]


def tokens_per_s(llm: LLM, prompts, new_tokens: int, adapters=None) -> float:
    greedy(llm, prompts[:2], 2, adapters[:2] if adapters else None)  # warm-up
    sync(llm.engine.device)
    start = time.perf_counter()
    greedy(llm, prompts, new_tokens, adapters)
    sync(llm.engine.device)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def hf_tokens_per_s(model, tokenizer, prompts, new_tokens: int, device: torch.device) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad)

    generate(2)
    sync(device)
    start = time.perf_counter()
    generate(new_tokens)
    sync(device)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def check_parity(args, model_dir: str, device: torch.device, tmp: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    llm = LLM(model_dir, device=str(device), dtype="float32", max_model_len=512, max_loras=8,
              max_lora_rank=16, enable_prefix_caching=False, max_num_seqs=64)
    prompts = make_prompts(llm.get_tokenizer(), 8, seed=1)
    ours = greedy(llm, prompts, args.parity_tokens)
    hf = hf_model(model_dir, torch.float32, device)
    theirs = [hf_greedy(hf, p, args.parity_tokens, device) for p in prompts]
    same = sum(a == b for a, b in zip(ours, theirs))
    row("greedy parity vs transformers (fp32, TF32 off)", f"{same}/{len(prompts)} sequences equal", "8/8")
    del hf
    folders = make_adapters(model_dir, tmp, 8, 16)
    for i, folder in enumerate(folders):
        llm.load_adapter(f"a{i}", str(folder))
    names = [f"a{i % 8}" for i in range(len(prompts))]
    ours = greedy(llm, prompts, args.parity_tokens, names)
    theirs = [hf_greedy(hf_model(model_dir, torch.float32, device, str(folders[i % 8])), p, args.parity_tokens,
                        device) for i, p in enumerate(prompts)]
    same = sum(a == b for a, b in zip(ours, theirs))
    row("greedy parity vs peft, 8 adapters in one batch (fp32)", f"{same}/{len(prompts)} sequences equal", "8/8")
    torch.backends.cuda.matmul.allow_tf32 = False


def check_speed(args, model_dir: str, device: torch.device, tmp: Path) -> None:
    widest = max(args.batch_sizes + [args.adapters])
    llm = LLM(model_dir, device=str(device), max_model_len=1024, max_num_seqs=widest, max_loras=args.adapters,
              max_lora_rank=16, enable_prefix_caching=False)
    dtype = llm.engine.config.torch_dtype
    tokenizer = llm.get_tokenizer()
    hf = hf_model(model_dir, dtype, device)
    for batch in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch, seed=batch)
        ours = tokens_per_s(llm, prompts, args.new_tokens)
        theirs = hf_tokens_per_s(hf, tokenizer, prompts, args.new_tokens, device)
        row(f"tok/s at batch {batch} ({str(dtype).removeprefix('torch.')}), loraplex vs transformers",
            f"{ours:.0f} vs {theirs:.0f} = {ours / theirs:.2f}x", ">= 3x at batch 64" if batch == 64 else "")
    del hf
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        prompts = make_prompts(tokenizer, 16, seed=16)
        with_graphs = tokens_per_s(llm, prompts, args.new_tokens)
        llm.engine.runner.graphs = None
        eager = tokens_per_s(llm, prompts, args.new_tokens)
        llm.engine.runner.graphs = graphs
        row("decode graphs vs --enforce-eager, batch 16", f"{with_graphs:.0f} vs {eager:.0f} tok/s = "
            f"{with_graphs / eager:.2f}x", "> 1x")
    else:
        row("decode graphs", "off (not CUDA, or --enforce-eager)")
    folders = make_adapters(model_dir, tmp / "many", args.adapters, 16)
    for i, folder in enumerate(folders):
        llm.load_adapter(f"m{i}", str(folder))
    prompts = make_prompts(tokenizer, args.adapters, seed=7)
    base = tokens_per_s(llm, prompts, args.new_tokens)
    mixed = tokens_per_s(llm, prompts, args.new_tokens, [f"m{i}" for i in range(args.adapters)])
    row(f"{args.adapters} distinct adapters vs base, batch {args.adapters}",
        f"{mixed:.0f} vs {base:.0f} tok/s = {mixed / base:.2f}x", ">= 0.8x")


def check_audit(model_dir: str, device: torch.device) -> None:
    from loraplex.grammar.backend import StructuredOutputs
    from loraplex.platform.device import DeviceAudit

    llm = LLM(model_dir, device=str(device), max_model_len=512, max_num_seqs=16)
    engine = llm.engine
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    cases = [SamplingParams(temperature=0, max_tokens=8, logprobs=2),
             SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1, n=2, max_tokens=8, repetition_penalty=1.1),
             SamplingParams(temperature=0, max_tokens=24, structured=StructuredOutputs(json=schema))]
    for i, params in enumerate(cases):
        engine.add_request(f"audit-{i}", "Tell me a name.", params)
    audit = DeviceAudit(engine.device)
    try:
        with audit:
            for _ in range(200):
                if not engine.has_unfinished():
                    break
                engine.step()
        row("device audit over a mixed workload", f"{len(audit.found)} host tensors fed to device ops",
            "0")
        for line in sorted(set(audit.found))[:10]:
            print("    " + line)
    except RuntimeError as exc:
        row("device audit over a mixed workload", f"FAILED: {exc}", "0")


def check_kernels(device: torch.device) -> None:
    if device.type != "cuda":
        row("kernels (Triton vs references, SGMV bandwidth, attention vs SDPA)", "skipped: not CUDA")
        return
    for dtype in (torch.bfloat16, torch.float16):
        gpu_kernels.check_sgmv(dtype)
        gpu_kernels.check_attention(dtype)
    row("Triton SGMV and paged attention vs references (bf16, fp16)", "equal within tolerance")
    best = max(r["shrink_gbs"] for r in gpu_kernels.bench_sgmv())
    row("SGMV best achieved bandwidth", f"{best:.0f} GB/s", "vs HBM peak")
    gpu_kernels.bench_attention()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes: a dry run of every step")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): install the CUDA build with `make setup-gpu`, "
              "or dry-run with --device cpu --quick")
        return 1
    args.batch_sizes, args.new_tokens, args.adapters, args.parity_tokens = \
        ([1, 4], 8, 4, 8) if args.quick else ([1, 16, 64], 64, 64, 32)
    if args.model is None:
        from loraplex.platform.model_store import materialize_default_model

        args.model = str(materialize_default_model())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, model {args.model}")
    with tempfile.TemporaryDirectory(prefix="loraplex-gpu-check-") as tmp:
        for step in (lambda: check_parity(args, args.model, device, Path(tmp) / "parity"),
                     lambda: check_speed(args, args.model, device, Path(tmp) / "speed"),
                     lambda: check_audit(args.model, device),
                     lambda: check_kernels(device)):
            try:
                step()
            except Exception as exc:  # one failing check must not hide the others' numbers
                row(f"check {len(ROWS) + 1}", f"FAILED: {type(exc).__name__}: {exc}")
    width = max(len(c) for c, _, _ in ROWS)
    print(f"\n{'check':<{width}} | result | target")
    for check, result, target in ROWS:
        print(f"{check:<{width}} | {result} | {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
