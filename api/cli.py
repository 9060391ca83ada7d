"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import sys


def _default_model(args: argparse.Namespace) -> int:
    from loraplex.platform.model_store import materialize_default_model

    print(materialize_default_model())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from loraplex.platform import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    (out,) = llm.generate([prompt], params)
    print(out.outputs[0].text)
    return 0


def _size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1GiB' or '2GB'."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit) and lowered[:-len(unit)].strip():
            return int(float(lowered[:-len(unit)]) * factor)
    return int(lowered)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def _serve(args: argparse.Namespace) -> int:
    from loraplex.api.serve import serve

    return serve(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from loraplex.api.bench_serve import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="multi-LoRA, structured-output LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("default-model", help="print the default model's folder, converting it on first use")
    p.set_defaults(func=_default_model)

    p = sub.add_parser("generate", help="generate a completion offline")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.set_defaults(func=_generate)

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API (vLLM's flag names)")
    p.add_argument("model", nargs="?", default=None, help="local model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the base model's id (default: its folder's name)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=_size, default=1 << 30, help="KV cache size: bytes, or e.g. 512MiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides memory)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                   help="float16: twice the KV tokens in the same memory (auto: the model's dtype)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="adapters to load at start-up (repeatable)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="distinct adapters in one batch (default: as many as --lora-memory holds at "
                        "--max-lora-rank, at most --max-num-seqs; the log says what it chose)")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in CPU memory (default: as many as --lora-memory holds)")
    p.add_argument("--lora-memory", type=_size, default=2 << 30,
                   help="memory for adapter weights (the CPU LRU; batches read them in place): bytes, or e.g. 4GiB")
    p.add_argument("--lora-cycle-steps", type=int, default=32,
                   help="steps a resident adapter keeps admitting requests while other adapters wait for a slot")
    p.add_argument("--enable-lora-resolver", action="store_true",
                   help="serve an unregistered adapter name by loading the PEFT folder of that name "
                        "from an --adapter-root on its first request")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="folder the admin endpoint may load adapters from (repeatable; none: runtime loading off)")
    p.add_argument("--api-key", default=None, help="key for /v1/*, /tokenize, /detokenize (or LORAPLEX_API_KEY)")
    p.add_argument("--admin-api-key", default=None,
                   help="the only key that opens the adapter admin endpoints (or LORAPLEX_ADMIN_API_KEY)")
    p.add_argument("--grammar-backend", default="xgrammar", choices=["xgrammar", "outlines", "auto"])
    p.add_argument("--max-waiting-requests", type=int, default=1024, help="beyond this, 429 with Retry-After")
    p.add_argument("--max-request-body-bytes", type=_size, default=4 << 20, help="beyond this, 413")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds; beyond this, 504")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("serve", help="load an OpenAI-compatible server and report vLLM's serving metrics")
    from loraplex.api.bench_serve import build_parser as bench_serve_parser

    bench_serve_parser(p)
    p.set_defaults(func=_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"loraplex: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
