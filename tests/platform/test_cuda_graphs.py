"""Decode graphs on CPU: `FakeCapture` records the forward pass refusing host syncs (as a CUDA
capture does) and replays it over the persistent buffers; with the Triton kernels (the
interpreter here) that is the CUDA step. Padded batches, adapters and base in one graph,
and eager prefill around it give the eager engine's tokens."""

import pytest
import torch

from conftest import forced_kernels

from loraplex.adapters.lora_layers import LoRAContext
from loraplex.platform import LLM, SamplingParams
from torch.utils._python_dispatch import TorchDispatchMode

from loraplex.platform.core.block_table import BlockTable
from loraplex.platform.worker.cuda_graphs import DecodeGraphs, FakeCapture, GraphMode, capture_sizes, padded_size
from loraplex.platform.worker.model_runner import ModelInput, TableRows
from loraplex.platform.device import HostSyncError, NoHostSync
from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request

pytest.importorskip("triton")


def test_capture_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(2000)[-1] == 512
    sizes = capture_sizes(20)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


def test_fake_capture_refuses_host_syncs():
    x = torch.arange(4.0)
    with pytest.raises(HostSyncError):
        FakeCapture()(lambda: int(x.sum()))
    with pytest.raises(HostSyncError):
        with NoHostSync():
            x[x > 1]  # a boolean mask needs its count on the host
    FakeCapture()(lambda: x.mul_(2))  # device-only work is fine


def _generate(llm, prompts, names):
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=4, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params[i % 2] for i in range(len(prompts))],
                        adapter=names)
    return [o.outputs[0].token_ids for o in outs]


def test_decode_graphs_give_the_eager_tokens(tiny_model_dir, tiny_adapters):
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 9, 14, 7, 11))]
    names = ["a0", None, "a1", "a0", None]
    with forced_kernels("triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8, max_loras=2,
                  lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])})
        eager = {n: _generate(llm, prompts[:n], names[:n]) for n in (1, 3, 5)}
        base_only = _generate(llm, prompts[:2], [None, None])
        capture = FakeCapture()
        llm.engine.core.enable_graphs(capture)  # max_num_seqs 8, the adapters' null slot
        runner = llm.engine.core.executor.worker.runner
        assert capture.captured == 3 * len(capture_sizes(8))  # base, LoRA and mixes of two, as the engine captures
        graphed = {n: _generate(llm, prompts[:n], names[:n]) for n in (1, 3, 5)}
        assert _generate(llm, prompts[:2], [None, None]) == base_only
    assert graphed == eager
    replays = runner.graphs.num_replays
    # 3 and 5 requests run padded to 4 and 8; adapter steps and base-only steps take their own graph
    lora, base = GraphMode.LORA, GraphMode.BASE
    assert replays[4, lora] and replays[8, lora] and replays[1, lora] and replays[2, base]
    assert not any(size not in capture_sizes(8) for size, _ in replays)
    # graphs without LoRA (no null slot): steps with adapters run eagerly, never the base graph
    with forced_kernels("triton"):
        runner.enable_graphs(FakeCapture(), 8, llm.engine.max_model_len, None)
        assert _generate(llm, prompts[:3], names[:3]) == eager[3]
        assert _generate(llm, prompts[:2], [None, None]) == base_only
    assert not any(mode == GraphMode.LORA for _, mode in runner.graphs.num_replays) and runner.graphs.num_replays


def test_adapter_mixes_replay_graphs_of_their_own(tiny_model_dir, tiny_adapters):
    """Mixes of up to two adapters (a negative weight, one adapter at 0.5) replay the mix graphs and give
    the eager tokens; a mix of three has no graph (it runs eagerly)."""
    prompts = [{"prompt_token_ids": list(range(3, 8))}, {"prompt_token_ids": list(range(4, 13))}]
    mixes = [[("a0", 0.7), ("a1", -0.3)], [("a0", 0.5)]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with forced_kernels("triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_num_seqs=2, max_loras=2,
                  lora_modules={f"a{i}": str(tiny_adapters[i]) for i in range(2)})
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, adapter=mixes)]
        capture = FakeCapture()
        llm.engine.core.enable_graphs(capture)  # max_num_seqs 2, mixes of up to two adapters
        runner = llm.engine.core.executor.worker.runner
        assert capture.captured == 3 * len(capture_sizes(2))  # base, LoRA, mixes
        graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, adapter=mixes)]
    assert graphed == eager
    assert runner.graphs.num_replays[2, GraphMode.MIX] == 2  # both decode steps
    assert runner.graphs.fits(2, True, 2) and not runner.graphs.fits(2, True, 3)


class _StubModel(torch.nn.Module):
    """What DecodeGraphs reads of a model: the embedding's device and dtype, the hidden size, the call; each
    replay records the block tables it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(32, 4)
        self.config = type("Config", (), {"hidden_size": 4})()
        self.seen = []

    def forward(self, ids, positions, kv_caches, meta):
        self.seen.append((meta.block_tables.clone(), meta.slot_mapping.clone(), meta.seq_lens.clone()))
        return self.embed_tokens(ids)


class _StepOps(TorchDispatchMode):
    """The ops a graph step runs outside its replay: host tensors made, copies into buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func._schema.name, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out


def test_a_graph_step_copies_each_input_once_from_persistent_buffers():
    """One copy for ids / positions / slots / lengths, one gather + copy of the int32 block table rows in use
    (from the engine's BlockTable, not rebuilt from lists), one host tensor (the B row numbers)."""
    kv = KVCacheManager(64, block_size=4)
    requests = [Request(f"r{i}", list(range(3 + 2 * i)), SamplingParams()) for i in range(3)]
    for req in requests:
        assert kv.allocate_slots(req, req.num_tokens) is not None
        req.num_computed_tokens = req.num_tokens - 1
    table = BlockTable(8, 10, 4, torch.device("cpu"), max_width=10)
    model = _StubModel()
    graphs = DecodeGraphs(model, LoRAContext(), [], capture_sizes(8), 10, 4, 40, None, lambda forward: forward)
    rows = table.update(kv.req_blocks, requests)
    lens = [r.num_tokens for r in requests]
    step = ModelInput([1, 2, 3], [n - 1 for n in lens], [5, 6, 7], TableRows(table, rows), lens, [0, 1, 2, 3], 1,
                      [0, 1, 2], [])
    model.seen.clear()
    with _StepOps() as recorded:
        graphs.run(step)
    outside = [op for op in recorded.ops if op[0] != "aten::embedding"]
    made = [op for op in outside if op[0] in ("aten::lift_fresh", "aten::lift_fresh_copy", "aten::_to_copy")]
    assert len(made) <= 1 and made[0][1] == (3,)  # the row numbers
    assert [op for op in outside if op[0] in ("aten::copy_", "aten::index_select")] == [
        ("aten::copy_", (4, 8)), ("aten::index_select", (3, 10)),
        ("aten::copy_", (4, 4))]  # the last: the replay storing its hidden states
    tables, slots, seq_lens = model.seen[-1]
    assert tables.dtype == torch.int32 and graphs.block_tables.dtype == torch.int32
    for req, got in zip(requests, tables):
        ids = kv.block_ids(req)
        assert got[:len(ids)].tolist() == ids
    assert slots.tolist() == [5, 6, 7, -1] and seq_lens.tolist() == [r.num_tokens for r in requests] + [1]
