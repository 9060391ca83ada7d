"""SGMV Triton kernels against their PyTorch reference (Triton's interpreter on CPU)."""

import pytest
import torch

from conftest import forced_kernels
from kernel_case import configured
from lora_case import lora_case

from loraplex.kernels import dispatch
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.sgmv import sgmv_expand, sgmv_shrink
from compile_case import RecordGrid

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=8e-2, rtol=5e-2)}


case = lora_case


def run(backend, slots, ranks, x, a, b, scales, offsets, y0):
    """(h, y) of the stacked shrink and expand under `backend` (a `LORAPLEX_KERNELS` setting)."""
    config = configured(backend, DEVICE, x.dtype)
    batch = LoRABatch.build(slots, DEVICE)
    n = len(offsets) - 1
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=DEVICE)
    sgmv_shrink(config, x.to(DEVICE), a.to(DEVICE), ranks, batch, h, num_slices=n)
    y = y0.clone().to(DEVICE)
    sgmv_expand(config, h, b.to(DEVICE), ranks, scales, batch, y, offsets)
    return h.cpu(), y.cpu()


CASES = [
    # seed, tokens, slots, max_rank, in, slice widths, dtype
    (0, 1, 1, 8, 64, [64], torch.float32),  # one token
    (1, 37, 4, 16, 96, [96], torch.float32),  # T not a multiple of the tile, in not a power of 2
    (2, 50, 64, 64, 64, [64, 32, 32], torch.float16),  # up to 64 slots, most segments empty; GQA-like qkv
    (3, 40, 8, 64, 64, [128, 128], torch.bfloat16),  # gate/up, ranks 1..64
    (4, 24, 3, 1, 32, [48], torch.float32),  # rank 1
]


@pytest.mark.parametrize("seed,tokens,slots,max_rank,in_features,widths,dtype", CASES)
def test_shrink_expand_match_reference(seed, tokens, slots, max_rank, in_features, widths, dtype):
    s, ranks, x, a, b, scales, offsets = case(seed, tokens, slots, max_rank, in_features, widths, dtype)
    y0 = torch.randn(tokens, sum(widths)).to(dtype)
    h_ref, y_ref = run("torch", s, ranks, x, a, b, scales, offsets, y0)
    h_tri, y_tri = run("triton", s, ranks, x, a, b, scales, offsets, y0)
    torch.testing.assert_close(h_tri, h_ref, **TOL[torch.float32 if dtype == torch.float32 else torch.float16])
    torch.testing.assert_close(y_tri.float(), y_ref.float(), **TOL[dtype])
    untouched = torch.tensor(s) < 0
    assert torch.equal(y_tri[untouched], y0[untouched])  # slot -1 rows untouched
    assert torch.equal(h_tri[untouched], torch.zeros_like(h_tri[untouched]))


def test_columns_beyond_a_slots_rank_are_not_written():
    s, ranks, x, a, b, scales, offsets = case(7, 20, 2, 32, 64, [64, 64], torch.float32, none_frac=0.0,
                                              rank_choices=[4, 32])
    h, _ = run("triton", s, ranks, x, a, b, scales, offsets, torch.zeros(20, 128))
    for t, slot in enumerate(s):
        r = ranks[slot]
        for i in range(2):
            assert torch.all(h[t, i * 32 + r:(i + 1) * 32] == 0)


def test_reference_matches_a_dense_formula():
    s, ranks, x, a, b, scales, offsets = case(5, 30, 5, 16, 48, [40, 24], torch.float32)
    y0 = torch.randn(30, 64)
    _, y = run("torch", s, ranks, x, a, b, scales, offsets, y0)
    expected = y0.clone()
    for t, slot in enumerate(s):
        if slot < 0:
            continue
        r = ranks[slot]
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            A = a[slot, i * 16:i * 16 + r]
            expected[t, lo:hi] += scales[slot] * (x[t] @ A.T) @ b[slot, lo:hi, :r].T
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_empty_batch_and_empty_segments():
    s, ranks, x, a, b, scales, offsets = case(6, 10, 4, 8, 32, [32], torch.float32, none_frac=1.0)
    y0 = torch.randn(10, 32)
    _, y = run("triton", s, ranks, x, a, b, scales, offsets, y0)
    assert torch.equal(y, y0)
    batch = LoRABatch.build([3, -1, 0, 3, 0])
    assert batch.host_slots == [0, 3] and batch.token_order.tolist() == [2, 4, 0, 3]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_randomized_sweep(seed):
    g = torch.Generator().manual_seed(100 + seed)
    pick = lambda xs: xs[int(torch.randint(0, len(xs), (1,), generator=g))]
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    widths = pick([[64], [64, 16, 16], [96, 96], [40]])
    test_shrink_expand_match_reference(seed, pick([1, 17, 64, 130]), pick([1, 8, 64]), pick([1, 8, 16, 64]),
                                       pick([32, 64, 80]), widths, dtype)


@pytest.mark.parametrize("tokens,slots,dtype", [(12, 8, torch.float32), (64, 64, torch.float32),
                                                (80, 2, torch.float32), (40, 5, torch.bfloat16)])
def test_cpu_table_path_matches_the_stacked_reference(tokens, slots, dtype):
    """The PyTorch CPU path reads each adapter in its own rank from a LoRATable."""
    from lora_case import reference, table_from_stacked

    from loraplex.kernels.sgmv import sgmv_lora_table_torch

    s, ranks, x, a, b, scales, offsets = lora_case(11, tokens, slots, 16, 48, [32, 16], dtype)
    y0 = torch.randn(tokens, 48).to(dtype)
    expected = reference(x, a, b, ranks, scales, offsets, s, y0)
    got = sgmv_lora_table_torch(x, table_from_stacked(a, b, ranks, scales, offsets), LoRABatch.build(s), y0.clone())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


def test_table_refuses_weights_that_do_not_fit_it():
    from loraplex.kernels.sgmv import LoRATable

    table = LoRATable.empty(2, [0, 8, 12])
    with pytest.raises(ValueError, match="do not fit"):
        table.set(0, torch.zeros(4, 16), torch.zeros(2, 8), 1.0)  # 2 slices of rank 2 need A [4, in], Bt [2, 12]
    with pytest.raises(ValueError, match="bfloat16"):
        table.set(1, torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(2, 12, dtype=torch.bfloat16), 0.5)
    table.set(1, torch.zeros(4, 16), torch.zeros(2, 12), 0.5)
    assert table.ranks == [0, 2] and table.a_ptrs[1] != 0
    table.clear(1)
    assert table.ranks == [0, 0] and table.a[1] is None and int(table.a_ptrs[1]) == 0


def test_the_kernels_setting_is_read_when_a_config_is_resolved(monkeypatch):
    """LORAPLEX_KERNELS counts where a config is resolved; a config built holds its choice, as enums."""
    cpu = torch.device("cpu")
    with forced_kernels("torch"):
        config = dispatch.kernel_config(cpu, torch.float32, prefill_attention="sdpa")
        with forced_kernels("triton"):
            assert dispatch.resolve_backend(cpu) is dispatch.Backend.TRITON
        assert dispatch.resolve_backend(cpu) is dispatch.Backend.NATIVE
    assert config.backend is dispatch.Backend.NATIVE and config.prefill_attention is dispatch.PrefillAttention.SDPA
    assert dispatch.KernelConfig(backend="triton").backend is dispatch.Backend.TRITON
    monkeypatch.setenv("LORAPLEX_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LORAPLEX_KERNELS must be one of"):
        dispatch.resolve_backend(cpu)


def test_a_named_backend_replaces_the_setting_and_is_checked_when_built(monkeypatch):
    """Tests and benchmarks name the backend a config holds: the setting is not read, and the backend must run
    on the device (Triton on CPU tensors only under the interpreter), checked once, when the config is built."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    assert dispatch.kernel_config(cpu, torch.float32, backend="triton").backend is dispatch.Backend.TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.kernel_config(cpu, torch.float32, backend=dispatch.Backend.TRITON)
    with pytest.raises(RuntimeError, match="C kernels"):
        dispatch.kernel_config("meta", torch.float32, backend=dispatch.Backend.CPU)
    with pytest.raises(ValueError, match="not both"):
        dispatch.kernel_config(cpu, torch.float32, found=dispatch.machine(cpu), backend=dispatch.Backend.NATIVE)


def test_contiguous_segments_add_in_place_and_match_the_reference():
    """Prefill chunks: each adapter's rows are one contiguous range, read and written in place."""
    from lora_case import reference, table_from_stacked

    from loraplex.kernels.sgmv import sgmv_lora_table_torch

    s, ranks, x, a, b, scales, offsets = case(12, 80, 3, 16, 48, [32, 16], torch.float32)
    s = [0] * 30 + [1] * 20 + [-1] * 5 + [2] * 24 + [0]  # slot 0 also owns the last row: not contiguous
    batch = LoRABatch.build(s)
    assert batch.host_ranges == [None, (30, 50), (55, 79)]
    y0 = torch.randn(80, 48)
    got = sgmv_lora_table_torch(x, table_from_stacked(a, b, ranks, scales, offsets), batch, y0.clone())
    torch.testing.assert_close(got, reference(x, a, b, ranks, scales, offsets, s, y0), atol=1e-5, rtol=1e-5)


def test_shrink_plan_splits_k_for_small_batches_only():
    """Batch 1 through a qkv projection of 4096 inputs at rank 16: 3 programs without split-K; with it each
    slice's K is shared out; prefill-sized batches and 16-bit outputs (no fp32 atomics) are not split."""
    from loraplex.kernels.sgmv_triton import shrink_plan

    one = shrink_plan(1, 1, 3, 16, 4096, torch.float32)
    assert one.split_k > 1 and one.grid == (1, 1, 3 * one.split_k) and one.k_share * one.split_k >= 4096
    assert one.k_share * (one.split_k - 1) < 4096  # no empty share
    assert shrink_plan(1, 1, 3, 16, 4096, torch.float32, num_sms=3).split_k == 1
    assert shrink_plan(64, 32, 3, 16, 4096, torch.float32).split_k == 1
    assert shrink_plan(1, 1, 3, 16, 4096, torch.bfloat16).split_k == 1
    assert shrink_plan(1, 1, 1, 16, 200, torch.float32).split_k == 1  # too few features to share


@pytest.mark.parametrize("tokens,dtype", [(1, torch.float32), (1, torch.bfloat16), (5, torch.float16)])
def test_split_k_shrink_matches_reference(monkeypatch, tokens, dtype):
    """Small batches through wide inputs (1,000 features, qkv slices, mixed ranks): the shares' atomic sums
    equal the reference, and the launch was split."""
    from loraplex.kernels import sgmv_triton

    grids = []
    monkeypatch.setattr(sgmv_triton, "_shrink_kernel", RecordGrid(sgmv_triton._shrink_kernel, grids))
    s, ranks, x, a, b, scales, offsets = case(20 + tokens, tokens, 3, 16, 1000, [64, 32, 32], dtype, none_frac=0.0)
    y0 = torch.randn(tokens, 128).to(dtype)
    h_ref, y_ref = run("torch", s, ranks, x, a, b, scales, offsets, y0)
    h_tri, y_tri = run("triton", s, ranks, x, a, b, scales, offsets, y0)
    assert grids and grids[0][2] > 3 * 1  # slices x rank blocks x shares: more than one share
    torch.testing.assert_close(h_tri, h_ref, **TOL[torch.float32 if dtype == torch.float32 else torch.float16])
    torch.testing.assert_close(y_tri.float(), y_ref.float(), **TOL[dtype])


def test_split_k_under_the_graph_layout(monkeypatch):
    """The decode graphs' per-token batch (every token its own segment, the null slot for base tokens) on
    stacked slots: batch 1 and 3 split K (grids recorded: 2 slices x more than one share) and match the
    grouped reference."""
    from lora_case import reference

    from loraplex.kernels import sgmv_triton
    from loraplex.kernels.sgmv import StackedLoRA, sgmv_lora_stacked_triton

    grids = []
    monkeypatch.setattr(sgmv_triton, "_shrink_kernel", RecordGrid(sgmv_triton._shrink_kernel, grids))

    s, ranks, x, a, b, scales, offsets = case(30, 3, 2, 8, 768, [48, 16], torch.float32, none_frac=0.0)
    s = [1, -1, 0]
    table = StackedLoRA.empty(2, offsets, 768, 8, torch.float32, DEVICE)
    for slot in range(2):
        r = ranks[slot]
        table.set(slot, a[slot].view(2, 8, -1)[:, :r].reshape(2 * r, -1), b[slot, :, :r].T, scales[slot])
    y0 = torch.randn(3, 64)
    for n in (1, 3):
        slots = torch.tensor([2 if t < 0 else t for t in s[:n]], dtype=torch.int32)  # 2: the null slot
        batch = LoRABatch.per_token(torch.arange(n), torch.arange(n + 1, dtype=torch.int32), slots)
        got = sgmv_lora_stacked_triton(x[:n], table, batch, y0[:n].clone())
        torch.testing.assert_close(got, reference(x[:n], a, b, ranks, scales, offsets, s[:n], y0[:n]),
                                   atol=1e-4, rtol=1e-4)
    assert [g[:2] for g in grids] == [(1, 1), (3, 1)] and all(g[2] > 2 for g in grids)


def test_graph_batch_grouped_by_slot_on_device():
    """The decode graphs' slots grouped on the device without a host read (as under a capture): one segment
    per slot with its tokens in order, and the kernels on it (split-K at this size) match the reference."""
    from lora_case import reference

    from loraplex.kernels.sgmv import StackedLoRA, sgmv_lora_stacked_triton
    from loraplex.platform.device import NoHostSync

    s, ranks, x, a, b, scales, offsets = case(31, 6, 3, 8, 512, [48, 16], torch.float32, none_frac=0.0)
    s = [2, -1, 0, 2, -1, 2]
    table = StackedLoRA.empty(3, offsets, 512, 8, torch.float32, DEVICE)
    for slot in range(3):
        r = ranks[slot]
        table.set(slot, a[slot].view(2, 8, -1)[:, :r].reshape(2 * r, -1), b[slot, :, :r].T, scales[slot])
    slots = torch.tensor([3 if t < 0 else t for t in s], dtype=torch.int32)  # 3: the null slot
    y0 = torch.randn(6, 64)
    with NoHostSync():
        batch = LoRABatch.grouped(slots.to(DEVICE), 3)
    assert batch.token_order.tolist() == [2, 0, 3, 5, 1, 4] and batch.seg_starts.tolist() == [0, 1, 1, 4, 6]
    assert batch.seg_slots.tolist() == [0, 1, 2, 3] and batch.num_segments == 4 and batch.max_seg_len == 6
    got = sgmv_lora_stacked_triton(x.to(DEVICE), table, batch, y0.clone().to(DEVICE)).cpu()
    torch.testing.assert_close(got, reference(x, a, b, ranks, scales, offsets, s, y0), atol=1e-4, rtol=1e-4)


def test_split_k_shrink_compiles_for_the_gpu():
    """The split-K shrink (fp32 atomics) builds to a cubin for sm_90, beside the interpreter runs above."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from compile_case import compile_for_sm90

    constants = dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, FP32_DOT=False, PRECISION="tf32", SPLIT_K=True)
    pointers = {"out_ptr": "*fp32", "ranks_ptr": "*i32", "order_ptr": "*i64", "starts_ptr": "*i32",
                "slots_ptr": "*i32", "a_ptr": "*bf16", "x_ptr": "*bf16"}
    assert compile_for_sm90("loraplex.kernels.sgmv_triton", "_shrink_kernel", constants, pointers)[-1] == "cubin"
