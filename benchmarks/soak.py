"""Soak: keep `loraplex serve` busy (bounded) with waves of streaming requests (random adapters,
25% structured, some clients disconnecting mid-stream, a small KV pool that forces preemption, a
waiting queue small enough to reject some), with faults on the way: a quarter of the way in the
server is killed with SIGKILL (with `--ray`: one engine replica) and, half way, restarted (SIGTERM,
then started again on the same usage ledger). After each wave it samples resident memory (the
server's; with `--ray`, its engine replicas' together), and fails if memory keeps growing over the
last segment, if a request fails outside the faults, or if the usage ledger lost or misbilled any
request a client was answered in full: each answered stream's `{id}-0` row must hold its tokens.

    .venv/bin/python benchmarks/soak.py [--minutes 3] [--ray]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
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


KILL_AFTER_S = 3.0  # into its wave: streams are running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`loraplex serve` (or `--ray`) as a subprocess, started again on the same port and ledger."""

    def __init__(self, ray: bool, db: Path) -> None:
        self.ray, self.port, self.proc = ray, free_port(), None
        folders = adapter_folders()
        self.cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", str(default_model_dir()), "--port",
                    str(self.port), "--max-model-len", "1024", "--num-kv-blocks", "32", "--max-loras", "4",
                    "--max-waiting-requests", "24", "--usage-db", str(db),
                    "--lora-modules", *(f"ad{i}={folders[i % len(folders)]}" for i in range(8))]
        if ray:
            self.cmd += ["--ray", "--replicas", "2", "--replica-cpus", "1"]
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            try:
                if urllib.request.urlopen(self.url + "/ready", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)

    def kill(self) -> str:
        """SIGKILL: the server, or with `--ray` one engine replica (Ray starts it again)."""
        if not self.ray:
            self.proc.kill()
            self.proc.wait(60)
            self.start()
            return "server killed (SIGKILL) and started again"
        os.kill(engine_replicas()[0], signal.SIGKILL)
        return "engine replica killed (SIGKILL)"

    def rss_mib(self) -> float:
        return sum(rss_mib(pid) for pid in engine_replicas()) if self.ray else rss_mib(self.proc.pid)


def engine_replicas() -> list[int]:
    """The engine replicas' processes (Ray titles them after their deployment)."""
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return sorted(int(line.split()[0]) for line in listing.splitlines() if "ServeReplica:loraplex:Engine" in line)


def wave(url: str, size: int, seed: int) -> tuple[list, int]:
    bench = build_parser().parse_args([
        "--base-url", url, "--num-prompts", str(size), "--request-rate", "inf", "--input-len", "32",
        "--output-len", "32", "--adapters", ",".join(f"ad{i}" for i in range(8)),
        "--structured-fraction", "0.25", "--no-progress", "--seed", str(seed)])
    results, _ = asyncio.run(run(bench))
    return results, asyncio.run(disconnecting_clients(url, 8))


def ledger_check(db: Path, answered: list) -> tuple[int, int]:
    """(lost, misbilled): answered streams without their ledger row, or with other token counts."""
    rows = {row[0]: row[1:] for row in sqlite3.connect(db).execute(
        "SELECT id, prompt_tokens, generation_tokens, requests FROM usage")}
    lost = sum(f"{r.id}-0" not in rows for r in answered)
    misbilled = sum(rows.get(f"{r.id}-0", (r.prompt_tokens, r.output_tokens, 1)) != (r.prompt_tokens, r.output_tokens, 1)
                    for r in answered)
    return lost, misbilled


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--wave", type=int, default=40, help="requests per wave (all at once)")
    parser.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth over the last segment, "
                        "its last third vs its first")
    parser.add_argument("--ray", action="store_true", help="2 Ray Serve replicas; the kill takes one replica")
    args = parser.parse_args()
    db = Path(tempfile.mkdtemp(prefix="loraplex-soak-")) / "usage.db"
    server = Server(args.ray, db)
    server.start()
    samples, answered, counts, events = [], [], {"served": 0, "failed": 0, "faulted": 0, "rejected": 0, "cut": 0}, []
    # the kill lands in the middle of a wave (requests in flight); the restart between two (a deploy)
    faults = {0.25: (server.kill, KILL_AFTER_S),
              0.5: (lambda: (server.stop(), server.start(), "server restarted (SIGTERM)")[-1], None)}
    start = time.monotonic()
    try:
        while time.monotonic() - start < args.minutes * 60:
            fault = _fault_due(faults, (time.monotonic() - start) / (args.minutes * 60), events, start)
            results, cut = wave(server.url, args.wave, len(samples))
            if fault is not None:
                fault.join()
            faulted = fault is not None  # a restart between waves must fail nothing
            answered += [r for r in results if r.ok]
            _count(counts, results, cut, faulted)
            samples.append((time.monotonic() - start, server.rss_mib(), len(events)))
            print(f"t={samples[-1][0]:6.0f}s rss={samples[-1][1]:7.1f} MiB {counts}", file=sys.stderr, flush=True)
        running = _settled(server.url)
        health = urllib.request.urlopen(server.url + "/health", timeout=10).status
    finally:
        server.stop()
    return _report(args, samples, counts, events, running, health, ledger_check(db, answered))


def _fault_due(faults: dict, done: float, events: list, start: float) -> threading.Thread | None:
    """The first fault due, run now (between waves) or on a thread after its delay (into the next wave):
    the thread to join after that wave."""
    for at in sorted(faults):
        if done >= at:
            act, delay = faults.pop(at)

            def run() -> None:
                what = act()
                events.append((time.monotonic() - start, what))
                print(f"t={events[-1][0]:6.0f}s {what}", file=sys.stderr, flush=True)

            if delay is None:
                run()
                return None
            thread = threading.Timer(delay, run)
            thread.start()
            return thread
    return None


def _count(counts: dict, results: list, cut: int, faulted: bool) -> None:
    """A wave right after a fault may lose the requests a dead replica held (503s): counted apart."""
    counts["served"] += sum(r.ok for r in results)
    counts["rejected"] += sum("429" in r.error for r in results)
    bad = sum(not r.ok and "429" not in r.error for r in results)
    counts["faulted" if faulted else "failed"] += bad
    counts["cut"] += cut


def _settled(url: str) -> float:
    running = 0.0
    for _ in range(100):  # aborts of the last disconnects are applied between engine steps
        running = metric(url, "loraplex:num_requests_running") + metric(url, "loraplex:num_requests_waiting")
        if running == 0:
            break
        time.sleep(0.1)
    return running


def _report(args, samples: list, counts: dict, events: list, running: float, health: int,
            ledger: tuple[int, int]) -> int:
    last_segment = [rss for _, rss, seen in samples if seen == len(events)]
    third = max(1, len(last_segment) // 3)
    first = sorted(last_segment[:third])[third // 2]
    last = sorted(last_segment[-third:])[third // 2]
    growth = (last - first) / first
    lost, misbilled = ledger
    print(f"\n{len(samples)} waves in {samples[-1][0]:.0f}s: {counts}, health {health}, left running/waiting "
          f"{running:.0f}")
    print("faults: " + "; ".join(f"{t:.0f}s {what}" for t, what in events))
    print("rss MiB over time: " + ", ".join(f"{t:.0f}s {r:.0f}" for t, r, _ in samples))
    print(f"rss median over the last segment: first third {first:.1f} MiB, last third {last:.1f} MiB: growth "
          f"{growth:+.1%} (limit {args.max_growth:.0%})")
    print(f"usage ledger: {counts['served']} answered streams, {lost} without their row, {misbilled} misbilled")
    ok = growth <= args.max_growth and counts["failed"] == 0 and health == 200 and running == 0 and lost == misbilled == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
