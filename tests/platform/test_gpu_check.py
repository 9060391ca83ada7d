"""The GPU check's plumbing on CPU (benchmarks/gpu_check.py --dry-run: checkpoints written by transformers,
the table file, a failing section recorded while the rest run, the time budget) and the kernel benchmark's
timing helpers (benchmarks/gpu_kernels.py: events around the call only, L2 flushed between calls, SDPA
without a boolean mask)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tokenizer

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check
        import gpu_kernels

        yield gpu_check, gpu_kernels
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpu-tokenizer")
    make_tokenizer(folder)
    return folder


def table(out: Path) -> str:
    return (out / "gpu_check.md").read_text()


def test_dry_run_writes_the_table_and_records_a_failing_section(bench, tokenizer_dir, tmp_path):
    gpu_check, _ = bench

    def section_boom(check):
        raise RuntimeError("made to fail")

    sections = [(gpu_check.section_environment, 0), (section_boom, 0), (gpu_check.section_bandwidth, 0),
                (gpu_check.section_large_model, 0), (gpu_check.section_decode, 0), (gpu_check.section_adapters, 0),
                (gpu_check.section_launches, 0), (gpu_check.section_profile, 0), (gpu_check.section_async, 0),
                (gpu_check.section_kv_memory, 0)]
    out = tmp_path / "out"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--tokenizer", str(tokenizer_dir)], sections) == 0
    text = table(out)
    assert text.startswith("# GPU check (dry run, CPU)") and "| check | result | target |" in text
    assert "| boom | FAILED: RuntimeError: made to fail |" in text
    assert "made to fail" in (out / "gpu_check_errors.txt").read_text()
    # the sections after the failure ran: a checkpoint written by transformers, loaded by the engine, timed
    assert "| tiny bf16 checkpoint and 4 adapters written; transformers measured | batches [1, 4] |" in text
    assert "| decode tok/s, tiny float32, batch 4 | " in text and "HBM floor" in text
    assert "| base decode, batch 4, share of the HBM floor (tiny float32) | " in text and "| >= 60% |" in text
    # adapters vs base at each batch and count (the targets at the widest batch), launches, unprofiled vs busy
    assert "| 2 distinct rank-16 adapters vs base, batch 2 | " in text
    assert "| 4 (2 distinct in the batch) rank-16 adapters vs base, batch 2 | " in text
    assert "| 4 distinct rank-16 adapters vs base, batch 4 | " in text and "| >= 0.8x |" in text
    assert "| launches per eager decode step, batch 4, 4 adapters | " in text and "aten" in text
    assert "| unprofiled decode step vs device busy, batch 4, base | " in text and "| <= 1.1x |" in text
    assert "| async scheduling vs steps in order, batch 4, 4 adapters | " in text
    assert "KV blocks" in text and "total time" in text


def test_dry_run_tensor_parallel_section_compares_tp2_with_tp1(bench, tokenizer_dir, tmp_path):
    """The section the first 2-GPU session runs, over gloo on the CPU: both engines built from the small
    checkpoint the parity section writes, the tokens compared, the rates recorded."""
    gpu_check, _ = bench
    out = tmp_path / "out"
    sections = [(gpu_check.section_parity, 0), (gpu_check.section_tensor_parallel, 0)]
    assert gpu_check.main(["--dry-run", "--out", str(out), "--tokenizer", str(tokenizer_dir)], sections) == 0
    text = table(out)
    assert "| tensor parallel: TP=2 vs TP=1 greedy, 16 prompts, 2 adapters (tiny) | 16/16 equal |" in text
    assert "| tensor parallel: decode tok/s at batch 16, TP=1 / TP=2 |" in text


def test_the_budget_skips_what_is_left(bench, tokenizer_dir, tmp_path):
    gpu_check, _ = bench
    out = tmp_path / "out"
    gpu_check.main(["--dry-run", "--out", str(out), "--tokenizer", str(tokenizer_dir), "--budget", "0"],
                   [(gpu_check.section_bandwidth, 0)])
    assert "| bandwidth | SKIPPED:" in table(out)


def test_floors_count_the_real_shapes(bench):
    """Llama-3.1-8B has 8,030,261,248 parameters, 525,336,576 of them the embedding table a step does not read;
    Llama-3.2-1B 1,235,814,400 with the head tied to the embedding (read once, as the head)."""
    gpu_check, _ = bench
    assert gpu_check.weight_bytes("Llama-3.1-8B") == 2 * (8_030_261_248 - 525_336_576)
    assert gpu_check.weight_bytes("Llama-3.2-1B") == 2 * 1_235_814_400
    per_token = 2 * 2 * 32 * 8 * 128  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert gpu_check.kv_bytes("Llama-3.1-8B", 4, 100) == 4 * 100 * per_token
    floor = gpu_check.floor_tokens_per_s("Llama-3.1-8B", 1, 0, 4.0e12)
    assert floor == pytest.approx(4.0e12 / gpu_check.weight_bytes("Llama-3.1-8B"))


class FakeClock:
    """Stands in for CUDA events: the flush takes 100 ms of device time, the timed call 1 ms."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now
                clock.log.append("record")

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()

    def call(self):
        self.now += 1.0
        self.log.append("call")

    def zero_(self):
        self.now += 100.0
        self.log.append("flush")


def test_cuda_time_times_the_call_alone_with_l2_flushed_between(bench, monkeypatch):
    _, gpu_kernels = bench
    clock = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: clock.log.append("sync"))
    seconds = gpu_kernels.cuda_time(clock.call, iters=4, warmup=2, flush=clock)
    assert seconds == pytest.approx(1e-3)  # the flush's 100 ms lies outside every pair of events
    assert clock.log == ["call"] * 2 + ["sync"] + ["flush", "record", "call", "record"] * 4 + ["sync"]


@pytest.mark.parametrize("q_len,ctx,causal", [(1, 40, False), (24, 0, True)])
def test_sdpa_baseline_takes_no_boolean_mask(bench, monkeypatch, q_len, ctx, causal):
    """Decode: no mask (every key visible); a fresh prompt: is_causal. A boolean mask would rule out flash.
    The contiguous K/V are built before the timed call."""
    _, gpu_kernels = bench
    q, kc, vc, _, tables = gpu_kernels.attention_case(2, q_len, ctx, gpu_kernels.HEADS, gpu_kernels.KV_HEADS,
                                                      gpu_kernels.HEAD_DIM, 16, torch.float32, "cpu")
    call = gpu_kernels.sdpa_call(2, q_len, ctx, q, kc, vc, tables)
    seen = []
    monkeypatch.setattr(gpu_kernels.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((k.is_contiguous(), kw)))
    call()
    (contiguous, kwargs), = seen
    assert contiguous and "attn_mask" not in kwargs and kwargs["is_causal"] is causal


def test_prefill_bench_builds_each_choice_once(bench):
    """The two prefill layers the benchmark times are the engine's own, one per setting."""
    from loraplex.kernels.custom_ops import PagedAttention
    from loraplex.kernels.dispatch import KernelConfig

    triton = KernelConfig(backend="triton", device_type="cuda")
    assert PagedAttention(0.1, triton, prefill="sdpa").forward.__name__ == "forward_cuda"
    assert "forward" not in vars(PagedAttention(0.1, triton, prefill="triton"))


def test_table_cells_stay_one_cell(bench, tmp_path):
    gpu_check, _ = bench
    report = gpu_check.Report(tmp_path / "t.md", "t")
    report.row("max |diff|", "a\nb")
    assert report.path.read_text().splitlines()[-1] == "| max \\|diff\\| | a b |  |"
