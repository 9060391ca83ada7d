"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from loraplex.api.flags import add_flags
from loraplex.api.launch import add_engine_flags, model_folder
from loraplex.api.settings import ClusterConfig, ServerConfig


def _default_model(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="[loraplex] %(message)s")  # the conversion's progress
    from loraplex.platform.model_store import materialize_default_model

    print(materialize_default_model())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.engine_client import build_engine_client
    from loraplex.platform.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    client = build_engine_client(EngineConfig(model=model_folder(args.model), dtype=args.dtype,
                                              max_model_len=args.max_model_len))
    try:
        print(asyncio.run(_generate_text(client, args.prompt, params, args.chat)))
    finally:
        client.shutdown()
    return 0


async def _generate_text(client, prompt: str, params, chat: bool) -> str:
    from loraplex.platform.engine.engine_client import accumulate

    if chat:
        prompt = {"prompt_token_ids": await client.tokenize_chat([{"role": "user", "content": prompt}])}
    whole = None
    async for _, delta in client.generate_many([prompt], [params], [None]):
        whole = accumulate(whole, delta)
    return whole.outputs[0].text


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def _serve(args: argparse.Namespace) -> int:
    # what the server logs at INFO (where it serves, adapters loaded) is for the user: on stderr
    logging.basicConfig(level=logging.INFO, format="[loraplex] %(message)s")
    if args.ray:
        if args.adapter_sources or _tenant_sources(args.tenants_file):
            # replicas resolve names through the shared set alone: refused, not ignored
            raise SystemExit("loraplex: error: adapters from object storage (--adapter-source, a tenant's "
                             "adapter_source) are not supported with --ray yet; serve without --ray, or load the "
                             "adapters through the admin endpoint")
        from loraplex.api.cluster.ray_serve import serve_ray

        return serve_ray(args)
    from loraplex.api.serve import serve

    return serve(args)


def _tenant_sources(path: str | None) -> bool:
    from loraplex.api.tenancy.tenants import load_tenants

    return bool(path) and any(t.adapter_source for t in load_tenants(path).by_name.values())


def _bench_serve(args: argparse.Namespace) -> int:
    from loraplex.api.bench_serve import main

    text, status = main(args)
    print(text)
    return status


def _usage(args: argparse.Namespace) -> int:
    from loraplex.api.admin.usage_export import export
    from loraplex.api.launch import usage_db

    path = usage_db(ServerConfig(usage_db=args.usage_db, port=args.port))
    if path is None:
        raise ValueError("--usage-db memory keeps nothing to read")
    print(export(path, args.since, args.until, args.format), end="")
    return 0


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
    add_flags(p, ServerConfig)
    add_engine_flags(p)
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="adapters to load at start-up (repeatable)")
    ray = p.add_argument_group("Ray Serve (pip install -e .[ray]; api/cluster/ray_serve.py)")
    ray.add_argument("--ray", action="store_true", help="serve replicas on Ray Serve, routed by adapter")
    add_flags(ray, ClusterConfig)
    p.set_defaults(func=_serve)

    p = sub.add_parser("usage", help="what the usage ledger billed, per day, tenant and adapter")
    p.add_argument("--usage-db", default=None, metavar="PATH", help="the ledger's file (default: the one "
                   "`loraplex serve --port PORT` writes, usage-PORT.db in $LORAPLEX_CACHE or ~/.cache/loraplex)")
    p.add_argument("--port", type=int, default=ServerConfig.port, help="the server's port, for the default file")
    p.add_argument("--since", default=None, help="unix seconds or ISO 8601 (UTC unless it says); included")
    p.add_argument("--until", default=None, help="unix seconds or ISO 8601; excluded")
    p.add_argument("--format", default="csv", choices=["csv", "json"])
    p.set_defaults(func=_usage)

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
