import subprocess
import sys

import pytest

from loraplex.api.cli import main


def test_generate_with_chat_template(tiny_model_dir, tiny_llm, capsys):
    from loraplex.platform import SamplingParams

    assert main(["generate", "hello world", "--model", str(tiny_model_dir), "--max-tokens", "4", "--chat"]) == 0
    prompt = tiny_llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hello world"}],
                                                          tokenize=False, add_generation_prompt=True)
    text = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert capsys.readouterr().out == text + "\n"


def test_generate_matches_the_offline_api(tiny_model_dir, tiny_llm, capsys):
    from loraplex.platform import SamplingParams

    main(["generate", "hello world", "--model", str(tiny_model_dir), "--max-tokens", "6", "--dtype", "float32"])
    text = tiny_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert capsys.readouterr().out == text + "\n"


def test_bad_input_is_an_error_not_a_traceback(tiny_model_dir, capsys):
    assert main(["generate", "hi", "--model", str(tiny_model_dir), "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_default_model_command_prints_the_folder(default_model_dir):
    out = subprocess.run([sys.executable, "-m", "loraplex.api.cli", "default-model"], capture_output=True,
                         text=True, check=True, timeout=300)
    assert out.stdout.strip() == str(default_model_dir)


def test_every_engine_setting_is_a_serve_flag():
    """The serve flags are generated from EngineConfig: each field (but the model) can be set,
    and a value that differs from its default arrives in the EngineConfig unchanged."""
    from dataclasses import fields

    from loraplex.api.cli import build_parser
    from loraplex.api.launch import engine_config
    from loraplex.platform.config import EngineConfig

    given = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 7, "max_num_batched_tokens": 99,
             "block_size": 32, "num_kv_blocks": 11, "kv_cache_memory": 3 << 20, "enable_prefix_caching": False,
             "seed": 5, "max_loras": 3, "max_lora_rank": 8, "max_cpu_loras": 9, "lora_memory": 5 << 20,
             "lora_cycle_steps": 4, "lora_max_wait_steps": 6, "lora_spill_size": 6 << 20,
             "grammar_backend": "outlines", "grammar_compile_timeout_s": 2.5,
             "grammar_compile_workers": 2, "jump_forward": False, "finish_within_budget": False,
             "json_close_window": 8, "pack_weights": False, "kv_cache_dtype": "float16",
             "quantization": "int8", "device": "cuda:1", "gpu_memory_utilization": 0.5, "enforce_eager": True,
             "async_scheduling": True,
             "lora_dtype": "bfloat16", "prefill_attention": "sdpa", "max_adapters_per_request": 3,
             "deterministic": True, "speculative_config": '{"method": "ngram", "num_speculative_tokens": 6}',
             "tensor_parallel_size": 2, "scheduling_policy": "priority", "grammar_cache_dir": "off",
             "grammar_cache_size": 7 << 20}
    settable = {f.name for f in fields(EngineConfig)} - {"model"}
    assert set(given) == settable, "a new EngineConfig field: add it here with a non-default value"
    argv = ["serve", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "7",
            "--max-num-batched-tokens", "99", "--block-size", "32", "--num-kv-blocks", "11",
            "--kv-cache-memory", "3MiB", "--no-enable-prefix-caching", "--seed", "5", "--max-loras", "3",
            "--max-lora-rank", "8", "--max-cpu-loras", "9", "--lora-memory", "5MiB", "--lora-cycle-steps", "4",
            "--lora-max-wait-steps", "6", "--lora-spill-size", "6MiB",
            "--grammar-backend", "outlines", "--grammar-compile-timeout", "2.5", "--grammar-compile-workers", "2",
            "--no-jump-forward", "--no-finish-within-budget",
            "--json-close-window", "8",
            "--no-pack-weights", "--kv-cache-dtype", "float16", "--quantization", "int8", "--lora-dtype", "bfloat16",
            "--device", "cuda:1",
            "--gpu-memory-utilization", "0.5", "--enforce-eager", "--async-scheduling", "--prefill-attention", "sdpa",
            "--max-adapters-per-request", "3", "--deterministic", "--tensor-parallel-size", "2",
            "--scheduling-policy", "priority", "--grammar-cache-dir", "off", "--grammar-cache-size", "7MiB",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 6}']
    config = engine_config(build_parser().parse_args(argv), "m")
    assert config == EngineConfig(model="m", **given)
    defaults = engine_config(build_parser().parse_args(["serve"]), "m")
    assert defaults == EngineConfig(model="m")


def test_ray_flags_and_a_refused_cluster(tmp_path, capsys):
    """`serve --ray` flags reach the cluster settings; nonsense is an error naming it, before Ray starts."""
    from loraplex.api.cli import build_parser

    args = build_parser().parse_args(["serve", "--ray", "--replicas", "3", "--max-replicas", "6",
                                      "--max-adapters-per-replica", "4", "--ray-routing", "round-robin",
                                      "--replica-cpus", "0.5"])
    assert (args.ray, args.replicas, args.max_replicas, args.max_adapters_per_replica, args.ray_routing,
            args.replica_cpus) == (True, 3, 6, 4, "round-robin", 0.5)
    assert main(["serve", str(tmp_path), "--ray", "--replicas", "3", "--max-replicas", "2"]) == 2
    assert "replicas" in capsys.readouterr().err


def test_adapter_sources_with_ray_are_refused_not_ignored(tiny_model_dir):
    with pytest.raises(SystemExit, match="not supported with --ray"):
        main(["serve", str(tiny_model_dir), "--ray", "--adapter-source", "s3://bucket/prefix"])
