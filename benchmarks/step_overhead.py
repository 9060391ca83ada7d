"""Per-step engine work as a generation grows: is a step O(new tokens)?

A batch of requests generates `--tokens` tokens each (greedy, `ignore_eos`), and every step is
timed twice: the whole `Engine.step`, and the model's forward pass inside it. Their difference
is the engine's own work per step (scheduling, sampling, updating, outputs, detokenizing),
which must stay flat from token 100 to 2,000; the forward pass grows with the context
(attention reads every earlier token), so the default model is a small random Llama built here
(2 layers, hidden 64), where the engine's own work is most of the step. `--model DIR` runs a real one.

    .venv/bin/python benchmarks/step_overhead.py [--batch 16 --tokens 2000 --model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplex.platform import LLM, SamplingParams
from loraplex.platform.model_store import default_model_dir


def tiny_model(folder: Path, max_len: int) -> str:
    """A random 2-layer Llama with the default model's tokenizer (real text to detokenize)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                                      eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: a tiny random Llama)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--stop", action="store_true", help="give every request a stop string (text hold-back)")
    args = parser.parse_args()
    max_len = args.tokens + 64
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp) / "tiny", max_len)
        llm = LLM(model, dtype="float32", max_model_len=max_len, max_num_seqs=args.batch,
                  num_kv_blocks=args.batch * (max_len // 16 + 2))
    engine = llm.engine
    forward_s: list[float] = []
    execute = engine.core.executor.execute  # the ranks' forward pass (the batch is built before it, in the core)

    def timed_execute(*a, **k):
        start = time.perf_counter()
        result = execute(*a, **k)
        forward_s.append(time.perf_counter() - start)
        return result

    engine.core.executor.execute = timed_execute
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=1,
                            stop=["never appears \u2603"] if args.stop else None)
    for i in range(args.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [10 + i, 20 + i, 30 + i, 40 + i]}, params)
    step_s, received = [], 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - start)
        received += sum(len(o.outputs) for o in outputs)  # what a caller holds on to each step
    # step k (k >= 1) produced token k + 1 of every request; the first step was the prefill
    print(f"model={'tiny random Llama' if args.model is None else model} batch={args.batch} tokens={args.tokens} "
          f"logprobs=1 stop={'yes' if args.stop else 'no'} threads={torch.get_num_threads()} ({sys.platform})")
    print(f"{'around token':>12} {'step ms':>9} {'forward ms':>11} {'engine-own ms':>14}")
    for at in (100, 500, 1000, 1500, args.tokens - 50):
        window = range(max(1, at - 50), min(len(step_s), at + 50))
        step = statistics.median(step_s[i] for i in window)
        fwd = statistics.median(forward_s[i] for i in window)
        print(f"{at:>12} {1e3 * step:>9.2f} {1e3 * fwd:>11.2f} {1e3 * (step - fwd):>14.2f}")


if __name__ == "__main__":
    main()
