"""`LaunchCounter` (kernels/launch_count.py): a known op sequence counts exactly, views and allocations count 0, a
Triton launch counts 1; and one eager decode step of a tiny Llama on the Triton backend (the interpreter here)
stays under a bound per decoder layer, without adapters and with adapters on stacked slots."""

from __future__ import annotations

import pytest
import torch

from conftest import forced_kernels
from loraplex.kernels.launch_count import LaunchCounter, per_module

triton = pytest.importorskip("triton")
tl = triton.language

# one eager decode step on the Triton backend, per decoder layer: its 4 projections (1 each), the fused
# add + RMSNorm twice, RoPE + KV write, paged attention, SiLU-and-mul (1 each). A CPU whose weight format is our C
# kernel (AMX, plain float32 rows) runs its projections through ctypes, where no ATen op is seen: fewer.
BASE_PER_LAYER = 9
# with adapters in the step (on stacked slots, SGMV): a Triton shrink and expand per projection, 4 projections
LORA_PER_LAYER = 8
# outside the decoder layers: embedding, RoPE's cos / sin rows, the final add + norm, the head, the sampled
# rows, the block table's rows, the sampler's argmax
FIXED = 8


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)


def test_a_known_op_sequence_counts_exactly_and_views_count_nothing():
    x, y = torch.randn(4, 8), torch.randn(8, 4)
    with LaunchCounter(device="cpu") as launches:
        z = x @ y
        z = z + 1
        z.relu_()
        z.view(16), z.t(), z.transpose(0, 1), z.permute(1, 0), z[0], z[:, 1:], z.unsqueeze(0), z.expand(2, 4, 4)
        z.reshape(2, 8), z.split(2), z.chunk(2), z.detach(), z.squeeze(), z.narrow(0, 0, 2)
        torch.empty(3), torch.empty_like(z), z.size(), z.stride(), z.is_contiguous()
        torch.tensor([1, 2, 3])  # a host value made: no op on the device
    assert launches.by_name == {"aten.mm": 1, "aten.add": 1, "aten.relu_": 1}
    assert (launches.total, launches.aten, launches.triton) == (3, 3, 0)
    assert launches.summary().startswith("3 launches: 3 aten, 0 triton; top: aten.mm x1")


def test_composite_ops_count_as_the_kernels_they_run():
    """Under inference_mode the mode sees composite ops whole (`linear`, `reshape`, `to`): each counts as the ops
    its decomposition runs where the backend has no kernel of its own for it."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.inference_mode(), LaunchCounter(device="cpu") as launches:
        torch.nn.functional.linear(x, w)  # t (a view) + mm
        x.reshape(32), x.t().reshape(32)  # a view; a copy
        x.to(torch.float32), x.to(torch.float64)  # itself; a copy
    assert launches.by_name == {"aten.mm": 1, "aten.clone": 1, "aten._to_copy": 1}


def test_only_ops_on_the_counted_device_count():
    host, meta = torch.ones(4), torch.ones(4, device="meta")
    with LaunchCounter(device="meta") as launches:
        host * 2
        meta * 2
        host.to("meta")  # a copy onto the device
    assert launches.by_name == {"aten.mul": 1, "aten._to_copy": 1}


def test_a_triton_launch_counts_one_and_its_own_host_copies_none():
    x = torch.zeros(5)
    with LaunchCounter(device="cpu") as outer:
        with LaunchCounter(device="cpu") as inner:
            _add_one[(1,)](x, 5, BLOCK=8)
        x.add_(1)
    assert inner.by_name == {"triton:_add_one": 1}
    assert outer.by_name == {"triton:_add_one": 1, "aten.add_": 1}  # counters nest
    assert torch.equal(x, torch.full((5,), 2.0))
    with LaunchCounter(device="cpu") as after:  # the launches' wrapper came off and on again
        _add_one[(1,)](x, 5, BLOCK=8)
    assert after.triton == 1 and "counted" not in type(_add_one).run.__name__


@pytest.fixture(scope="module")
def triton_llm(tiny_model_dir, tiny_adapters):
    from loraplex.platform import LLM

    with forced_kernels("triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=2,
                  lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])})
    assert llm.engine.adapters.slots.stacked
    return llm


def decode_step_launches(llm, adapters: list) -> tuple[LaunchCounter, list[int]]:
    """One eager decode step of len(adapters) requests, each past its prompt: its launches and those of each
    decoder layer."""
    from loraplex.platform import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, adapter in enumerate(adapters):
        engine.add_request(f"{adapters}-{i}", {"prompt_token_ids": list(range(3, 9 + i))}, params, adapter)
    started: set[str] = set()
    while len(started) < len(adapters):
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    layers = list(engine.core.executor.worker.model.layers)
    with LaunchCounter(device="cpu") as launches, per_module(launches, layers) as per_layer:
        outs = engine.step()
    assert len(outs) == len(adapters)  # one step, every request decoding
    while engine.has_unfinished():
        engine.step()
    return launches, per_layer


def test_decode_step_launches_stay_under_the_bound_per_layer(triton_llm):
    base, base_layers = decode_step_launches(triton_llm, [None, None, None])
    mixed, mixed_layers = decode_step_launches(triton_llm, ["a0", "a1", None])
    num_layers = len(base_layers)
    assert num_layers == 2
    assert max(base_layers) <= BASE_PER_LAYER and base.total - sum(base_layers) <= FIXED
    assert base.total <= BASE_PER_LAYER * num_layers + FIXED
    assert max(mixed_layers) <= BASE_PER_LAYER + LORA_PER_LAYER and mixed.total - sum(mixed_layers) <= FIXED
    assert mixed.total <= (BASE_PER_LAYER + LORA_PER_LAYER) * num_layers + FIXED
    # the adapters ran through the Triton SGMV kernels in every layer, the base step through none
    assert base.triton >= 2 * num_layers and mixed.triton >= base.triton + 2 * num_layers
