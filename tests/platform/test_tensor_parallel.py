"""Tensor parallelism (#55) on the CPU over gloo: TP=2 greedy outputs equal TP=1's (float32) on tiny models of every
family and on the default model, with adapters (8 in one batch), a mix and a JSON Schema; adapters hot-loaded and
unloaded while requests run; a killed worker fails its requests and the engine, without a hang; the shard plan
covers every head, column, expert and vocabulary row once."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import FAMILY_CLASSES, make_tiny_model, write_random_adapter
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.models.registry import read_model_config
from loraplex.platform.models.sharding import ShardPlan, head_split, plan_for
from loraplex.platform.executor.abstract import WorkerDiedError
from loraplex.platform.worker.worker import shard_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 22, 40, 17, 3, 8, 100, 7], [7, 8, 9, 10], [3, 200, 11, 57, 12, 90, 2, 33]]
ENGINE = dict(dtype="float32", num_kv_blocks=128, grammar_compile_workers=0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def greedy(llm: LLM, adapters=(None,)) -> list[list[int]]:
    """Every prompt under every adapter (a name, a mix or None) in one batch."""
    out = []
    for adapter in adapters:
        for prompt in PROMPTS:
            llm.engine.add_request(f"r{len(out)}", prompt, GREEDY, adapter)
            out.append(None)
    done = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            done.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    return [done[f"r{k}"] for k in range(len(out))]


# ---- the plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize("heads, kv_heads, size", [(9, 3, 2), (4, 2, 2), (4, 1, 2), (8, 2, 4), (16, 8, 4)])
def test_every_head_is_on_some_rank_and_each_query_head_on_one(heads, kv_heads, size):
    splits = [head_split(heads, kv_heads, size, rank) for rank in range(size)]
    q_heads = [h for q, _ in splits for h in range(*q)]
    assert q_heads == list(range(heads))  # in order, each once
    group = heads // kv_heads
    for (q, kv) in splits:  # each rank holds the KV heads its query heads read
        assert {h // group for h in range(*q)} <= set(range(*kv))
    assert {k for _, kv in splits for k in range(*kv)} == set(range(kv_heads))


def test_a_split_that_cannot_be_made_is_refused_naming_why():
    with pytest.raises(ValueError, match="does not split 6 query heads over 2 KV heads"):
        head_split(6, 2, 3, 0)  # 3 ranks over 2 KV heads: one would be split between ranks
    with pytest.raises(ValueError, match="does not split 4 query heads over 2 KV heads"):
        head_split(4, 2, 8, 0)  # more ranks than query heads


def test_a_sharded_adapter_adds_up_to_the_whole():
    """Column-parallel: each rank's output columns of the delta; row-parallel: each rank's partial sums, whose sum
    is the whole delta (what the layer's all-reduce adds)."""
    from loraplex.adapters.peft_format import LoRAWeights

    plan = ShardPlan(0, 2, num_heads=3, num_kv_heads=3, head_dim=4, intermediate_size=10, vocab_size=50)
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(3 * 2, 8, generator=g), torch.randn(2, 36, generator=g))  # A [3 r, in], B^T [r, out]
    down = (torch.randn(2, 10, generator=g), torch.randn(2, 8, generator=g))
    lora = LoRAWeights("a", "p", 2, 1.0, frozenset(), {(0, "qkv_proj"): qkv, (0, "down_proj"): down})
    x, h = torch.randn(5, 8, generator=g), torch.randn(5, 10, generator=g)
    parts = [shard_adapter(lora, plan.at(rank)).projections for rank in range(2)]
    full_qkv = torch.cat([(x @ qkv[0][k * 2:(k + 1) * 2].T) @ qkv[1][:, k * 12:(k + 1) * 12] for k in range(3)], -1)
    ranks_qkv = []
    for rank, p in enumerate(parts):
        a, b_t = p[(0, "qkv_proj")]
        widths = [4 * (plan.at(rank).q_heads[1] - plan.at(rank).q_heads[0])] * 3
        offsets = [0, widths[0], 2 * widths[0], 3 * widths[0]]
        ranks_qkv.append([(x @ a[k * 2:(k + 1) * 2].T) @ b_t[:, offsets[k]:offsets[k + 1]] for k in range(3)])
    for k in range(3):  # q, k and v each: rank 0's heads then rank 1's
        torch.testing.assert_close(torch.cat([r[k] for r in ranks_qkv], -1), full_qkv[:, k * 12:(k + 1) * 12])
    partial = [h[:, slice(*plan.at(rank).intermediate)] @ p[(0, "down_proj")][0].T @ p[(0, "down_proj")][1]
               for rank, p in enumerate(parts)]
    torch.testing.assert_close(partial[0] + partial[1], h @ down[0].T @ down[1])


def test_the_plan_refuses_more_ranks_than_experts(tmp_path):
    config = read_model_config(make_tiny_model(tmp_path / "m", "mixtral", num_local_experts=2))
    with pytest.raises(ValueError, match="more than the model's 2 experts"):
        plan_for(config, 4, 0)


# ---- every family ------------------------------------------------------------------------------

FAMILY_OVERRIDES = {
    "gemma2": dict(head_dim=16, sliding_window=6, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                   tie_word_embeddings=True),
    "gemma3": dict(head_dim=16, sliding_window=6, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "full_attention"]),
    "qwen3": dict(head_dim=32),
    "granite": dict(embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.5,
                    logits_scaling=4.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "smollm3": dict(tie_word_embeddings=True),
}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe"}


SMALL_SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}, "b": {"type": "boolean"}},
                "required": ["a", "b"], "additionalProperties": False}  # short whatever a random model picks


@pytest.mark.parametrize("family", sorted(FAMILY_CLASSES))
def test_tp2_greedy_equals_tp1_on_every_family_with_8_adapters_a_mix_and_a_schema(tmp_path, family):
    from loraplex.grammar.backend import StructuredOutputs

    folder = make_tiny_model(tmp_path / family, family, seed=3, **FAMILY_OVERRIDES.get(family, {}))
    config = read_model_config(folder)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if family in MOE else \
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else TARGETS
    paths = [write_random_adapter(tmp_path / f"a{k}", config, seed=k, targets=targets) for k in range(8)]
    adapters = (None, *(f"a{k}" for k in range(8)), {"a0": 0.7, "a1": 0.5})
    schema = SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutputs(json=SMALL_SCHEMA))
    outputs = {}
    for tp in (1, 2):
        with LLM(str(folder), tensor_parallel_size=tp, **ENGINE) as llm:
            for k, path in enumerate(paths):
                llm.load_adapter(f"a{k}", path)
            outputs[tp] = greedy(llm, adapters)
            outputs[tp].append(llm.generate([{"prompt_token_ids": PROMPTS[0]}], schema, adapter="a2")[0].outputs[0].text)
    assert outputs[2] == outputs[1]
    assert outputs[1][0] != outputs[1][3]  # the adapters change what is generated
    assert set(json.loads(outputs[1][-1])) == {"a", "b"}


def test_decode_graphs_under_tp_come_from_the_same_runner_and_give_the_eager_tokens(tmp_path):
    """Each rank captures its decode graphs through the one `ModelRunner` (the CPU stand-in capture, which refuses
    host syncs, with the Triton kernels' stacked slots: base, LoRA and mix graphs), the engine's block tables as
    wide as theirs; decode steps replay them on every rank and the tokens are TP=1's eager ones."""
    from conftest import forced_kernels
    from loraplex.platform.worker.cuda_graphs import FakeCapture

    folder = make_tiny_model(tmp_path / "m", "llama", seed=3)
    paths = [write_random_adapter(tmp_path / f"a{k}", read_model_config(folder), seed=k) for k in range(2)]
    adapters = (None, "a0", "a1", {"a0": 0.7, "a1": 0.5})
    outputs = {}
    with forced_kernels("triton"):
        for tp, graphs in ((1, False), (2, True)):
            with LLM(str(folder), tensor_parallel_size=tp, max_num_seqs=16, **ENGINE) as llm:
                for k, path in enumerate(paths):
                    llm.load_adapter(f"a{k}", path)
                if graphs:
                    llm.engine.core.enable_graphs(FakeCapture())
                outputs[tp, graphs] = greedy(llm, adapters)
                replays = llm.engine.core.executor.call("graph_replays", every=True) if graphs else [0]
    assert outputs[2, True] == outputs[1, False]
    assert replays[0] == replays[1] >= GREEDY.max_tokens - 1  # every decode step, on both ranks


def test_kv_heads_replicated_when_fewer_than_ranks(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama", seed=5, num_key_value_heads=1)
    outputs = [greedy(LLM(str(folder), tensor_parallel_size=tp, **ENGINE)) for tp in (1, 2)]
    assert outputs[0] == outputs[1]


def test_quantized_weights_are_refused_by_name(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="quantized weights are not sharded"):
        LLM(str(folder), tensor_parallel_size=2, quantization="int8", **ENGINE)


# ---- the default model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_adapters(default_model_dir, tmp_path_factory):
    config = read_model_config(default_model_dir)
    root = tmp_path_factory.mktemp("tp-adapters")
    return [write_random_adapter(root / f"d{k}", config, seed=10 + k, rank=8) for k in range(9)]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def default_run(llm: LLM) -> list[str]:
    """8 adapters, the base, a mix and a JSON Schema request in one batch."""
    from loraplex.grammar.backend import StructuredOutputs

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    requests = [(p, f"d{k}") for k, p in enumerate(prompts * 3) if k < 8] + [(prompts[0], None)]
    requests.append((prompts[1], {"d0": 0.6, "d1": 0.4}))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(requests)
    requests.append(("Give a person as JSON:", None))
    params.append(SamplingParams(temperature=0, max_tokens=40,
                                 structured=StructuredOutputs(json=SCHEMA)))
    for k, ((prompt, adapter), p) in enumerate(zip(requests, params)):
        llm.engine.add_request(f"q{k}", prompt, p, adapter)
    texts: dict[str, str] = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
    return [texts[f"q{k}"] for k in range(len(requests))]


def test_default_model_tp2_equals_tp1_with_8_adapters_a_mix_and_a_schema(default_model_dir, default_adapters):
    outputs = []
    for tp in (1, 2):
        llm = LLM(str(default_model_dir), tensor_parallel_size=tp, dtype="float32", num_kv_blocks=256,
                  grammar_compile_workers=0)
        for k, path in enumerate(default_adapters[:8]):
            llm.load_adapter(f"d{k}", path)
        outputs.append(default_run(llm))
        llm.engine.close()
    assert outputs[1] == outputs[0]
    json.loads(outputs[1][-1])  # the schema's answer parses
    assert len(set(outputs[0][:8])) > 1


def test_hot_load_and_unload_during_traffic_and_a_refused_load_leaves_every_rank_serving(default_model_dir,
                                                                                        default_adapters, tmp_path):
    llm = LLM(str(default_model_dir), tensor_parallel_size=2, dtype="float32", num_kv_blocks=256,
              grammar_compile_workers=0)
    try:
        engine = llm.engine
        llm.load_adapter("d0", default_adapters[0])
        long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        engine.add_request("a", "Once upon a time", long, "d0")
        engine.add_request("b", "Once upon a time", long, None)
        texts: dict[str, str] = {}
        for _ in range(3):
            for out in engine.step():
                texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
        llm.load_adapter("d8", default_adapters[8])  # while a and b run
        engine.add_request("c", "Once upon a time", long, "d8")
        bad = write_random_adapter(tmp_path / "vocab", read_model_config(default_model_dir), seed=3)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": TARGETS + ["lm_head"]}))
        _add_head_lora(bad, read_model_config(default_model_dir))
        with pytest.raises(ValueError, match="not served under tensor parallelism"):
            llm.load_adapter("vocab", bad)
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
        engine.adapters.unload("d8")
        llm.load_adapter("d8", default_adapters[7], )  # the same name, another adapter: its shards follow
        again = llm.generate(["Once upon a time"], long, adapter="d8")[0].outputs[0].text
        reference = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=256, grammar_compile_workers=0)
        for name, path in (("d0", default_adapters[0]), ("d8", default_adapters[8]), ("d7", default_adapters[7])):
            reference.load_adapter(name, path)
        expect = [reference.generate(["Once upon a time"], long, adapter=a)[0].outputs[0].text for a in
                  ("d0", None, "d8", "d7")]
        assert [texts["a"], texts["b"], texts["c"], again] == expect
    finally:
        llm.engine.close()


def _add_head_lora(folder, config: ModelConfig) -> None:
    from safetensors.torch import load_file

    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(4, config.hidden_size) * 0.01
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(config.vocab_size, 4) * 0.01
    save_file(tensors, folder / "adapter_model.safetensors")


def without_a_hang(call, safety_s: float = 120.0) -> BaseException | None:
    """What `call()` raised (None: it returned), run in a thread joined with a generous timeout: a safety net
    that turns a hang into a failure, not a bound on how long the call may take."""
    import threading

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(safety_s)
    assert not thread.is_alive(), f"still running after {safety_s:g} s: a hang"
    return outcome[0]


def test_a_killed_worker_fails_the_requests_and_the_engine_without_a_hang(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama", seed=1)
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    try:
        engine = llm.engine
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(engine.core.executor.procs[1].pid, signal.SIGKILL)
        steps = [0]

        def step_until_it_fails() -> None:
            for _ in range(50):
                steps[0] += 1
                engine.step()

        error = without_a_hang(step_until_it_fails)
        assert isinstance(error, WorkerDiedError) and "worker 1 exited" in str(error), error
        assert steps[0] == 1  # counted, not timed: the very next step saw the exit
        with pytest.raises(WorkerDiedError):  # and every later step: the group cannot go on
            engine.add_request("b", PROMPTS[1], GREEDY)
            engine.step()
        assert not any(proc.is_alive() for proc in engine.core.executor.procs)
    finally:
        llm.engine.close()


def test_a_killed_worker_fails_the_streams_and_the_engine_reports_unhealthy(tmp_path):
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.engine.engine_client import EngineDeadError

    folder = make_tiny_model(tmp_path / "m", "llama", seed=2)
    front = AsyncEngine(LLM(str(folder), tensor_parallel_size=2, **ENGINE).engine)
    try:
        rid = front.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        stream = front.stream(rid, timeout=60)
        next(stream)
        os.kill(front.engine.core.executor.procs[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            list(stream)
        assert not front.health().alive
        with pytest.raises(EngineDeadError):
            front.submit(PROMPTS[1], GREEDY)
    finally:
        front.shutdown()


def test_chunked_prefill_preemption_n2_prompt_logprobs_and_speculation_as_with_one_process(tmp_path):
    """What the engine's process does around the model (chunks, preemption, forks, prompt logprobs through the
    workers' head, drafts verified in one step) gives TP=2 the same answers as TP=1."""
    folder = make_tiny_model(tmp_path / "m", "llama", seed=4)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6] * 3, PROMPTS[0] * 4, PROMPTS[2] * 4]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    results = []
    for tp in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=tp, dtype="float32", num_kv_blocks=14, block_size=8,
                  max_num_batched_tokens=16, max_num_seqs=4, speculative_config=spec, grammar_compile_workers=0)
        outs = llm.generate(prompts, params)
        results.append(outs)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0
        llm.engine.close()
    one, two = results
    assert [[c.token_ids for c in o.outputs] for o in two] == [[c.token_ids for c in o.outputs] for o in one]
    got = [lp for lp in two[0].prompt_logprobs[1:]]
    want = [lp for lp in one[0].prompt_logprobs[1:]]
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    for g, w in zip(got, want):
        for token in w:
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)


def _reduce_in_rank(rank: int, world: int, port: int, path: str, results) -> None:
    import torch.distributed as dist

    from loraplex.platform import distributed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    distributed.use_shared_memory(path, rank, world, chunk=1000)  # small: a tensor goes through in chunks
    out = []
    for seed, n in ((0, 5), (1, 2500), (2, 7), (3, 4096)):  # sequence numbers go on across calls and chunks
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed * 10 + rank))
        out.append(distributed.all_reduce(x).tolist())
    results.put((rank, out))  # plain lists: a tensor would go as a handle the parent must take before we exit
    dist.destroy_process_group()


def test_the_shared_memory_all_reduce_sums_in_rank_order_on_every_rank():
    import multiprocessing

    from loraplex.platform.distributed import create_segment
    from loraplex.platform.executor.multiproc import _free_port

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), _free_port()
    segment = create_segment(f"loraplex-test-{port}", 2, chunk=1000)
    assert segment.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):  # never an existing file (nor a link planted under the name)
        create_segment(segment.name, 2, chunk=1000)
    procs = [context.Process(target=_reduce_in_rank, args=(rank, 2, port, str(segment), results)) for rank in range(2)]
    try:
        for proc in procs:
            proc.start()
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        segment.unlink()
        for proc in procs:
            proc.join(30)
    for k, (seed, n) in enumerate(((0, 5), (1, 2500), (2, 7), (3, 4096))):
        parts = [torch.randn(n, generator=torch.Generator().manual_seed(seed * 10 + rank)) for rank in range(2)]
        assert torch.equal(torch.tensor(got[0][k]), parts[0] + parts[1]) and got[1][k] == got[0][k]


def test_no_segment_is_left_behind_once_the_workers_run_or_stop(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama", seed=1)
    mine = f"loraplex-tp-{os.getpid()}-*"  # other test processes may be starting engines of their own
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.engine.core.executor.segment is not None  # float32 on the CPU: the shared-memory all-reduce
        assert not list(Path("/dev/shm").glob(mine))  # unlinked once every rank mapped it
        procs = llm.engine.core.executor.procs
    assert not any(proc.is_alive() for proc in procs)


def test_a_rank_that_fails_a_step_stops_the_others_waiting_for_it_without_a_hang(tmp_path):
    """Rank 1 cannot take a slot change that rank 0 takes, so rank 0 goes on into the forward pass and waits in
    the first all-reduce for rank 1, which never comes: the engine stops both at rank 1's error."""
    from loraplex.adapters.peft_format import LoRAWeights

    folder = make_tiny_model(tmp_path / "m", "llama", seed=1)  # 4 query heads of 16: rank 0's o inputs are 0..31
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as llm:
        engine = llm.engine
        a, b_t = torch.randn(4, 32), torch.randn(4, 64)  # o's A only as wide as rank 0's columns
        bad = LoRAWeights("bad", "-", 4, 1.0, frozenset({"o_proj"}), {(0, "o_proj"): (a, b_t)})
        engine.core.executor.slot_changes.append((0, bad))  # packed for the pipe as the registry's would be
        engine.add_request("a", PROMPTS[0], GREEDY)
        error = without_a_hang(engine.step)  # the one step: it fails, rank 0 is not left waiting in it
        assert isinstance(error, WorkerDiedError) and "rank 1" in str(error), error
        assert not any(proc.is_alive() for proc in engine.core.executor.procs)


def test_an_adapter_goes_through_the_pipe_at_its_own_size(default_model_dir, default_adapters):
    """Its tensors are views into one buffer: pickled one by one, each would carry the whole buffer (GBs)."""
    from loraplex.adapters.peft_format import read_peft_adapter
    from loraplex.platform.worker.worker import pack_adapter, unpack_adapter

    weights = read_peft_adapter("d0", default_adapters[0], read_model_config(default_model_dir), 16)
    packed = pack_adapter(weights)
    assert len(packed) < 1.1 * weights.nbytes
    back = unpack_adapter(packed)
    assert back.content_hash == weights.content_hash and all(
        torch.equal(back.projections[k][i], weights.projections[k][i]) for k in weights.projections for i in (0, 1))
