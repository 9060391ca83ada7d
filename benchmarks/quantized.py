"""Quantized weights (`--quantization`): memory, speed and quality side by side, in one run.

    .venv/bin/python benchmarks/quantized.py [--batch-sizes 1 16 64 --new-tokens 64]

For none / q4 / int8 on the default model (float32 activations), q4 quantized at load from the
float folder instead of taken from the GGUF ("q4-float"), and on a CPU with native bf16 the
float model and q4 in bfloat16 ("none-bf16", "q4-bf16": what `dtype=auto` serves there, without
and with `--quantization q4`): bytes of the linear
weights kept, decode step and tok/s per batch size (prefix caching off, the same prompts for
all), perplexity on benchmarks/data/perplexity.txt (from prompt logprobs, so prefill's matmuls:
q4's run as a GEMM in the autotune table's `dense_dtype`, bf16 where it measures faster; again with every
quantized matmul on the int8-activation kernel that decode at batch 1 takes, where it does: not for
q4 on AMX, kept in tile order); q4 and none with 16
distinct adapters at batch 16 against their own base (and q4-bf16). Beside them in the same run:
transformers `generate` in float32 on the same prompts (`--skip-hf` to leave it out), and at batch 1
llama.cpp through llama-cpp-python (if installed) on the same GGUF file and prompt.
"""

from __future__ import annotations

import dataclasses

import argparse
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from loraplex.kernels import autotune, cpu_kernels, quant
from loraplex.kernels.cpu_kernels import native_bf16
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.model_store import _gguf_path, default_model_dir
from loraplex.platform.models.linear import Linear
from multi_lora import TARGETS, make_adapters, prompts_of, run_loraplex
from throughput import bench_hf, bench_loraplex, make_prompts

TEXT = Path(__file__).with_name("data") / "perplexity.txt"


def weight_bytes(llm: LLM) -> int:
    """Bytes of the linear layers' weights as the engine keeps them (a tied head counted once)."""
    model, total = llm.engine.core.executor.worker.model, 0
    for module in model.modules():
        if isinstance(module, Linear):
            if module.quantized is not None:
                total += module.quantized.nbytes()
            elif module is not model.lm_head or not model.config.tie_word_embeddings:
                total += module.in_features * module.out_features * model.norm.weight.element_size()
    return total


def takes_int8_activations(llm: LLM) -> bool:
    """Whether decode's small calls multiply int8 activations: quantized weights by rows (q4 in tile order,
    as kept on AMX, takes the tile kernel from 1 token on)."""
    weights = [m.quantized for m in llm.engine.core.executor.worker.model.modules() if isinstance(m, Linear) and m.quantized]
    return bool(weights) and not any(w.tiles for w in weights)


def perplexity(llm: LLM, int8_activations: bool = False) -> float:
    """From prompt logprobs, so from prefill-sized matmuls (for q4 / int8 a GEMM in
    the autotune table's `dense_dtype`: bf16 where native and measured faster, else float32); `int8_activations`
    sends every matmul through the int8-activation kernels that decode takes, to measure what
    rounding x to 8 bits costs."""
    ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"]
    layers = [m for m in llm.engine.core.executor.worker.model.modules() if isinstance(m, Linear) and m.quantized is not None]
    plans = [m.plan for m in layers]
    if int8_activations:  # each weight's plan rebuilt with the int8 kernels' range covering the whole prompt
        kernels = llm.engine.resolved.kernels
        tune = dataclasses.replace(kernels.tune, int8_activation_tokens=len(ids))
        for m in layers:
            m.plan = quant.plan(m.quantized, tune, kernels.caps)
    try:
        (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    finally:
        for m, plan in zip(layers, plans):
            m.plan = plan
    logprobs = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def bench_llama_cpp(new_tokens: int, prompts: list[list[int]], threads: int) -> dict | None:
    """In a child process: ggml's AMX path segfaults on some CPUs (seen on a Xeon with amx_int8,
    llama-cpp-python 0.3.36), so a crash is retried without ggml's extra buffer types (AMX and
    weight repacking; Q4_1 has no CPU repack, so only AMX is lost) and said so."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    for extra_bufts in (True, False):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            try:
                tok_s = pool.submit(_llama_cpp_run, new_tokens, prompts, threads, extra_bufts).result()
            except BrokenProcessPool:
                print(f"llama.cpp crashed (extra buffer types {'on' if extra_bufts else 'off'})", flush=True)
                continue
        return {"tok_s": tok_s, "extra_bufts": extra_bufts}
    return None


def _llama_cpp_run(new_tokens: int, prompts: list[list[int]], threads: int, extra_bufts: bool) -> float:
    from llama_cpp import Llama, llama_cpp

    if not extra_bufts:  # Llama() reads its defaults from the low-level module
        defaults = llama_cpp.llama_model_default_params

        def no_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = no_extra_bufts
    llm = Llama(model_path=str(_gguf_path()), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    tok_s = []
    for ids in prompts[:3]:
        llm.reset()
        start = time.perf_counter()
        produced = 0
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            produced += 1
            if produced == new_tokens:
                break
        tok_s.append(produced / (time.perf_counter() - start))
    return sorted(tok_s)[len(tok_s) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["none", "q4", "int8", "q4-float"] +
                        (["none-bf16", "q4-bf16"] if native_bf16() else []))
    parser.add_argument("--adapters", type=int, default=16, help="distinct adapters at batch 16 (0: skip)")
    parser.add_argument("--adapter-rank", type=int, default=16)
    parser.add_argument("--adapter-targets", nargs="+", default=TARGETS,
                        help="the adapters' modules (default: all seven projections; peft's default for Llama "
                             "is q_proj v_proj, at rank 8)")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers row")
    args = parser.parse_args()
    torch.manual_seed(0)
    float_copy = Path(tempfile.mkdtemp()) / "SmolLM2-float"  # not the GGUF's folder: q4 quantizes at load
    shutil.copytree(default_model_dir(), float_copy)
    adapter_dir = Path(tempfile.mkdtemp())
    adapters = make_adapters(str(default_model_dir()), adapter_dir, args.adapters, args.adapter_rank,
                             args.adapter_targets) if args.adapters else []
    rows = []
    try:
        for method in args.methods:
            folder = float_copy if method == "q4-float" else default_model_dir()
            dtype = "bfloat16" if method.endswith("-bf16") else "float32"  # none-bf16: `auto` on a bf16 CPU
            llm = LLM(str(folder), quantization=method.split("-")[0], dtype=dtype, enable_prefix_caching=False,
                      max_model_len=4096)
            tokenizer = llm.get_tokenizer()
            row = {"method": method, "bytes": weight_bytes(llm), "ppl": perplexity(llm),
                   "ppl_x8": perplexity(llm, int8_activations=True) if takes_int8_activations(llm) else None}
            bench_loraplex(llm, make_prompts(tokenizer, 2, seed=99), 8)  # warm-up
            for batch in args.batch_sizes:
                prompts = make_prompts(tokenizer, batch, seed=batch)
                # batch 1 is compared with llama.cpp: the median of three runs on the same prompt, as its is
                runs = [bench_loraplex(llm, prompts, args.new_tokens) for _ in range(3 if batch == 1 else 1)]
                row[batch] = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            if adapters and method in ("none", "q4", "q4-bf16", "none-bf16"):
                for i, folder in enumerate(adapters):
                    llm.load_adapter(f"a{i}", str(folder))
                prompts = prompts_of(tokenizer, 16)
                base = run_loraplex(llm, prompts, [None] * 16, args.new_tokens)
                mixed = run_loraplex(llm, prompts, [f"a{i % len(adapters)}" for i in range(16)], args.new_tokens)
                row["adapters"] = (base, mixed)
            rows.append(row)
            print(f"{method}: done", flush=True)
            del llm
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
            rows.append({"method": "transformers fp32", "bytes": None, "ppl": None,
                         **{b: bench_hf(hf, tokenizer, make_prompts(tokenizer, b, seed=b), args.new_tokens)
                            for b in args.batch_sizes}})
            del hf
        cpp = bench_llama_cpp(args.new_tokens, make_prompts(tokenizer, 1, seed=1) * 3, torch.get_num_threads())
    finally:
        shutil.rmtree(float_copy.parent, ignore_errors=True)
        shutil.rmtree(adapter_dir, ignore_errors=True)

    none = next((r for r in rows if r["method"] == "none"), None)
    tune = autotune.DEFAULT
    low, high = tune.amx_tile_order_tokens
    amx = f", AMX tiles for {tune.amx_tokens[0]}-{tune.amx_tokens[1] - 1}; q4 in tile order: AMX tiles for " \
          f"{low}-{high - 1}" if cpu_kernels.amx_supported() else ""
    print(f"\nSmolLM2-135M-Instruct, float32 activations (bf16 in -bf16 rows; quantized matmuls: int8 activations "
          f"for <= {tune.int8_activation_tokens} tokens{amx}), "
          f"{args.new_tokens} new tokens, greedy, no prefix cache, "
          f"{torch.get_num_threads()} threads; adapters: rank {args.adapter_rank} on "
          f"{' '.join(args.adapter_targets)}\n")
    head = " | ".join(f"batch {b} tok/s (step ms)" for b in args.batch_sizes)
    print(f"| weights | linear weight MiB | perplexity | perplexity, int8 activations | {head} "
          "| 16 adapters / own base at batch 16 |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in args.batch_sizes) + " | --- |")
    for r in rows:
        cells = " | ".join(f"{r[b]['tok_s']:.1f} ({r[b]['step_ms']:.1f})" for b in args.batch_sizes)
        ppl = "-" if r["ppl"] is None else \
            f"{r['ppl']:.3f}" + (f" ({100 * (r['ppl'] / none['ppl'] - 1):+.2f}%)" if none and r is not none else "")
        size = "-" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f}"
        mixed = f"{r['adapters'][1]:.1f} / {r['adapters'][0]:.1f} = {r['adapters'][1] / r['adapters'][0]:.2f}x" \
            if "adapters" in r else "-"
        ppl_x8 = "-" if r.get("ppl_x8") is None else \
            f"{r['ppl_x8']:.3f}" + (f" ({100 * (r['ppl_x8'] / none['ppl'] - 1):+.2f}%)" if none else "")
        print(f"| {r['method']} | {size} | {ppl} | {ppl_x8} | {cells} | {mixed} |")
    if cpp is None:
        print("\nllama.cpp: not measured (pip install llama-cpp-python, built on this machine)")
    else:
        ratio = "".join(f"; {r['method']} batch 1 / llama.cpp = {r[1]['tok_s'] / cpp['tok_s']:.2f}x" for r in rows
                        if r["method"] in ("q4", "q4-bf16") and 1 in r)
        how = "" if cpp["extra_bufts"] else " (ggml's extra buffer types off: its AMX path crashed here)"
        print(f"\nllama.cpp (llama-cpp-python, same GGUF, batch 1){how}: {cpp['tok_s']:.1f} tok/s{ratio}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
