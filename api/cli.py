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
