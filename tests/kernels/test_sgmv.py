"""SGMV Triton kernels against their PyTorch reference (Triton's interpreter on CPU)."""

import pytest
import torch

from lora_case import lora_case

from loraplex.kernels import dispatch
from loraplex.kernels.sgmv import LoRABatch, sgmv_expand, sgmv_shrink

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=8e-2, rtol=5e-2)}


case = lora_case


def run(backend, slots, ranks, x, a, b, scales, offsets, y0):
    with dispatch.forced_backend(backend):
        batch = LoRABatch.build(slots, DEVICE)
        n = len(offsets) - 1
        h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=DEVICE)
        sgmv_shrink(x.to(DEVICE), a.to(DEVICE), ranks, batch, h, num_slices=n)
        y = y0.clone().to(DEVICE)
        sgmv_expand(h, b.to(DEVICE), ranks, scales, batch, y, offsets)
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


def test_forced_backend_restores_the_previous_choice():
    dispatch.set_backend("torch")
    try:
        with dispatch.forced_backend("triton"):
            assert dispatch._backend == "triton"
        assert dispatch._backend == "torch"
    finally:
        dispatch.set_backend("auto")


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
