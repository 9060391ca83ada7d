"""The engine on a machine with only torch, transformers, peft, safetensors, tokenizers and jinja2 (the GPU
machine the device check runs on): it imports and generates; structured outputs are what needs more."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import builtins, sys
    real = builtins.__import__
    ABSENT = ("jsonschema", "xgrammar", "llguidance", "outlines_core", "fastapi", "uvicorn", "prometheus_client",
              "openai", "ray", "hypothesis")

    def bare(name, *args, **kwargs):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the bare machine)")
        return real(name, *args, **kwargs)

    builtins.__import__ = bare
    from loraplex.platform import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=16)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    print("TOKENS", out[0].outputs[0].token_ids)
""")


def test_the_engine_runs_without_the_grammar_and_server_packages(tiny_model_dir):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS" in done.stdout
