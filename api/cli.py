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


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field (but `model`): name, type, default and help come from
    the field, so a new engine setting is on the command line without being declared twice."""
    from dataclasses import fields

    from loraplex.platform.config import EngineConfig

    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        meta = dict(f.metadata)
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kind = str(f.type).replace(" | None", "")
        kwargs = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _size if meta.get("size") else {"int": int, "float": float, "str": str}[kind]
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        parser.add_argument(flag, **kwargs)


def engine_args(args: argparse.Namespace) -> dict:
    """The parsed engine flags, as EngineConfig keyword arguments."""
    from dataclasses import fields

    from loraplex.platform.config import EngineConfig

    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model"}


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        from loraplex.api.ray_serve import serve_ray

        return serve_ray(args)
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
    add_engine_flags(p)
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="adapters to load at start-up (repeatable)")
    p.add_argument("--enable-lora-resolver", action="store_true",
                   help="serve an unregistered adapter name by loading the PEFT folder of that name "
                        "from an --adapter-root on its first request")
    p.add_argument("--disable-ui", action="store_true", help="no web console at /ui")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="folder the admin endpoint may load adapters from (repeatable; none: runtime loading off)")
    p.add_argument("--api-key", default=None, help="key for /v1/*, /tokenize, /detokenize (or LORAPLEX_API_KEY)")
    p.add_argument("--admin-api-key", default=None,
                   help="the only key that opens the adapter admin endpoints (or LORAPLEX_ADMIN_API_KEY)")
    p.add_argument("--max-waiting-requests", type=int, default=1024, help="beyond this, 429 with Retry-After")
    p.add_argument("--max-request-body-bytes", type=_size, default=4 << 20, help="beyond this, 413")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds; beyond this, 504")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish")
    ray = p.add_argument_group("Ray Serve (pip install -e .[ray]; api/ray_serve.py)")
    ray.add_argument("--ray", action="store_true", help="serve replicas on Ray Serve, routed by adapter")
    ray.add_argument("--replicas", type=int, default=2, help="engine replicas (the minimum when autoscaling)")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    ray.add_argument("--max-adapters-per-replica", type=int, default=16,
                     help="adapters a replica keeps (LRU); Ray routes each adapter to replicas holding it")
    ray.add_argument("--ray-routing", default="adapter", choices=["adapter", "round-robin"],
                     help="adapter: Ray's model multiplexing by adapter; round-robin: adapter-blind (a baseline)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs (and torch threads) per replica")
    ray.add_argument("--ray-address", default=None,
                     help="join a running cluster (e.g. auto after `ray start`); default: a local Ray on 127.0.0.1")
    ray.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
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
