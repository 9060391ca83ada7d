"""`loraplex bench serve`: load any OpenAI-compatible server the way vLLM's `bench serve` does and
report the same metrics. Every request streams (with include_usage); arrivals are Poisson, or
gamma with `burstiness` != 1; each request picks a random adapter from `--adapters`; a fraction
asks for JSON-Schema output."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

# short common words: about one token each for most tokenizers
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()
# a structured request's max_tokens at least (a server keeping answers valid inside it refuses one too small for the
# schema's shortest answer)
STRUCTURED_MIN_TOKENS = 64
JSON_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                "score": {"type": "integer", "minimum": 0, "maximum": 10},
                                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 3}},
               "required": ["title", "score", "tags"], "additionalProperties": False}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    adapter: str = ""
    structured: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    id: str = ""  # the response's id


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="loraplex bench serve")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", default=None, help="base model id (default: the server's first model)")
    p.add_argument("--adapters", default="", help="comma-separated adapter names; each request picks one at random")
    p.add_argument("--adapter-zipf", type=float, default=0.0, metavar="S",
                   help="with --adapters: pick the i-th adapter with weight 1 / i^S (Zipf; 0: uniform)")
    p.add_argument("--base-fraction", type=float, default=0.0,
                   help="with --adapters: share of requests sent to the base model instead")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", default="inf", help="requests per second, or inf (all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (about tokens)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--structured-fraction", type=float, default=0.0, help="share of requests with a JSON Schema (max_tokens at least 64)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens (unstructured requests)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="FILE", help="write the metrics and settings as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {text}")
    return rate


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Seconds between consecutive arrivals: gamma with mean 1/rate (Poisson when burstiness=1)."""
    if rate == float("inf"):
        return [0.0] * n
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def _one(client, model: str, prompt: str, args, adapter: str, structured: bool) -> RequestResult:
    result = RequestResult(adapter=adapter, structured=structured)
    body = {"ignore_eos": args.ignore_eos and not structured}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "review", "schema": JSON_SCHEMA}}
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=f"{model}:{adapter}" if adapter else model, prompt=prompt,
            max_tokens=max(args.output_len, STRUCTURED_MIN_TOKENS) if structured else args.output_len,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body=body)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
            result.id = chunk.id  # the response's id: its usage ledger row is `{id}-0`
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens (or no usage) in the stream"
    except Exception as exc:  # a failed request is a data point, not the end of the run
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run(args) -> tuple[list[RequestResult], float]:
    import openai

    base = args.base_url.rstrip("/")
    client = openai.AsyncOpenAI(base_url=base if base.endswith("/v1") else base + "/v1",
                                api_key=args.api_key or "none", max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    rate = _rate(args.request_rate)
    rng = random.Random(args.seed)
    adapters = [a for a in args.adapters.split(",") if a]
    weights = [1 / (i + 1) ** args.adapter_zipf for i in range(len(adapters))] if args.adapter_zipf else None
    gaps = arrival_gaps(args.num_prompts, rate, args.burstiness, np.random.default_rng(args.seed))
    limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.num_prompts, desc="requests", file=sys.stderr)

    async def limited(prompt: str, adapter: str, structured: bool) -> RequestResult:
        async with limit:
            result = await _one(client, model, prompt, args, adapter, structured)
        if progress is not None:
            progress.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    for gap in gaps:
        await asyncio.sleep(gap)
        on_base = not adapters or rng.random() < args.base_fraction
        tasks.append(asyncio.create_task(limited(make_prompt(rng, args.input_len),
                                                 "" if on_base else _pick(rng, adapters, weights),
                                                 rng.random() < args.structured_fraction)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    await client.close()
    return results, duration


def _pick(rng: random.Random, adapters: list[str], weights: list[float] | None) -> str:
    return rng.choices(adapters, weights)[0] if weights else rng.choice(adapters)


def _stats(values: list[float], name: str) -> dict[str, float]:
    ms = np.array(values or [0.0]) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    total = output + sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {"successful_requests": len(ok), "failed_requests": len(results) - len(ok),
               "duration_s": duration, "request_throughput": len(ok) / duration,
               "output_token_throughput": output / duration, "total_token_throughput": total / duration,
               "total_input_tokens": total - output, "total_output_tokens": output}
    summary.update(_stats([r.ttft for r in ok], "ttft"))
    summary.update(_stats(tpot, "tpot"))
    summary.update(_stats([x for r in ok for x in r.itl], "itl"))
    summary.update(_stats([r.e2e for r in ok], "e2el"))
    for group, members in (("base", [r for r in ok if not r.adapter]), ("adapter", [r for r in ok if r.adapter])):
        summary[f"{group}_requests"] = len(members)
        summary.update({f"{group}_{k}": v for k, v in _stats([r.ttft for r in members], "ttft").items()})
    summary["errors"] = sorted({r.error for r in results if r.error})[:10]
    return summary


def report(summary: dict) -> str:
    lines = ["============ Serving Benchmark Result ============"]
    labels = [("successful_requests", "Successful requests", "d"), ("failed_requests", "Failed requests", "d"),
              ("duration_s", "Benchmark duration (s)", ".2f"), ("total_input_tokens", "Total input tokens", "d"),
              ("total_output_tokens", "Total generated tokens", "d"),
              ("request_throughput", "Request throughput (req/s)", ".2f"),
              ("output_token_throughput", "Output token throughput (tok/s)", ".2f"),
              ("total_token_throughput", "Total token throughput (tok/s)", ".2f")]
    lines += [f"{label:<40}{summary[key]:<10{spec}}" for key, label, spec in labels]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{summary[f'{stat}_{key}_ms']:<10.2f}")
    lines.append("=" * 50)
    if summary["errors"]:
        lines.append("errors: " + "; ".join(summary["errors"]))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> tuple[str, int]:
    """The report to show, and the exit status (1: no request succeeded)."""
    if not 0.0 <= args.base_fraction <= 1.0:
        raise ValueError(f"--base-fraction must be in [0, 1], got {args.base_fraction}")
    if not 0.0 <= args.structured_fraction <= 1.0:
        raise ValueError(f"--structured-fraction must be in [0, 1], got {args.structured_fraction}")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    results, duration = asyncio.run(run(args))
    summary = summarize(results, duration)
    if args.save_result:
        settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        with open(args.save_result, "w") as f:
            json.dump({"settings": settings, **summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    return report(summary), 0 if summary["successful_requests"] else 1
