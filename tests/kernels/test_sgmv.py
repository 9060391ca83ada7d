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


def test_tiles_split_k_by_the_input_width_only():
    """Split-K shares follow the projection's width (never the batch): whole K tiles, none empty, at most
    `max_splits`; a narrow input is one share. A decode step's short segments are one program each, a long
    prefill segment blocks of `tokens_per_program`."""
    from loraplex.kernels.lora_tiles import LoRATiles

    qkv = LoRATiles.plan(4096, [0, 4096, 5120, 6144], 16)
    assert (qkv.split_k, qkv.k_share, qkv.num_slices, qkv.n_blocks) == (8, 512, 3, 32)
    down = LoRATiles.plan(14336, [0, 4096], 16)
    assert down.split_k == 8 and down.k_share % down.block_k == 0 and down.k_share * 7 < 14336 <= down.k_share * 8
    assert LoRATiles.plan(1000, [0, 64], 8).split_k == 1 and LoRATiles.plan(4096, [0, 64], 8, split=False).split_k == 1
    assert qkv.token_blocks(1) == (16, 1) and qkv.token_blocks(64) == (64, 1) and qkv.token_blocks(2048) == (64, 32)


def stacked(ranks, a, b, scales, offsets, in_features, max_rank, **tune):
    """The case's adapters in stacked slots, tiled with `tune`'s sizes (small shares: several at small widths)."""
    import dataclasses

    from loraplex.kernels.lora_tiles import LoRATiles, LoRATune
    from loraplex.kernels.sgmv import StackedLoRA

    n = len(offsets) - 1
    table = StackedLoRA.empty(len(ranks), offsets, in_features, max_rank, a.dtype, DEVICE)
    for slot, r in enumerate(ranks):
        table.set(slot, a[slot].view(n, max_rank, -1)[:, :r].reshape(n * r, -1), b[slot, :, :r].T, scales[slot])
    return dataclasses.replace(table, tiles=LoRATiles.plan(in_features, offsets, max_rank, LoRATune(**tune)))


@pytest.mark.parametrize("tokens,slots,dtype", [(1, 3, torch.float32), (16, 16, torch.bfloat16),
                                                (150, 2, torch.float32)])
def test_stacked_kernels_over_k_shares_match_the_reference(monkeypatch, tokens, slots, dtype):
    """Batch 1, a decode batch with one token per adapter (ranks 8 / 16 / 64, base tokens on no slot), a
    prefill of two long segments: the shrink's K shares summed by the expand equal the reference. Recorded
    grids: every slice and share in one launch, one program per segment while segments are short."""
    from lora_case import reference

    from loraplex.kernels import sgmv_triton
    from loraplex.kernels.sgmv import sgmv_lora_stacked_triton

    grids = {"shrink": [], "expand": []}
    monkeypatch.setattr(sgmv_triton, "_shrink_kernel", RecordGrid(sgmv_triton._shrink_kernel, grids["shrink"]))
    monkeypatch.setattr(sgmv_triton, "_expand_kernel", RecordGrid(sgmv_triton._expand_kernel, grids["expand"]))
    s, ranks, x, a, b, scales, offsets = case(40 + tokens, tokens, slots, 64, 256, [48, 16, 16], dtype,
                                              none_frac=0.1, rank_choices=[8, 16, 64])
    if tokens == 16:
        s = [t if t % 5 else -1 for t in range(16)]  # one token per adapter, every fifth on no adapter
    table = stacked(ranks, a, b, scales, offsets, 256, 64, k_share=64, block_k=32, block_n=32)
    assert table.tiles.split_k == 4
    y0 = torch.randn(tokens, 80).to(dtype)
    got = sgmv_lora_stacked_triton(x.to(DEVICE), table, LoRABatch.build(s, DEVICE), y0.clone().to(DEVICE)).cpu()
    torch.testing.assert_close(got.float(), reference(x, a, b, ranks, scales, offsets, s, y0).float(), **TOL[dtype])
    segments = len({t for t in s if t >= 0})
    blocks = 1 if tokens <= 64 else 2  # two segments of ~75 tokens: two blocks of 64 each
    assert grids["shrink"] == [(segments, blocks, 3 * 1 * 4)] and grids["expand"] == [(segments, blocks, 3 * 2)]


def test_rank_blocks_k_shares_and_segment_loop_together():
    """Ranks past one rank block (8 / 65 / 128 of 128: two blocks), four K shares and two programs along the
    segment axis walking six segments: the reference's numbers. Tiles that are no power of two are refused."""
    from lora_case import reference

    from loraplex.kernels.lora_tiles import LoRATune
    from loraplex.kernels.sgmv import sgmv_lora_stacked_triton

    s, ranks, x, a, b, scales, offsets = case(60, 24, 6, 128, 256, [32], torch.float32, none_frac=0.1,
                                              rank_choices=[8, 65, 128])
    table = stacked(ranks, a, b, scales, offsets, 256, 128, k_share=64, block_k=32, block_n=32, segment_programs=2)
    assert (table.tiles.rank_blocks, table.tiles.split_k, table.tiles.segment_columns(6)) == (2, 4, 2)
    y0 = torch.randn(24, 32)
    got = sgmv_lora_stacked_triton(x, table, LoRABatch.build(s, DEVICE), y0.clone())
    torch.testing.assert_close(got, reference(x, a, b, ranks, scales, offsets, s, y0), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        LoRATune(block_k=96)
    with pytest.raises(ValueError, match="multiple of block_k"):
        LoRATune(k_share=200)


def test_decode_graph_batch_of_64_adapters_and_a_mix(monkeypatch):
    """The decode graphs' layout: 64 tokens on 64 slots (and the null slot), grouped on the device, mixed
    ranks; then a two-adapter mix's weighted passes. Equal to the reference; 64 segments on 32 programs along
    the segment axis (each walking two), one program per segment's tokens."""
    from lora_case import reference

    from loraplex.kernels import sgmv_triton
    from loraplex.kernels.sgmv import sgmv_lora_stacked_triton

    grids = []
    monkeypatch.setattr(sgmv_triton, "_expand_kernel", RecordGrid(sgmv_triton._expand_kernel, grids))
    s, ranks, x, a, b, scales, offsets = case(50, 64, 64, 16, 64, [32, 32], torch.float32, none_frac=0.0,
                                              rank_choices=[8, 16])
    s = [t if t % 9 else -1 for t in range(64)]
    table = stacked(ranks, a, b, scales, offsets, 64, 16, k_share=32, block_k=16, block_n=32)
    slots = torch.tensor([64 if t < 0 else t for t in s], dtype=torch.int32, device=DEVICE)  # 64: the null slot
    y0 = torch.randn(64, 64)
    got = sgmv_lora_stacked_triton(x, table, LoRABatch.grouped(slots, 64), y0.clone())
    torch.testing.assert_close(got, reference(x, a, b, ranks, scales, offsets, s, y0), atol=1e-4, rtol=1e-4)
    assert grids == [(32, 1, 2)]
    # a mix: every token 0.25 of slot 3 and 0.75 of slot 7, as two weighted grouped passes
    first, second = (LoRABatch.grouped(torch.full((4,), slot, dtype=torch.int32), 64) for slot in (3, 7))
    first.order_weights, second.order_weights = torch.full((4,), 0.25), torch.full((4,), 0.75)
    got = sgmv_lora_stacked_triton(x[:4], table, second, sgmv_lora_stacked_triton(x[:4], table, first, y0[:4].clone()))
    want = y0[:4] + 0.25 * (reference(x[:4], a, b, ranks, scales, offsets, [3] * 4, y0[:4]) - y0[:4]) + \
        0.75 * (reference(x[:4], a, b, ranks, scales, offsets, [7] * 4, y0[:4]) - y0[:4])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_graph_batch_grouped_by_slot_on_device():
    """The decode graphs' slots grouped on the device without a host read (as under a capture): the slots
    present in order, their tokens in order, then empty segments up to min(tokens, slots + 1)."""
    from lora_case import reference

    from loraplex.kernels.sgmv import sgmv_lora_stacked_triton
    from loraplex.platform.device import NoHostSync

    s, ranks, x, a, b, scales, offsets = case(31, 6, 5, 8, 512, [48, 16], torch.float32, none_frac=0.0)
    s = [2, -1, 0, 2, -1, 2]
    table = stacked(ranks, a, b, scales, offsets, 512, 8)
    slots = torch.tensor([5 if t < 0 else t for t in s], dtype=torch.int32)  # 5: the null slot
    y0 = torch.randn(6, 64)
    with NoHostSync():
        batch = LoRABatch.grouped(slots.to(DEVICE), 5)
    assert batch.token_order.tolist() == [2, 0, 3, 5, 1, 4] and batch.seg_starts.tolist() == [0, 1, 4, 6, 6, 6, 6]
    assert batch.seg_slots.tolist()[:3] == [0, 2, 5] and batch.num_segments == 6 and batch.max_seg_len == 6
    assert LoRABatch.grouped(torch.tensor([1], dtype=torch.int32), 5).num_segments == 1
    got = sgmv_lora_stacked_triton(x.to(DEVICE), table, batch, y0.clone().to(DEVICE)).cpu()
    torch.testing.assert_close(got, reference(x, a, b, ranks, scales, offsets, s, y0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["_shrink_kernel", "_expand_kernel"])
def test_lora_kernels_compile_for_the_gpu(kernel):
    """Both kernels (token loops, K-share planes) build to a cubin for sm_90, beside the interpreter runs."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from compile_case import compile_for_sm90

    constants = dict(BLOCK_M=16, BLOCK_R=16, FP32_DOT=False, PRECISION="tf32")
    constants.update(BLOCK_K=128) if kernel == "_shrink_kernel" else constants.update(BLOCK_N=128, HAS_WEIGHTS=True)
    pointers = {"part_ptr": "*fp32", "ranks_ptr": "*i32", "order_ptr": "*i64", "starts_ptr": "*i32",
                "slots_ptr": "*i32", "offsets_ptr": "*i32", "scales_ptr": "*fp32", "weights_ptr": "*fp32",
                "a_ptr": "*bf16", "x_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    assert compile_for_sm90("loraplex.kernels.sgmv_triton", kernel, constants, pointers)[-1] == "cubin"
