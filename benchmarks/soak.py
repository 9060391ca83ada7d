"""Soak: keep `loraplex serve` busy for a few minutes (bounded) with waves of streaming requests
(random adapters, 25% structured, some clients disconnecting mid-stream, a small KV pool that
forces preemption, a waiting queue small enough to reject some), sample the server's resident
memory after each wave, and fail if it keeps growing.

    .venv/bin/python benchmarks/soak.py [--minutes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from loraplex.api.bench_serve import build_parser, run
from loraplex.platform.model_store import default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import adapter_folders  # noqa: E402


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)} ([\d.e+]+)$", text, re.M)
    return float(match[1]) if match else 0.0


async def disconnecting_clients(url: str, count: int) -> int:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> int:
        try:
            stream = await client.completions.create(model=f"ad{i % 8}", prompt="Tell me a long story", max_tokens=200,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                await stream.close()  # gone after the first chunk
                return 1
        except openai.APIStatusError:  # rejected (429) before it started
            return 0
        return 0

    cut = sum(await asyncio.gather(*(one(i) for i in range(count))))
    await client.close()
    return cut


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--wave", type=int, default=40, help="requests per wave (all at once)")
    parser.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth, last third vs first")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folders = adapter_folders()
    cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", str(default_model_dir()), "--port", str(port),
           "--max-model-len", "1024", "--num-kv-blocks", "32", "--max-loras", "4", "--max-waiting-requests", "24",
           "--lora-modules", *(f"ad{i}={folders[i % len(folders)]}" for i in range(8))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    samples, served, failed, rejected, cut = [], 0, 0, 0, 0
    deadline = time.monotonic() + args.minutes * 60
    start = time.monotonic()
    try:
        while time.monotonic() < deadline:
            bench = build_parser().parse_args([
                "--base-url", url, "--num-prompts", str(args.wave), "--request-rate", "inf", "--input-len", "32",
                "--output-len", "32", "--adapters", ",".join(f"ad{i}" for i in range(8)),
                "--structured-fraction", "0.25", "--no-progress", "--seed", str(len(samples))])
            results, _ = asyncio.run(run(bench))
            served += sum(r.ok for r in results)
            rejected += sum("429" in r.error for r in results)
            failed += sum(not r.ok and "429" not in r.error for r in results)
            cut += asyncio.run(disconnecting_clients(url, 8))
            samples.append((time.monotonic() - start, rss_mib(proc.pid)))
            print(f"t={samples[-1][0]:6.0f}s rss={samples[-1][1]:7.1f} MiB served={served} rejected={rejected} "
                  f"failed={failed} disconnects={cut}", file=sys.stderr, flush=True)
        for _ in range(100):  # aborts of the last disconnects are applied between engine steps
            running = metric(url, "loraplex:num_requests_running") + metric(url, "loraplex:num_requests_waiting")
            if running == 0:
                break
            time.sleep(0.1)
        preemptions = metric(url, "loraplex:num_preemptions_total")
        health = urllib.request.urlopen(url + "/health", timeout=10).status
    finally:
        proc.terminate()
        proc.wait(60)
    third = max(1, len(samples) // 3)
    first = sorted(r for _, r in samples[:third])[third // 2]
    last = sorted(r for _, r in samples[-third:])[third // 2]
    growth = (last - first) / first
    print(f"\n{len(samples)} waves in {samples[-1][0]:.0f}s: served {served}, rejected (429) {rejected}, "
          f"failed {failed}, disconnects {cut}, preemptions {preemptions:.0f}, health {health}, "
          f"left running/waiting {running:.0f}")
    print("rss MiB over time: " + ", ".join(f"{t:.0f}s {r:.0f}" for t, r in samples))
    print(f"rss median first third {first:.1f} MiB, last third {last:.1f} MiB: growth {growth:+.1%} "
          f"(limit {args.max_growth:.0%})")
    ok = growth <= args.max_growth and failed == 0 and health == 200 and running == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
