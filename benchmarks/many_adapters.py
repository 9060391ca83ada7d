"""Hundreds to a thousand adapters through the server (issues: adapters at near-base speed; a thousand adapters).

Starts `loraplex serve` on the default model, registers random rank-8 PEFT adapters on every projection through
the admin endpoint, and runs one streaming workload (`loraplex bench serve`) four ways, each phase on prompts of
its own (a per-phase seed), so no phase finds another's prefixes in the cache: all base; each request on an adapter
drawn uniformly; drawn by Zipf (s = 1.1, the first adapters hottest); half base, half uniform adapters (the base
requests' TTFT beside adapters coming in). Then, with `--registry N`, a second server with N small adapters.

    .venv/bin/python benchmarks/many_adapters.py --adapters 1000 --num-prompts 128 --concurrency 32 --output-len 48

`--adapter-dir` keeps the written adapters between runs (writing a thousand takes minutes); `--server-arg` passes
a flag to the server (e.g. `--server-arg=--lora-spill-size=0`: what the CPU cache drops is parsed from its folder).
"""


from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.adapters.peft_format import module_shapes
from loraplex.api.bench_serve import build_parser, run, summarize
from loraplex.platform.model_store import default_model_dir
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.models.registry import read_model_config

SERVER_PYTHON = [sys.executable]  # `--server-python`: another interpreter (an A/B against an older tree)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int, targets=ALL) -> Path:
    """A PEFT LoRA folder with random A and B (B non-zero, so each adapter changes the output)."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            in_f, out_f = shapes[module]
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": str(default_model_dir())}))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, root: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [SERVER_PYTHON[0], "-m", "loraplex.api.cli", "serve", str(default_model_dir()), "--port", str(port),
           "--max-model-len", "2048", "--adapter-root", str(root), *extra]
    log = open(root / f"server-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(480):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start; see {root / f'server-{port}.log'}")


def register(port: int, names: list[str]) -> float:
    start = time.perf_counter()
    for name in names:
        body = json.dumps({"lora_name": name, "lora_path": name}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/load_lora_adapter", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200, resp.read()
    return time.perf_counter() - start


def rss_mib(pid: int) -> float:
    return _status_mib(pid)["VmRSS"]


def rss_parts(pid: int) -> str:
    """Resident memory split: anonymous (heap, tensors) and file-backed (the model's and adapters' mapped files)."""
    parts = _status_mib(pid)
    return f"{parts['VmRSS']:.0f} MiB ({parts['RssAnon']:.0f} anonymous, {parts['RssFile']:.0f} mapped files)"


def _status_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def phase(port: int, args, adapters: list[str], base_fraction: float, seed: int, zipf: float = 0.0) -> dict:
    bench = build_parser().parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--seed", str(seed), "--no-progress",
        "--adapters", ",".join(adapters), "--base-fraction", str(base_fraction), "--adapter-zipf", str(zipf)])
    return summarize(*asyncio.run(run(bench)))


def serving_phases(args, config: ModelConfig, root: Path) -> None:
    names = [f"ad{i}" for i in range(args.adapters)]
    t = time.perf_counter()
    for i, name in enumerate(names):
        if not (root / name / "adapter_config.json").exists():
            write_adapter(root / name, config, args.rank, seed=i)
    print(f"wrote {len(names)} adapters in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    port = free_port()
    proc = start_server(port, root, ["--max-num-seqs", str(args.concurrency), *args.server_args])
    try:
        took = register(port, names)
        print(f"registered {len(names)} adapters through the admin endpoint in {took:.1f}s; "
              f"server RSS {rss_mib(proc.pid):.0f} MiB", file=sys.stderr)
        phase(port, args, names[:4], 0.5, seed=999)  # warm-up: other prompts, both paths
        results = {}
        for label, adapters, base_fraction, seed, zipf in (
                ("base", [], 0.0, 1, 0.0), ("uniform", names, 0.0, 2, 0.0), ("zipf", names, 0.0, 3, args.zipf),
                ("mixed", names, 0.5, 4, 0.0)):
            results[label] = s = phase(port, args, adapters, base_fraction, seed, zipf)
            print(f"{label}: {s['output_token_throughput']:.1f} tok/s, failed {s['failed_requests']}", file=sys.stderr)
        rss = rss_parts(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/adapters", timeout=60) as resp:
            residency = json.loads(resp.read())
    finally:
        proc.terminate()
        proc.wait(60)
    report(args, results, rss, took, residency)


def report(args, results: dict, rss: str, took: float, residency: dict) -> None:
    base, mixed = results["base"], results["mixed"]
    tiers: dict[str, int] = {}
    for row in residency["data"]:
        tiers[row.get("tier", "?")] = tiers.get(row.get("tier", "?"), 0) + 1
    print(f"\n{args.adapters} rank-{args.rank} adapters on all seven projections, registered in {took:.0f}s; "
          f"{args.num_prompts} streaming requests per phase, {args.concurrency} concurrent, ~{args.input_len} prompt "
          f"words, {args.output_len} output tokens; server flags: {' '.join(args.server_args) or '(defaults)'}; "
          f"RSS after the phases {rss}; adapters by tier at the end {tiers}; misses "
          f"{sum(r.get('misses', 0) for r in residency['data'])}, read "
          f"{sum(r.get('bytes_read', 0) for r in residency['data']) / 2**20:.0f} MiB\n")
    print("| phase | ok/failed | out tok/s | vs base | base req TTFT mean / p50 / p99 ms "
          "| adapter req TTFT mean / p50 / p99 ms | TPOT mean ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, s in results.items():
        print(f"| {label} | {s['successful_requests']}/{s['failed_requests']} | {s['output_token_throughput']:.1f} "
              f"| {s['output_token_throughput'] / base['output_token_throughput']:.2f}x | {_ttft(s, 'base')} "
              f"| {_ttft(s, 'adapter')} | {s['mean_tpot_ms']:.0f} |")
    ratio = {label: s["output_token_throughput"] / base["output_token_throughput"] for label, s in results.items()}
    print(f"\nuniform / base: {ratio['uniform']:.2f}x; zipf / base: {ratio['zipf']:.2f}x; mixed-phase base TTFT / "
          f"base-phase TTFT: {mixed['base_mean_ttft_ms'] / base['mean_ttft_ms']:.2f}x")


def _ttft(s: dict, group: str) -> str:
    if not s[group + "_requests"]:
        return "-"
    return f"{s[group + '_mean_ttft_ms']:.0f} / {s[group + '_median_ttft_ms']:.0f} / {s[group + '_p99_ttft_ms']:.0f}"


def registry_phase(args, config: ModelConfig, root: Path) -> None:
    names = [f"r{i}" for i in range(args.registry)]
    t = time.perf_counter()
    for i, name in enumerate(names):
        write_adapter(root / name, config, 8, seed=10_000 + i, targets=("q_proj", "v_proj"))
    print(f"wrote {len(names)} rank-8 adapters in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    port = free_port()
    proc = start_server(port, root, ["--max-num-seqs", str(args.concurrency), "--lora-memory", args.registry_memory,
                                     *args.server_args])
    try:
        rss_start = rss_mib(proc.pid)
        took = register(port, names)
        rss_registered = rss_mib(proc.pid)
        s = phase(port, args, names, 0.0, seed=4)
        rss_after = rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"\n{args.registry} adapters (rank 8, q_proj + v_proj) registered in {took:.0f}s with "
          f"--lora-memory {args.registry_memory}; {args.num_prompts} requests on random ones of them: "
          f"{s['successful_requests']} ok / {s['failed_requests']} failed, {s['output_token_throughput']:.1f} tok/s; "
          f"server RSS {rss_start:.0f} MiB started, {rss_registered:.0f} MiB registered, {rss_after:.0f} MiB after")
    if s["errors"]:
        print("errors:", s["errors"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.1, help="the Zipf phase's exponent")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--server-python", default=sys.executable, help="the interpreter that runs the server")
    parser.add_argument("--adapter-dir", default=None, help="write (or reuse) the serving phases' adapters here")
    parser.add_argument("--registry", type=int, default=0, help="also register this many rank-8 adapters (e.g. 1000)")
    parser.add_argument("--registry-memory", default="512MiB", help="--lora-memory for the registry phase")
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[],
                        help="extra flag for loraplex serve (repeatable), e.g. --server-arg=--max-loras=8")
    parser.add_argument("--skip-serving", action="store_true", help="only the registry phase")
    args = parser.parse_args()
    config = read_model_config(default_model_dir())
    SERVER_PYTHON[0] = args.server_python
    with tempfile.TemporaryDirectory(prefix="loraplex-many-", dir=os.environ.get("TMPDIR")) as tmp:
        if not args.skip_serving:
            serving_phases(args, config, Path(args.adapter_dir) if args.adapter_dir else Path(tmp) / "serving")
        if args.registry:
            registry_phase(args, config, Path(tmp) / "registry")


if __name__ == "__main__":
    main()
