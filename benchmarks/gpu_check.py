"""The engine on a GPU, checked in one go on a bare machine; one markdown table written to --out.

    PYTHONPATH=. python benchmarks/gpu_check.py --tokenizer gpu_tokenizer --out $OUT    # CUDA, < 8 min
    .venv/bin/python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check            # the plumbing on CPU

The machine needs torch (CUDA), triton, transformers, peft, safetensors, tokenizers, jinja2 and nothing
installed from this project: it imports loraplex from the working tree. No model is downloaded: random-weight
checkpoints of Llama-3.2-1B and Llama-3.1-8B shapes (bf16) are written here by transformers, with the default
model's tokenizer files from --tokenizer (tokenizer.json, tokenizer_config.json and, where present,
special_tokens_map.json / chat_template.jinja, copied from ~/.cache/loraplex/models/SmolLM2-135M-Instruct).

Sections (each one's failure is a row of the table; the others still run; a section that would pass the time
budget is skipped, and the table is rewritten after every row, so a killed run still leaves its numbers):
 environment, HBM bandwidth (a device-to-device copy), kernels (Triton vs references, prefill attention
 Triton vs SDPA), parity on the 1B shape (fp32, TF32 off: vs transformers; 8 adapters in one batch vs peft),
 and speculative decoding's verify pass (greedy tokens with drafts, some wrong, vs without),
 then on the 8B shape: decode tok/s at batch 1/16/64/256 vs transformers `generate` and vs the HBM floor (batch 1
 and 64 against their targets' share of it), decode graphs vs eager at batch 16, 8 and 64 distinct rank-16
 adapters vs base at batch 16 and 64, the kernel launches of one eager decode step at batch 64 (base and 64
 adapters: ATen ops and Triton kernels, per layer, kernels/launch_count.py), a profile of the decode step (base
 and with the adapters: wall vs device-busy time, graph replays, costliest kernels; whole tables in
 profile_*.txt) with the unprofiled step against its device-busy time, batch-1 decode with every draft right
 (k = 4, 8) vs without, KV blocks vs free memory, the device audit (its grammar case only where llguidance or
 xgrammar is installed). Timers: warm-up first, device synced before each, same prompts on both sides, prefix
 caching off.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # loraplex from this tree (its __init__ maps the folders)

import torch  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPES = {
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=32.0)),
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0)),
    # the dry run's: a vocabulary as wide as the default tokenizer's, so ids past a small tokenizer's are sampled
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=49152, tie_word_embeddings=False,
                 rope_theta=10000.0),
}


@dataclass
class Plan:
    """Sizes of one run: the real check, or the dry run's small ones."""

    small: str = "Llama-3.2-1B"
    large: str = "Llama-3.1-8B"
    batches: tuple = (1, 16, 64, 256)
    prompt_len: int = 128
    new_tokens: int = 32
    parity_prompts: int = 8
    parity_tokens: int = 16
    parity_adapters: int = 8
    adapters: int = 64  # loaded on the large shape's engine: the most of `adapter_counts`
    adapter_batches: tuple = (16, 64)  # adapters vs base at each; launches and the profile at the widest
    adapter_counts: tuple = ((8, 0.9), (64, 0.8))  # (distinct adapters, target vs base at the widest batch)
    floor_targets: tuple = ((1, 0.75), (64, 0.60))  # (batch, base decode's target share of the HBM floor)
    graph_batch: int = 16
    dtype: str = "auto"  # the speed sections' engine (bfloat16 on CUDA)
    budget_s: float = 450.0  # 7.5 minutes: what is left then is skipped


DRY_RUN = Plan(small="tiny", large="tiny", batches=(1, 4), prompt_len=8, new_tokens=4, parity_prompts=2,
               parity_tokens=4, parity_adapters=2, adapters=4, adapter_batches=(2, 4),
               adapter_counts=((2, 0.9), (4, 0.8)), floor_targets=((1, 0.75), (4, 0.60)), graph_batch=2,
               dtype="float32", budget_s=120.0)


@dataclass
class Report:
    """The table, rewritten into `path` after every row."""

    path: Path
    title: str
    rows: list = field(default_factory=list)

    def row(self, check: str, result: str, target: str = "") -> None:
        self.rows.append((check, result, target))
        print(f"  {check}: {result}" + (f"   [target {target}]" if target else ""), flush=True)
        self.write()

    def write(self) -> None:
        lines = [f"# {self.title}", "", "| check | result | target |", "| --- | --- | --- |"]
        lines += ["| " + " | ".join(cell(text) for text in row) + " |" for row in self.rows]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)


def cell(text: str) -> str:
    """Text as one markdown table cell: its pipes escaped, on one line."""
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass
class Check:
    """What the sections share: the run's sizes, device, report, work folder and what earlier sections found."""

    plan: Plan
    device: torch.device
    report: Report
    work: Path
    tokenizer: Path
    started: float = field(default_factory=time.perf_counter)
    found: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release() -> None:
    """What a dropped engine or model held, back to the device (between engines in one process)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- checkpoints -----------------------------------------------------------------------------------------


def hf_model(shape: str, tokenizer_dir: Path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """A random-weight Llama of `shape` made on `device` (fast: no host init), ids from the tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # made in float32 then cast: the same on every transformers version
        model = LlamaForCausalLM(config)
    rope = model.model.rotary_emb
    frequencies = {name: getattr(rope, name).clone() for name in ("inv_freq", "original_inv_freq") if
                   isinstance(getattr(rope, name, None), torch.Tensor)}
    model = model.to(dtype)
    for name, value in frequencies.items():  # a cast would round them to bf16, as no loaded checkpoint has them
        rope.register_buffer(name, value, persistent=False)
    model.generation_config.eos_token_id = None  # every side generates its full count
    return model.eval()


def write_checkpoint(model, tokenizer_dir: Path, folder: Path) -> Path:
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def write_adapters(model, out: Path, count: int, rank: int = 16) -> list[Path]:
    """`count` rank-`rank` LoRAs on every projection in the model's dtype: one through peft, the others its
    tensors re-drawn on the model's device (same keys and shapes); `model` is given back without LoRA layers."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    device, dtype = model.device, model.dtype
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                  init_lora_weights=False))
    first = out / "lora-0"
    peft_model.save_pretrained(first)
    peft_model.unload()
    tensors = {k: v.to(dtype) for k, v in load_file(first / "adapter_model.safetensors").items()}
    save_file(tensors, first / "adapter_model.safetensors")  # peft keeps adapters in fp32 on a bf16 model
    folders = [first]
    for i in range(1, count):
        folder = out / f"lora-{i}"
        shutil.copytree(first, folder)
        g = torch.Generator(device=device).manual_seed(i)
        save_file({k: (torch.randn(v.shape, generator=g, device=device) * v.float().std()).to(dtype).cpu()
                   for k, v in tensors.items()}, folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token ids drawn from the tokenizer's range (both sides get the same ones)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (count, length), generator=g).tolist()


# ---- measuring -------------------------------------------------------------------------------------------


def hbm_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write), best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def weight_bytes(shape: str, element: int = 2) -> int:
    """What one decode step reads of the weights: every layer, the final norm and the head (not the embedding
    table, of which it reads a row per token, unless the head is that table)."""
    s = SHAPES[shape]
    h, inter, heads, kv, d = (s[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim"))
    layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter + 2 * h
    return element * (s["num_hidden_layers"] * layer + s["vocab_size"] * h + h)


def kv_bytes(shape: str, batch: int, context: float, element: int = 2) -> float:
    s = SHAPES[shape]
    return element * 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * batch * context


def floor_tokens_per_s(shape: str, batch: int, context: float, bandwidth: float) -> float:
    """Decode tok/s if a step took only the time to read its weights and KV at the measured bandwidth."""
    return batch * bandwidth / (weight_bytes(shape) + kv_bytes(shape, batch, context))


def engine_decode_rate(llm, batch_prompts, new_tokens: int, adapters=None) -> float:
    """Decode tok/s of the engine: the steps after every request has its first token (prefill excluded)."""
    from loraplex.platform import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    tag = f"d{time.perf_counter_ns()}"
    for i, p in enumerate(batch_prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params, adapters[i] if adapters else None)
    counts: dict[str, int] = {}
    while sum(n > 0 for n in counts.values()) < len(batch_prompts) and engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.outputs[0].token_ids)
    first = sum(counts.values())
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.outputs[0].token_ids)
    sync(engine.device)
    return (sum(counts.values()) - first) / (time.perf_counter() - start)


def decoding(engine, batch_prompts, adapters, params) -> None:
    """Queue `batch_prompts` (request i on `adapters[i]`, None: the base) and step until each has its first token:
    what follows are decode steps."""
    tag = f"q{time.perf_counter_ns()}"
    for i, p in enumerate(batch_prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params, adapters[i] if adapters else None)
    started: set[str] = set()
    while len(started) < len(batch_prompts) and engine.has_unfinished():
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}


def hf_decode_rate(model, batch_prompts, new_tokens: int, device: torch.device) -> float:
    """Decode tok/s of transformers `generate`: a run of 1 + n tokens minus a run of 1 (its prefill)."""
    ids = torch.tensor(batch_prompts, device=device)

    def timed(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return len(batch_prompts) * new_tokens / max(timed(1 + new_tokens) - timed(1), 1e-9)


def greedy(llm, batch_prompts, new_tokens: int, adapters=None) -> list[list[int]]:
    from loraplex.platform import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params, adapter=adapters)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(model, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt], device=device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """Equal sequences, and where the others first part (random weights leave near-ties that fp32 sums in
    another order may flip)."""
    same = sum(a == b for a, b in zip(ours, theirs))
    splits = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(ours, theirs)
              if a != b and any(x != y for x, y in zip(a, b))]
    return f"{same}/{len(ours)} sequences equal" + (f"; others part at tokens {splits}" if splits else "")


def parting_margins(model, batch_prompts, ours: list[list[int]], theirs: list[list[int]], device: torch.device,
                    select=None) -> list[float]:
    """Where a sequence parts: transformers' logit of its own token minus its logit of ours, over the std of that
    position's logits. fp32 sums in another order move logits by ~1e-6 of that std: a margin that small is a
    near-tie flipped, a large one a real difference. `select(i)` sets the i-th prompt's adapter first."""
    margins = []
    for i, (prompt, a, b) in enumerate(zip(batch_prompts, ours, theirs)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        if select is not None:
            select(i)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + b[:at]], device=device)).logits[0, -1].float()
        margins.append(((logits[b[at]] - logits[a[at]]) / logits.std()).item())
    return margins


def margins_note(margins: list[float]) -> str:
    return f"; transformers' margin there (logit std units): {', '.join(f'{m:.1e}' for m in margins)}" \
        if margins else ""


def built_engine(check: Check):
    """The large shape's engine the decode section built, for the sections after it."""
    if "llm" not in check.found:
        raise RuntimeError("no engine: the decode section did not build one (see its row)")
    return check.found["llm"]


def engine(check: Check, folder: Path, **settings):
    from loraplex.platform import LLM

    base = dict(device=str(check.device), enable_prefix_caching=False, max_lora_rank=16)
    return LLM(str(folder), **(base | settings))


# ---- sections --------------------------------------------------------------------------------------------


def section_environment(check: Check) -> None:
    import transformers

    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for name in ("triton", "peft"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            versions.append(f"{name} missing")
    name = torch.cuda.get_device_name(check.device) if check.cuda else "CPU (dry run)"
    check.report.row("machine", f"{name}; {', '.join(versions)}")
    from loraplex.platform import LLM  # noqa: F401  the engine imports here (its packages are present)

    check.report.row("loraplex imported from the working tree", str(ROOT))


def section_bandwidth(check: Check) -> None:
    nbytes = (4 << 30) if check.cuda else (64 << 20)
    check.found["bandwidth"] = bw = hbm_bandwidth(check.device, nbytes)
    check.report.row("device-to-device copy bandwidth (the floors' divisor)", f"{bw / 1e9:.0f} GB/s",
                     "H200 HBM3e ~4.8 TB/s peak")


def section_kernels(check: Check) -> None:
    import gpu_kernels

    if not check.cuda:
        section_prefill_math(check)
        return
    for dtype in (torch.bfloat16, torch.float16):
        gpu_kernels.check_sgmv(dtype)
        gpu_kernels.check_attention(dtype)
    check.report.row("Triton SGMV and paged attention vs references (bf16, fp16)", "equal within tolerance")
    flush = gpu_kernels.flush_buffer()
    for r in gpu_kernels.bench_prefill(flush):
        check.report.row(f"prefill attention, {r['batch']} fresh prompt(s) of {r['length']} tokens: Triton vs "
                         "SDPA", f"{r['triton_us']:.0f} vs {r['sdpa_us']:.0f} us = SDPA "
                         f"{r['triton_us'] / r['sdpa_us']:.2f}x", "SDPA > 1x: auto -> sdpa")
    best = max(r["shrink_gbs"] for r in gpu_kernels.bench_sgmv(flush))
    check.report.row("SGMV shrink, best achieved bandwidth (L2 flushed)", f"{best:.0f} GB/s",
                     f"vs copy {check.found.get('bandwidth', 0) / 1e9:.0f} GB/s")


def section_prefill_math(check: Check) -> None:
    """CPU: the SDPA prefill path's numbers against the paged reference (no timing without CUDA)."""
    from gpu_kernels import HEAD_DIM, HEADS, KV_HEADS, attention_case

    from loraplex.kernels.custom_ops import sdpa_prefill
    from loraplex.kernels.paged_attention import paged_attention_reference

    q, kc, vc, meta, _ = attention_case(2, 24, 0, HEADS, KV_HEADS, HEAD_DIM, 16, torch.float32, "cpu")
    diff = (sdpa_prefill(q, kc, vc, meta, 0.1) - paged_attention_reference(q, kc, vc, meta, 0.1)).abs().max()
    check.report.row("prefill attention SDPA path vs paged reference (CPU, no timing)", f"max |diff| {diff:.1e}",
                     "< 1e-4")


def section_parity(check: Check) -> None:
    plan, device = check.plan, check.device
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = hf_model(plan.small, check.tokenizer, device)
    folder = write_checkpoint(model, check.tokenizer, check.work / "small")
    adapters = write_adapters(model, check.work / "small-adapters", plan.parity_adapters)
    model = model.float()  # the bf16 checkpoint's values, as the engine reads them in fp32
    batch_prompts = prompts(plan.parity_prompts, 24, check.found["vocab"], seed=1)
    theirs = [hf_greedy(model, p, plan.parity_tokens, device) for p in batch_prompts]
    llm = engine(check, folder, dtype="float32", max_model_len=256, max_loras=plan.parity_adapters, max_num_seqs=16)
    graphs = " with decode graphs" if check.cuda else ""
    ours = greedy(llm, batch_prompts, plan.parity_tokens)
    check.report.row(f"greedy parity vs transformers ({plan.small}, fp32, TF32 off, batched{graphs})",
                     agreement(ours, theirs) + margins_note(parting_margins(model, batch_prompts, ours, theirs,
                                                                            device)),
                     f"{plan.parity_prompts}/{plan.parity_prompts}")
    section_peft_parity(check, llm, model, adapters, batch_prompts)
    section_spec_parity(check, llm, batch_prompts)
    del llm, model
    release()


def section_deterministic(check: Check) -> None:
    """--deterministic on the device (bf16, the small shape, two adapters): one request's tokens and logprobs alone,
    in batches of 16 and 64 beside other prompts and adapters, with its prefix cached, and with prefill in chunks of
    64, bitwise (the speed cost is benchmarks/deterministic.py's to measure)."""
    from loraplex.platform import SamplingParams

    folder, adapters = check.work / "small", sorted((check.work / "small-adapters").iterdir())[:2]
    if not folder.is_dir():
        raise RuntimeError("no small checkpoint: the parity section did not write one (see its row)")
    loras = {f"a{i}": str(p) for i, p in enumerate(adapters)}
    settings = dict(dtype="bfloat16", max_model_len=256, max_loras=2, max_num_seqs=64, lora_modules=loras)
    llm = engine(check, folder, deterministic=True, enable_prefix_caching=True, **settings)
    others = prompts(63, 20, check.found["vocab"], seed=5)
    mine = prompts(1, 40, check.found["vocab"], seed=6)[0]

    def signature(batch, salt, llm=llm):
        params = [SamplingParams(temperature=0, max_tokens=check.plan.parity_tokens, ignore_eos=True, logprobs=2,
                                 cache_salt=f"{salt}{i}") for i in range(len(batch))]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params,
                            adapter=["a0"] + [f"a{i % 2}" if i % 3 else None for i in range(1, len(batch))])
        out = outs[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]

    alone = signature([mine], "alone")
    cases = {"batch 16": signature([mine] + others[:15], "b16"), "batch 64": signature([mine] + others, "b64"),
             "cached": signature([mine], "alone")}
    chunked = engine(check, folder, deterministic=True, max_num_batched_tokens=64, **settings)
    cases["chunks of 64"] = signature([mine] + others[:15], "c", llm=chunked)
    same = [name for name, got in cases.items() if got == alone]
    check.report.row("deterministic: one request's tokens and logprobs alone vs " + ", ".join(cases) +
                     f" (bf16, {check.plan.small}, adapters)", f"{len(same)}/{len(cases)} bitwise equal",
                     f"{len(cases)}/{len(cases)}")
    del llm, chunked
    release()


def section_tensor_parallel(check: Check) -> None:
    """--tensor-parallel-size 2 over NCCL (2+ GPUs; the dry run: gloo on the CPU): the small shape with two
    adapters, TP=2 greedy tokens vs TP=1 (bf16: the all-reduce's sum order may move a near tie) and decode tok/s of
    each at batch 16."""
    gpus = torch.cuda.device_count() if check.cuda else 2
    if gpus < 2:
        check.report.row("tensor parallel: TP=2 vs TP=1", f"SKIPPED: needs 2 GPUs, {gpus} visible", "2 GPUs")
        return
    folder, adapters = check.work / "small", sorted((check.work / "small-adapters").iterdir())[:2]
    if not folder.is_dir():
        raise RuntimeError("no small checkpoint: the parity section did not write one (see its row)")
    loras = {f"a{i}": str(p) for i, p in enumerate(adapters)}
    batch = prompts(16, 32, check.found["vocab"], seed=9)
    names = [f"a{i % 2}" if i % 3 else None for i in range(len(batch))]
    tokens, rates = {}, {}
    for tp in (1, 2):
        llm = engine(check, folder, dtype="bfloat16" if check.cuda else "float32", max_model_len=256, max_loras=2,
                     lora_modules=loras, tensor_parallel_size=tp, enforce_eager=True)
        tokens[tp] = greedy(llm, batch, check.plan.parity_tokens, names)
        rates[tp] = engine_decode_rate(llm, batch, check.plan.new_tokens, names)
        llm.engine.close()
        del llm
        release()
    same = sum(a == b for a, b in zip(tokens[1], tokens[2]))
    check.report.row(f"tensor parallel: TP=2 vs TP=1 greedy, 16 prompts, 2 adapters ({check.plan.small})",
                     f"{same}/16 equal", "16/16 (bf16: a near tie may differ)")
    check.report.row("tensor parallel: decode tok/s at batch 16, TP=1 / TP=2",
                     f"{rates[1]:.0f} / {rates[2]:.0f}")


class Reference:
    """A proposer drafting each prompt's known greedy continuation; every `wrong_every`-th draft has a token
    changed (rejections at every position), 0: none."""

    always = True

    def __init__(self, continuations: dict[tuple, list[int]], wrong_every: int = 0) -> None:
        self.continuations, self.wrong_every, self.calls = continuations, wrong_every, 0

    def propose(self, req, drafts, room):
        self.calls += 1
        done = len(req.output_token_ids)
        out = list(self.continuations.get(tuple(req.prompt_token_ids), [])[done:done + room])
        if out and self.wrong_every and self.calls % self.wrong_every == 0:
            out[self.calls % len(out)] += 1
        return out


@contextlib.contextmanager
def drafting(llm, proposer, k: int = 4):
    """The engine verifying `proposer`'s drafts (k at most, never paused) for a block."""
    from loraplex.platform.spec_decode.drafter import Drafter
    from loraplex.platform.config import SpeculativeConfig

    engine, plain, ahead = llm.engine, llm.engine.core.drafter, llm.engine.core.ahead
    config = SpeculativeConfig(num_speculative_tokens=k, min_acceptance=0.0, disable_by_batch_size=256)
    engine.core.drafter = Drafter(config, engine.tokenizer, engine.max_model_len, plain.jump_forward)
    engine.core.drafter.proposers = [proposer]
    engine.core.ahead = False  # drafts need each step's tokens on the host: --async-scheduling is off with them
    try:
        yield engine.core.drafter
    finally:
        engine.core.drafter, engine.core.ahead = plain, ahead


def section_spec_parity(check: Check, llm, batch_prompts) -> None:
    """Speculative decoding's verify pass (several new tokens a sequence through the paged attention and SGMV
    kernels): greedy tokens with drafts, some wrong, equal those without, base and adapters in one batch (fp32)."""
    which = [None if i % 2 else f"a{i % check.plan.parity_adapters}" for i in range(len(batch_prompts))]
    plain = greedy(llm, batch_prompts, check.plan.parity_tokens, which)
    with drafting(llm, Reference({tuple(p): t for p, t in zip(batch_prompts, plain)}, wrong_every=3)) as drafter:
        drafted = greedy(llm, batch_prompts, check.plan.parity_tokens, which)
    counts = drafter.counters
    check.report.row("speculative: greedy tokens with drafts (a third wrong) vs without, adapters and base "
                     f"(fp32; {counts.num_accepted_tokens}/{counts.num_draft_tokens} drafts accepted)",
                     agreement(drafted, plain), f"{len(batch_prompts)}/{len(batch_prompts)}")


def section_speculative(check: Check) -> None:
    """Batch-1 decode of the large shape with its own greedy continuation drafted (every draft right: what
    verifying k tokens a step costs against one), k = 4 and 8."""
    llm, plan = built_engine(check), check.plan
    batch_prompts = prompts(1, plan.prompt_len, check.found["vocab"], 23)
    new_tokens = 4 * plan.new_tokens
    plain_tokens = greedy(llm, batch_prompts, new_tokens + 1)
    plain = engine_decode_rate(llm, batch_prompts, new_tokens)
    for k in (4, 8):
        with drafting(llm, Reference({tuple(batch_prompts[0]): plain_tokens[0]}), k):
            drafted = engine_decode_rate(llm, batch_prompts, new_tokens)
        dtype = str(llm.engine.resolved.kernels.dtype).removeprefix("torch.")
        check.report.row(f"speculative decode, batch 1, k={k}, every draft right ({plan.large}, {dtype})",
                         f"{drafted:.0f} vs {plain:.0f} tok/s = {drafted / plain:.2f}x", "> 2x")


def section_peft_parity(check: Check, llm, model, adapters: list[Path], batch_prompts) -> None:
    from peft import PeftModel

    names = [f"a{i}" for i in range(len(adapters))]
    for name, path in zip(names, adapters):
        llm.load_adapter(name, str(path))
    peft_model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name=names[0])
    for name, path in zip(names[1:], adapters[1:]):
        peft_model.load_adapter(str(path), adapter_name=name)
    which = [names[i % len(names)] for i in range(len(batch_prompts))]
    theirs = []
    for name, p in zip(which, batch_prompts):
        peft_model.set_adapter(name)
        theirs.append(hf_greedy(peft_model, p, check.plan.parity_tokens, check.device))
    ours = greedy(llm, batch_prompts, check.plan.parity_tokens, which)
    margins = parting_margins(peft_model, batch_prompts, ours, theirs, check.device,
                              lambda i: peft_model.set_adapter(which[i]))
    check.report.row(f"greedy parity vs peft, {len(adapters)} adapters (rank 16, all projections) in one batch",
                     agreement(ours, theirs) + margins_note(margins), f"{len(batch_prompts)}/{len(batch_prompts)}")


def section_large_model(check: Check) -> None:
    """The large shape's checkpoint, its adapters, and transformers' decode rates (then freed)."""
    plan = check.plan
    model = hf_model(plan.large, check.tokenizer, check.device)
    check.found["large"] = write_checkpoint(model, check.tokenizer, check.work / "large")
    check.found["large_adapters"] = write_adapters(model, check.work / "large-adapters", plan.adapters)
    check.found["hf_rates"] = rates = {}
    for batch in plan.batches:
        if check.elapsed() > plan.budget_s * 0.6:  # leave the engine its share
            break
        rates[batch] = hf_decode_rate(model, prompts(batch, plan.prompt_len, check.found["vocab"], batch),
                                      plan.new_tokens, check.device)
    check.report.row(f"{plan.large} bf16 checkpoint and {plan.adapters} adapters written; transformers measured",
                     f"batches {sorted(rates)}")
    del model
    release()


def section_decode(check: Check) -> None:
    plan = check.plan
    widest = max(max(plan.batches), max(plan.adapter_batches))
    # the CPU cache holds every adapter: no request's finish evicts one (and reads it back) inside a timed window
    llm = check.found["llm"] = engine(check, check.found["large"], max_model_len=1024, max_num_seqs=widest,
                                      max_loras=plan.adapters, dtype=plan.dtype, async_scheduling=True,
                                      lora_memory=max(2 << 30, plan.adapters * (128 << 20)))
    dtype = str(llm.engine.config.torch_dtype).removeprefix("torch.")
    context = plan.prompt_len + plan.new_tokens / 2
    floor_targets = dict(plan.floor_targets)
    for batch in plan.batches:
        batch_prompts = prompts(batch, plan.prompt_len, check.found["vocab"], batch)
        engine_decode_rate(llm, prompts(batch, plan.prompt_len, check.found["vocab"], 1000 + batch), 2)  # warm
        ours = engine_decode_rate(llm, batch_prompts, plan.new_tokens)
        theirs = check.found["hf_rates"].get(batch)
        versus = f" vs transformers {theirs:.0f} = {ours / theirs:.2f}x" if theirs else " (transformers skipped)"
        check.report.row(f"decode tok/s, {plan.large} {dtype}, batch {batch}", f"{ours:.0f}{versus}; " +
                         floor_note(check, batch, context, ours),
                         ">= 3x transformers at 64" if batch == 64 else "")
        if batch in floor_targets:
            floor = hbm_floor(check, batch, context)
            share = f"{ours:.0f} of {floor:.0f} tok/s = {ours / floor:.0%}" if floor else "no bandwidth measured"
            check.report.row(f"base decode, batch {batch}, share of the HBM floor ({plan.large} {dtype})", share,
                             f">= {floor_targets[batch]:.0%}")


def hbm_floor(check: Check, batch: int, context: float) -> float | None:
    """The large shape's decode tok/s at the HBM floor at `batch` (None: no bandwidth measured)."""
    bandwidth = check.found.get("bandwidth")
    return floor_tokens_per_s(check.plan.large, batch, context, bandwidth) if bandwidth else None


def floor_note(check: Check, batch: int, context: float, ours: float) -> str:
    floor = hbm_floor(check, batch, context)
    return f"HBM floor {floor:.0f} = {ours / floor:.0%} of it" if floor else "HBM floor: no bandwidth measured"


def section_graphs(check: Check) -> None:
    llm, plan = built_engine(check), check.plan
    graphs = llm.engine.core.executor.worker.runner.graphs
    if graphs is None:
        check.report.row("decode graphs vs eager", "graphs off (not CUDA)")
        return
    batch_prompts = prompts(plan.graph_batch, plan.prompt_len, check.found["vocab"], 16)
    with_graphs = engine_decode_rate(llm, batch_prompts, plan.new_tokens)
    llm.engine.core.executor.worker.runner.graphs = None
    try:
        eager = engine_decode_rate(llm, batch_prompts, plan.new_tokens)
    finally:
        llm.engine.core.executor.worker.runner.graphs = graphs
    check.report.row(f"decode graphs vs eager, batch {plan.graph_batch}",
                     f"{with_graphs:.0f} vs {eager:.0f} tok/s = {with_graphs / eager:.2f}x", "> 1x")


def section_async(check: Check) -> None:
    """--async-scheduling (the speed sections' engine runs with it) against steps in order, base and with the most
    distinct adapters at the widest adapter batch: tok/s, and the greedy tokens of both (the pinned buffers'
    fences and the stream's order are only tested here)."""
    llm, plan = built_engine(check), check.plan
    core, batch = llm.engine.core, max(plan.adapter_batches)
    batch_prompts = prompts(batch, plan.prompt_len, check.found["vocab"], 24)
    for label, adapters in (("base", None), (f"{plan.adapters} adapters", cycled(adapter_names(check), plan.adapters,
                                                                                  batch))):
        rates, tokens, ahead = {}, {}, core.ahead
        for mode in (True, False):
            core.ahead = mode
            try:
                rates[mode] = engine_decode_rate(llm, batch_prompts, plan.new_tokens, adapters)
                tokens[mode] = greedy(llm, batch_prompts, plan.new_tokens, adapters)
            finally:
                core.ahead = ahead
        check.report.row(f"async scheduling vs steps in order, batch {batch}, {label}",
                         f"{rates[True]:.0f} vs {rates[False]:.0f} tok/s = {rates[True] / rates[False]:.2f}x; greedy: "
                         f"{agreement(tokens[True], tokens[False])}", "> 1x; all equal")


def adapter_names(check: Check) -> list[str]:
    """The large shape's adapters, loaded into its engine once (by whichever section asks first)."""
    if "adapter_names" not in check.found:
        llm, names = built_engine(check), [f"m{i}" for i in range(check.plan.adapters)]
        for name, folder in zip(names, check.found["large_adapters"]):
            llm.load_adapter(name, str(folder))
        check.found["adapter"], check.found["adapter_names"] = names[0], names
    return check.found["adapter_names"]


def cycled(names: list[str], count: int, batch: int) -> list[str]:
    """Each of `batch` requests' adapter, going round the first `count` of `names`."""
    return [names[i % count] for i in range(batch)]


def section_adapters(check: Check) -> None:
    """Distinct rank-16 adapters vs base on the same prompts: each count of `plan.adapter_counts` at each batch of
    `plan.adapter_batches` (the requests going round the adapters, so a batch smaller than the count holds as many
    distinct ones as requests); the targets are the widest batch's."""
    llm, plan = built_engine(check), check.plan
    names, widest = adapter_names(check), max(plan.adapter_batches)
    warm = prompts(widest, plan.prompt_len, check.found["vocab"], 6)
    engine_decode_rate(llm, warm, 2, cycled(names, len(names), widest))  # warm-up: every slot filled, LoRA graphs
    for batch in plan.adapter_batches:
        batch_prompts = prompts(batch, plan.prompt_len, check.found["vocab"], 7 + batch)
        base = engine_decode_rate(llm, batch_prompts, plan.new_tokens)
        for count, target in plan.adapter_counts:
            mixed = engine_decode_rate(llm, batch_prompts, plan.new_tokens, cycled(names, count, batch))
            which = f"{count} distinct" if count <= batch else f"{count} ({batch} distinct in the batch)"
            check.report.row(f"{which} rank-16 adapters vs base, batch {batch}",
                             f"{mixed:.0f} vs {base:.0f} tok/s = {mixed / base:.2f}x",
                             f">= {target}x" if batch == widest else f"(the target is batch {widest}'s)")


def section_launches(check: Check) -> None:
    """Kernel launches of one eager decode step (graphs off for it) at the widest adapter batch, base and with the
    most adapters: ATen ops and Triton kernels (`kernels/launch_count.py`), per decoder layer, the most launched."""
    llm, plan = built_engine(check), check.plan
    batch = max(plan.adapter_batches)
    batch_prompts = prompts(batch, plan.prompt_len, check.found["vocab"], 9)
    for label, adapters in (("base", None), (f"{plan.adapters} adapters", cycled(adapter_names(check), plan.adapters,
                                                                                  batch))):
        launches, per_layer = eager_step_launches(llm, batch_prompts, adapters)
        top = ", ".join(f"{name} x{n}" for name, n in launches.by_name.most_common(6))
        check.report.row(f"launches per eager decode step, batch {batch}, {label}",
                         f"{launches.total}: {launches.aten} aten, {launches.triton} triton; per layer "
                         f"{min(per_layer)}-{max(per_layer)} ({len(per_layer)} layers), outside the layers "
                         f"{launches.total - sum(per_layer)}; top: {top}", "fewer as kernels fuse (no bound yet)")


def eager_step_launches(llm, batch_prompts, adapters) -> tuple:
    """The `LaunchCounter` of one decode step of `batch_prompts` run eagerly (graphs off for that step), and the
    launches of each decoder layer in it."""
    from loraplex.kernels.launch_count import LaunchCounter, per_module
    from loraplex.platform import SamplingParams

    engine = llm.engine
    decoding(engine, batch_prompts, adapters, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    worker = engine.core.executor.worker
    graphs, worker.runner.graphs = worker.runner.graphs, None
    try:
        sync(engine.device)
        with LaunchCounter(engine.device) as launches, per_module(launches, list(worker.model.layers)) as per_layer:
            engine.step()
        sync(engine.device)
    finally:
        worker.runner.graphs = graphs
    while engine.has_unfinished():
        engine.step()
    return launches, per_layer


def section_profile(check: Check) -> None:
    """Where a decode step's time goes at the widest adapter batch, base and with the most distinct adapters:
    wall time against the device's busy time, which graphs replayed, the costliest kernels (the whole table
    beside gpu_check.md); and the same requests' step unprofiled (just before) against that busy time."""
    llm, plan = built_engine(check), check.plan
    batch = max(plan.adapter_batches)
    batch_prompts = prompts(batch, plan.prompt_len, check.found["vocab"], 8)
    for label, adapters in (("base", None), (f"{plan.adapters} adapters", cycled(adapter_names(check), plan.adapters,
                                                                                  batch))):
        unprofiled, wall, busy, replays, top = profiled_decode(
            llm, batch_prompts, adapters, 4, check.report.path.with_name(f"profile_{label.split()[-1]}.txt"))
        check.report.row(f"decode step profile, batch {batch}, {label}",
                         f"{wall:.1f} ms per step (profiled), device busy {busy:.1f} ms; graph replays {replays}; "
                         f"top kernels: {top}")
        rate = f"{unprofiled:.2f} ms per step ({batch * 1000 / unprofiled:.0f} tok/s)"
        check.report.row(f"unprofiled decode step vs device busy, batch {batch}, {label}",
                         f"{rate} vs busy {busy:.2f} ms = {unprofiled / busy:.2f}x" if busy else
                         f"{rate}; no device time measured (CPU)", "<= 1.1x")


def profiled_decode(llm, batch_prompts, adapters, steps: int, path: Path) -> tuple[float, float, float, dict, str]:
    """Decode steps of `batch_prompts` once each has its first token: the ms per step of 2 x `steps` unprofiled,
    then of `steps` under the profiler, the device's busy ms per step there, graph replays, the costliest kernels
    (the profiler's table written to `path`)."""
    from torch.profiler import ProfilerActivity, profile

    from loraplex.platform import SamplingParams

    engine = llm.engine
    decoding(engine, batch_prompts, adapters, SamplingParams(temperature=0, max_tokens=3 * steps + 4, ignore_eos=True))
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(2 * steps):
        engine.step()
    sync(engine.device)
    unprofiled = (time.perf_counter() - start) * 1000 / (2 * steps)
    graphs = engine.core.executor.worker.runner.graphs
    before = dict(graphs.num_replays) if graphs is not None else {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    sync(engine.device)
    with profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = (time.perf_counter() - start) * 1000 / steps
    replays = {f"{k[0]}/{k[1]}": n - before.get(k, 0) for k, n in (graphs.num_replays.items() if graphs else ())
               if n - before.get(k, 0)}
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

    kernels = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)
    busy = sum(device_us(e) for e in kernels) / 1000 / steps
    top = "; ".join(f"{e.key[:48]} {device_us(e) / 1000 / steps:.2f} ms x{e.count // steps}" for e in kernels[:5])
    path.write_text(events.table(sort_by="self_cuda_time_total" if engine.device.type == "cuda" else
                                 "self_cpu_time_total", row_limit=30))
    # the host side by Python stack: where a step's time goes that the device does not hide
    path.with_name(path.stem + "_stacks.txt").write_text(
        prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=40))
    return unprofiled, wall, busy, replays, top


def section_kv_memory(check: Check) -> None:
    from loraplex.platform.worker.model_runner import kv_bytes_per_block

    engine_ = built_engine(check).engine
    blocks = engine_.core.kv.pool.num_blocks
    kv = blocks * kv_bytes_per_block(engine_.model_config, engine_.config.block_size, engine_.config.torch_kv_dtype)
    if not check.cuda:
        check.report.row("KV blocks", f"{blocks} blocks = {kv / 2**30:.2f} GiB (CPU: from kv_cache_memory)")
        return
    free, total = torch.cuda.mem_get_info(check.device)
    peak = torch.cuda.max_memory_reserved(check.device)
    utilization = engine_.config.gpu_memory_utilization
    check.report.row("KV blocks sized vs free memory",
                     f"{blocks} blocks = {kv / 2**30:.1f} GiB; in use after the runs {(total - free) / 2**30:.1f} of "
                     f"{total / 2**30:.1f} GiB = {(total - free) / total:.0%} (torch peak reserved "
                     f"{peak / 2**30:.1f} GiB)", f"<= gpu_memory_utilization {utilization:.0%}")


def section_audit(check: Check) -> None:
    from loraplex.grammar.backend import StructuredOutputs
    from loraplex.platform import SamplingParams
    from loraplex.platform.device import DeviceAudit

    engine_ = built_engine(check).engine
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    cases = [SamplingParams(temperature=0, max_tokens=8, logprobs=2),
             SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1, n=2, max_tokens=8, repetition_penalty=1.1)]
    grammar = grammar_backend_installed()  # the bare GPU machine has none: the audit then runs without one
    if grammar:
        cases.append(SamplingParams(temperature=0, max_tokens=24, structured=StructuredOutputs(json=schema)))
    adapter = check.found.get("adapter")  # one the adapters section loaded, if it ran
    # first plain requests alone (greedy and seeded: their steps run ahead under --async-scheduling), then the mix
    plain = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.8, seed=2, max_tokens=8)]
    audit = DeviceAudit(engine_.device)
    for phase, batch in enumerate((plain, cases)):
        for i, params in enumerate(batch):
            engine_.add_request(f"audit-{phase}-{i}", {"prompt_token_ids": prompts(1, 16, check.found["vocab"], i)[0]},
                                params, adapter if i == 1 else None)
        with audit:
            for _ in range(200):
                if not engine_.has_unfinished():
                    break
                engine_.step()
    what = "sampling, logprobs, forks, grammar, adapter, steps ahead" if grammar else \
        "sampling, logprobs, forks, adapter, steps ahead; no grammar backend installed"
    check.report.row(f"device audit over a mixed workload ({what})",
                     f"{len(audit.found)} host tensors fed to device ops" +
                     (f": {'; '.join(sorted(set(audit.found))[:3])}" if audit.found else ""), "0")


def grammar_backend_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("llguidance", "xgrammar"))


# (name, seconds it needs at least on the real check: skipped when fewer are left in the budget)
SECTIONS = [(section_environment, 0), (section_bandwidth, 5), (section_kernels, 40), (section_parity, 60),
            (section_large_model, 90), (section_decode, 60), (section_graphs, 20), (section_adapters, 45),
            (section_launches, 10), (section_profile, 25), (section_speculative, 15), (section_async, 25),
            (section_deterministic, 20), (section_tensor_parallel, 40), (section_kv_memory, 0), (section_audit, 10)]


def run_sections(check: Check, sections=SECTIONS) -> None:
    errors = check.report.path.with_name("gpu_check_errors.txt")
    for section, needs in sections:
        name = section.__name__.removeprefix("section_")
        left = check.plan.budget_s - check.elapsed()
        if left < (needs if check.cuda else 0):
            check.report.row(name, f"SKIPPED: {left:.0f} s left of the {check.plan.budget_s:.0f} s budget, "
                                   f"needs ~{needs} s")
            continue
        began = time.perf_counter()
        try:
            section(check)
            print(f"  [{name}: {time.perf_counter() - began:.1f} s]", flush=True)
        except Exception as exc:  # one failing section must not hide the others' numbers
            check.report.row(name, f"FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            with errors.open("a") as f:
                f.write(f"== {name}\n{traceback.format_exc()}\n")
        release()  # what the section dropped (a failed one's frames included) before the next one measures
    check.found.pop("llm", None)
    release()


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.md (and errors, if any)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with the default model's tokenizer files (dry run: the default model's)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the plumbing, in seconds")
    parser.add_argument("--work", type=Path, default=None, help="where checkpoints go (default: a temp folder)")
    parser.add_argument("--budget", type=float, default=None, help="seconds before remaining sections are skipped")
    return parser.parse_args(argv)


def main(argv=None, sections=SECTIONS) -> int:
    args = parse(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): run with --dry-run for the CPU plumbing")
        return 1
    tokenizer = args.tokenizer or default_tokenizer()
    plan = DRY_RUN if args.dry_run else Plan()
    if args.budget is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "gpu_check.md", f"GPU check ({'dry run, CPU' if args.dry_run else device})")
    with tempfile.TemporaryDirectory(prefix="loraplex-gpu-check-", dir=args.work) as work:
        check = Check(plan, device, report, Path(work), tokenizer)
        check.found["vocab"] = min(tokenizer_vocab(tokenizer), SHAPES[plan.small]["vocab_size"])
        run_sections(check, sections)
    report.row("total time", f"{check.elapsed():.0f} s", f"< {plan.budget_s:.0f} s")
    return 0


def default_tokenizer() -> Path:
    from loraplex.platform.model_store import materialize_default_model

    return Path(materialize_default_model())


def tokenizer_vocab(folder: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(folder))


if __name__ == "__main__":
    sys.exit(main())
