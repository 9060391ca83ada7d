"""Adapter-affine vs round-robin routing over 2 Ray Serve replicas, one workload, one run.

    .venv/bin/python benchmarks/ray_routing.py [--adapters 16 --per-replica 8 --num-prompts 96 --rates 2 4]

Each mode starts `loraplex serve --ray --replicas 2` on the default model with the same adapters
(distinct PEFT folders, rank 16 on every projection, made once under the cache), the same LRU
bound per replica (`--max-adapters-per-replica` = `--max-cpu-loras`), then `loraplex bench serve`
sends the same requests (same seed: same arrivals, prompts and adapter per request). Each
(routing, rate) gets a fresh cluster, so no run starts with adapters another left behind. Adapter
reads per request come from the replicas' `loraplex:adapter_cache_misses_total` (`/metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from loraplex.api.bench_serve import build_parser, run, summarize
from loraplex.platform.model_store import adapters_dir, default_model_dir
from multi_lora import make_adapters


def adapter_folders(count: int) -> list[Path]:
    """`count` distinct random rank-16 LoRAs on every projection (multi_lora.py's maker), made
    once under the cache: the replicas read them from disk."""
    out = adapters_dir() / "bench-routing"
    folders = [out / f"lora-{i}" for i in range(count)]
    if not all((f / "adapter_config.json").is_file() for f in folders):
        shutil.rmtree(out, ignore_errors=True)
        folders = make_adapters(str(default_model_dir()), out, count, 16)
    return folders


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def misses(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(r"^loraplex:adapter_cache_misses_total\{[^}]*\} (\S+)$", text, re.M))


def measure(routing: str, rate: float, folders: list[Path], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", str(default_model_dir()), "--ray", "--port", str(port),
           "--replicas", "2", "--replica-cpus", "1", "--ray-routing", routing,
           "--max-adapters-per-replica", str(args.per_replica), "--max-cpu-loras", str(args.per_replica),
           "--max-loras", str(min(args.per_replica, 8)), "--max-model-len", "2048",
           "--lora-modules", *[f"{f.name}={f}" for f in folders]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("the Ray Serve app did not start")
        time.sleep(3)  # both replicas up, not just the first
        bench = build_parser().parse_args([
            "--base-url", url, "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
            "--input-len", "32", "--output-len", str(args.output_len), "--seed", "7", "--no-progress",
            "--adapters", ",".join(f.name for f in folders)])
        before = misses(url)
        result = summarize(*asyncio.run(run(bench)))
        result["reads_per_request"] = (misses(url) - before) / max(1, result["successful_requests"])
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--per-replica", type=int, default=8, help="adapters a replica keeps (LRU)")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0], help="requests per second (Poisson)")
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    folders = adapter_folders(args.adapters)
    rows = [(rate, routing, measure(routing, rate, folders, args))
            for rate in args.rates for routing in ("adapter", "round-robin")]
    print(f"\n2 replicas x 1 CPU, {args.adapters} adapters (rank 16, all projections), {args.per_replica} kept per "
          f"replica, {args.num_prompts} requests (Poisson), 32 prompt words, {args.output_len} output tokens\n")
    print("| req/s | routing | ok/failed | adapter reads / request | TTFT mean / p99 ms | out tok/s | E2E mean ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate, routing, s in rows:
        print(f"| {rate:g} | {routing} | {s['successful_requests']}/{s['failed_requests']} | {s['reads_per_request']:.2f} "
              f"| {s['mean_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | {s['output_token_throughput']:.1f} "
              f"| {s['mean_e2el_ms']:.0f} |")


if __name__ == "__main__":
    main()
