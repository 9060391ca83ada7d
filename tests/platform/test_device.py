"""The engine's device: the setting and its errors, KV sizing from device memory, the profiling
pass, and the audit that a step creates no tensor without naming its device (the bug that
works on CPU and breaks on CUDA)."""

import pytest
import torch

from conftest import forced_kernels

from loraplex.grammar.backend import StructuredOutputs
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.device import DeviceAudit, DeviceAuditError, DeviceMemory, kv_blocks_for
from loraplex.platform.worker.model_runner import profile_step

GIB = 2 ** 30


def test_device_setting(tiny_model_dir):
    assert EngineConfig(model="m", device="cpu").torch_device == torch.device("cpu")
    assert EngineConfig(model="m").torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:", "cuda:x", "tpu"):
        with pytest.raises(ValueError, match="device must be"):
            EngineConfig(model="m", device=bad)
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model="m", gpu_memory_utilization=bad)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(str(tiny_model_dir), devices="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="make setup-gpu"):
            LLM(str(tiny_model_dir), device="cuda")
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    assert llm.engine.core.executor.worker.runner.kv_cache.device.type == "cpu" and llm.engine.core.executor.worker.runner.graphs is None


def test_kv_blocks_from_device_memory():
    memory = DeviceMemory(total=80 * GIB, free_at_start=79 * GIB, torch_at_start=0, weights=8 * GIB,
                          activations=2 * GIB, non_torch=GIB // 2, graphs=GIB // 2)
    assert memory.kv_budget(0.9) == int(72 * GIB) - 11 * GIB
    assert kv_blocks_for(memory, 0.9, 2 << 20) == (61 * GIB) // (2 << 20)
    assert kv_blocks_for(memory, 0.5, GIB) == 29
    with pytest.raises(ValueError, match="no memory left for the KV cache.*gpu-memory-utilization"):
        kv_blocks_for(memory, 0.1, 2 << 20)


def test_profiling_pass_runs_the_largest_step(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    engine = llm.engine
    # max_num_batched_tokens above max_model_len: several sequences, as the scheduler could build
    profile_step(engine.core.executor.worker.model, engine.model_config, torch.float32, 16, 1200, 512, 64, engine.device)
    profile_step(engine.core.executor.worker.model, engine.model_config, torch.float32, 16, 100, 512, 8, engine.device)


def _workload(engine, adapters):
    """Requests touching every per-step path: sampling filters, seeds, penalties, bias, min
    tokens, logprobs, prompt logprobs, n > 1 (forks, copy-on-write), grammars, adapters, a plain greedy one."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    shared = list(range(5, 40))
    cases = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=3, max_tokens=6,
                       repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2),
        SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=5, logit_bias={7: 3.0, 9: -100.0}, min_tokens=3),
        SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutputs(json=schema)),
        SamplingParams(temperature=0.7, max_tokens=10, min_tokens=2,
                       structured=StructuredOutputs(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=16),  # plain, and last alone: its steps run ahead when they may
    ]
    for i, params in enumerate(cases):
        engine.add_request(f"r{i}", {"prompt_token_ids": shared + [i + 3]}, params, adapters[i % len(adapters)])


@pytest.mark.parametrize("kernels,ahead", [("triton", True), ("auto", False)])
def test_no_step_tensor_without_a_device(tiny_model_dir, tiny_adapters, kernels, ahead):
    """Under the audit tensors made without `device=` land on `meta` and raise. `triton`: the
    CUDA engine's code path (Triton kernels, stacked adapter slots, decode graphs) on CPU, with
    --async-scheduling (steps of plain sequences run ahead, their pending ids gathered on the device; the
    workload's others sample in order, as without it); `auto`: the CPU engine's (C kernels, adapters read in
    place)."""
    from loraplex.platform.worker.cuda_graphs import FakeCapture

    with forced_kernels(kernels):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                  max_loras=2, lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])},
                  async_scheduling=ahead)
        engine = llm.engine
        if kernels == "triton":
            engine.core.enable_graphs(FakeCapture())  # max_num_seqs 8
        _workload(engine, ["a0", None, "a1"])
        audit = DeviceAudit(engine.device)
        steps = 0
        with audit:
            while engine.has_unfinished() and steps < 200:
                engine.step()
                steps += 1
    assert not engine.has_unfinished()
    assert audit.found == []
    if kernels == "triton":
        assert sum(engine.core.executor.worker.runner.graphs.num_replays.values()) > 0  # the decode graphs were in it


def test_the_audit_names_a_tensor_without_a_device():
    x = torch.ones(3)
    with DeviceAudit(torch.device("cpu")) as audit:
        x[torch.tensor([0], device="cpu")] + torch.ones(1, device="cpu")  # named: fine
        with pytest.raises(DeviceAuditError, match=r"on meta .* at platform/test_device.py:\d+"):
            x[torch.tensor([0, 2])]  # no device: would be a CPU tensor indexing a CUDA one
    assert audit.found == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_serve_without_cuda_says_how_to_get_it(tiny_model_dir, capsys):
    from loraplex.api.cli import main

    assert main(["serve", str(tiny_model_dir), "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_an_eager_step_reads_nothing_back(tiny_model_dir, tiny_adapters):
    """The CUDA code path (Triton kernels, stacked slots) without graphs, prefill and decode,
    under `NoHostSync`: no op reads a tensor's values on the host (item, bool(), nonzero, boolean
    masks). The sampled ids come back through `tolist`, the one read a step makes; logprobs,
    which read their rows back, are left out of this workload."""
    from loraplex.platform.device import NoHostSync

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [SamplingParams(temperature=0, max_tokens=6),
             SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=3, max_tokens=6,
                            repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, n=2),
             SamplingParams(temperature=1.0, seed=1, max_tokens=5, logit_bias={7: 3.0}, min_tokens=3),
             SamplingParams(temperature=0, max_tokens=12, min_tokens=2, structured=StructuredOutputs(json=schema))]
    with forced_kernels("triton"):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                  max_loras=2, max_num_batched_tokens=16, lora_modules={"a0": str(tiny_adapters[0])})
        engine = llm.engine
        for i, params in enumerate(cases):
            engine.add_request(f"r{i}", {"prompt_token_ids": list(range(5, 25 + i))}, params, ["a0", None][i % 2])
        steps = 0
        with NoHostSync():
            while engine.has_unfinished() and steps < 200:
                engine.step()
                steps += 1
    assert not engine.has_unfinished() and steps > 5
