"""Serving numbers for BENCHMARKS.md: start `loraplex serve` on the default model with 64
adapters registered, then run `loraplex bench serve` under a few loads (request rates, 0/8/64
adapters, 0/25% structured) and print one markdown table.

    .venv/bin/python benchmarks/serving.py [--num-prompts 32 --input-len 64 --output-len 32]

Adapters: the demo adapters (`make demo-adapters`) and the example adapter, registered under 64
names (distinct names take distinct device slots, which is what the scheduler and kernels see).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from loraplex.api.bench_serve import build_parser, run, summarize
from loraplex.platform.model_store import adapters_dir, default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from example_adapter import ensure_example_adapter  # noqa: E402

LOADS = [  # (request rate, adapters, structured fraction)
    ("inf", 0, 0.0), ("4", 0, 0.0), ("inf", 8, 0.0), ("inf", 64, 0.0), ("inf", 0, 0.25), ("4", 8, 0.25),
]


def adapter_folders() -> list[Path]:
    folders = [adapters_dir() / n for n in ("shout", "terse", "pirate") if (adapters_dir() / n).is_dir()]
    return folders + [ensure_example_adapter()]


def start_server(port: int, num_adapters: int, max_loras: int | None, extra: tuple[str, ...] = (),
                 max_model_len: int = 2048) -> subprocess.Popen:
    folders = adapter_folders() if num_adapters else []
    modules = [f"ad{i}={folders[i % len(folders)]}" for i in range(num_adapters)]
    cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", str(default_model_dir()), "--port", str(port),
           "--max-model-len", str(max_model_len), *(["--max-loras", str(max_loras)] if max_loras else []),
           *(["--lora-modules", *modules] if modules else []), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=None, help="default: the server's (derived from memory)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(port, 64, args.max_loras)
    rows = []
    try:
        for load, (rate, num_adapters, structured) in enumerate(LOADS):
            bench = build_parser().parse_args([
                "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
                "--request-rate", rate, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--structured-fraction", str(structured), "--no-progress",
                "--seed", str(load),  # prompts of their own: no load finds another's in the prefix cache
                "--adapters", ",".join(f"ad{i}" for i in range(num_adapters))])
            s = summarize(*asyncio.run(run(bench)))
            rows.append((rate, num_adapters, structured, s))
            print(f"rate={rate} adapters={num_adapters} structured={structured:.0%}: "
                  f"{s['output_token_throughput']:.1f} tok/s, failed {s['failed_requests']}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"\n{args.num_prompts} prompts, ~{args.input_len} prompt words, {args.output_len} output tokens, "
          f"max_loras={args.max_loras or 'derived'}, 64 adapters registered\n")
    print("| rate (req/s) | adapters | structured | ok/failed | req/s | out tok/s | TTFT mean / p99 ms "
          "| TPOT mean ms | ITL p99 ms | E2E mean ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rate, num_adapters, structured, s in rows:
        print(f"| {rate} | {num_adapters} | {structured:.0%} | {s['successful_requests']}/{s['failed_requests']} "
              f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} "
              f"| {s['mean_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | {s['mean_tpot_ms']:.0f} "
              f"| {s['p99_itl_ms']:.0f} | {s['mean_e2el_ms']:.0f} |")


if __name__ == "__main__":
    main()
