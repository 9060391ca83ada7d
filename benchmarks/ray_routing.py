"""Routing over Ray Serve replicas on skewed adapter traffic: round-robin vs plain affinity vs
bounded-load placement, for each replica count, one workload, one run.

    .venv/bin/python benchmarks/ray_routing.py [--adapters 64 --zipf 1.1 --replicas 2 4 \\
        --num-prompts 120 --rate 2 --per-replica 16 --output-len 16]

Each (replicas, routing) starts `loraplex serve --ray` on the default model, its replicas being
processes on this machine (one Ray CPU and one torch thread each), with the same adapters
(distinct PEFT folders, rank 16 on every projection, made once under the cache) and the same LRU
bound per replica (`--max-adapters-per-replica` = `--max-cpu-loras`); then `loraplex bench serve`
sends the same requests (same seed: Poisson arrivals, prompts, adapter per request, the adapter
drawn with Zipf popularity: the k-th most popular with weight k^-s). Routings:
- round-robin: Ray's RoundRobinRouter, adapter-blind;
- affinity: Ray's multiplexing alone (holders first, a new adapter on the replica with the fewest);
- bounded: loraplex's placement by load and bounded-load routing (`api/cluster/placement.py`).
Adapter reads per request come from the replicas' `loraplex:adapter_cache_misses_total`, tokens
served per replica from `loraplex:generation_tokens_total` (`/metrics`, by replica).
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

ROUTINGS = ("round-robin", "affinity", "bounded")
FLAG = {"round-robin": "round-robin", "affinity": "affinity", "bounded": "adapter"}  # the --ray-routing values
ZIPF_COPIES = 2000  # the adapter list bench serve draws from uniformly: names repeated by weight


def adapter_folders(count: int) -> list[Path]:
    """`count` distinct random rank-16 LoRAs on every projection (multi_lora.py's maker), made
    once under the cache: the replicas read them from disk."""
    out = adapters_dir() / "bench-routing"
    folders = [out / f"lora-{i}" for i in range(count)]
    if not all((f / "adapter_config.json").is_file() for f in folders):
        shutil.rmtree(out, ignore_errors=True)
        folders = make_adapters(str(default_model_dir()), out, count, 16)
    return folders


def zipf_names(names: list[str], s: float) -> list[str]:
    """Each name repeated in proportion to rank^-s (at least once), so a uniform pick from the
    list is a Zipf draw."""
    weights = [(k + 1) ** -s for k in range(len(names))]
    scale = ZIPF_COPIES / sum(weights)
    return [name for name, w in zip(names, weights) for _ in range(max(1, round(w * scale)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_replica(url: str, metric: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(metric)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        replica = re.search(r'replica="([^"]+)"', labels).group(1)
        out[replica] = out.get(replica, 0.0) + float(value)
    return out


def server_command(routing: str, replicas: int, port: int, folders: list[Path], args) -> list[str]:
    flags = ["serve", str(default_model_dir()), "--ray", "--port", str(port), "--replicas", str(replicas),
             "--replica-cpus", "1", "--ray-num-cpus", str(replicas),
             "--ray-routing", FLAG[routing],
             "--max-adapters-per-replica", str(args.per_replica), "--max-cpu-loras", str(args.per_replica),
             "--max-loras", str(min(args.per_replica, 8)), "--max-model-len", "2048",
             "--lora-modules", *[f"{f.name}={f}" for f in folders]]
    return [sys.executable, "-m", "loraplex.api.cli", *flags]


def wait_for_replicas(url: str, proc: subprocess.Popen, replicas: int) -> None:
    for _ in range(900):
        assert proc.poll() is None, "the Ray Serve app exited during start-up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            time.sleep(0.5)
    else:
        raise RuntimeError("the Ray Serve app did not start")
    for _ in range(240):  # every replica heard from (the catalog's heartbeats), not just the first
        if len(by_replica(url, "loraplex:num_requests_running")) >= replicas:
            break
        time.sleep(0.5)
    time.sleep(3)  # the ingress's router knows them all too


def measure(routing: str, replicas: int, folders: list[Path], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(server_command(routing, replicas, port, folders, args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        wait_for_replicas(url, proc, replicas)
        bench = build_parser().parse_args([
            "--base-url", url, "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
            "--input-len", "32", "--output-len", str(args.output_len), "--seed", "7", "--no-progress",
            "--adapters", ",".join(zipf_names([f.name for f in folders], args.zipf))])
        misses, tokens = by_replica(url, "loraplex:adapter_cache_misses_total"), by_replica(
            url, "loraplex:generation_tokens_total")
        results, duration = asyncio.run(run(bench))
        result = summarize(results, duration)
        result["first_reads"] = len({r.adapter for r in results if r.ok}) / max(1, result["successful_requests"])
        served = by_replica(url, "loraplex:generation_tokens_total")
        served = [served.get(r, 0.0) - tokens.get(r, 0.0) for r in served]
        served += [0.0] * (replicas - len(served))
        reads = sum(by_replica(url, "loraplex:adapter_cache_misses_total").values()) - sum(misses.values())
        result["reads_per_request"] = reads / max(1, result["successful_requests"])
        result["served"] = sorted(served, reverse=True)
        result["spread"] = max(served) / max(1.0, min(served))
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent s: weight of the k-th = k^-s")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    parser.add_argument("--per-replica", type=int, default=16, help="adapters a replica keeps (LRU)")
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    folders = adapter_folders(args.adapters)
    rows = []
    for replicas in args.replicas:
        for routing in args.routings:
            rows.append((replicas, routing, measure(routing, replicas, folders, args)))
            print(replicas, routing, rows[-1][2], flush=True)
    print(f"\n{args.adapters} adapters (rank 16, all projections), Zipf({args.zipf}) popularity, {args.per_replica} kept "
          f"per replica, {args.num_prompts} requests at {args.rate:g} req/s (Poisson), 32 prompt words, "
          f"{args.output_len} output tokens; replicas are processes on this machine, 1 Ray CPU each\n")
    print("| replicas | routing | ok/failed | out tok/s | TTFT p50 / p99 ms | adapter reads / request (first reads) "
          "| tokens served per replica | max/min |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for replicas, routing, s in rows:
        served = " / ".join(f"{t:.0f}" for t in s["served"])
        print(f"| {replicas} | {routing} | {s['successful_requests']}/{s['failed_requests']} "
              f"| {s['output_token_throughput']:.1f} | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} "
              f"| {s['reads_per_request']:.2f} ({s['first_reads']:.2f}) | {served} | {s['spread']:.2f} |")


if __name__ == "__main__":
    main()
