"""Adapters in object storage (issue #54): a bucket of PEFT LoRAs on the default model behind a real
S3-compatible server (moto's, in this process, on 127.0.0.1), a Zipf request stream over their names from
concurrent streaming clients, through the real server (uvicorn in a thread over the engine).

    .venv/bin/python benchmarks/adapter_store.py [--adapters 500 --requests 320 --clients 16 --zipf 1.1
                                                  --max-tokens 8 --prompt-len 16 --rounds 2]

Passes of the same adapter sequence, each on a warmed-up engine (a few base-model requests first), with prompts
new to the server (both servers get the same prompts in the passes compared):
 s3, cold cache   a fresh server, an empty disk cache: each adapter's first request lists, downloads and loads it
 folder, fresh    `--adapter-root` + `--enable-lora-resolver` over the same adapters: first uses read the folder
 s3 / folder, loaded   both servers again, every adapter named loaded: --rounds passes each, alternating
 ..., 1 client    --solo adapters outside the stream, one request at a time: the fetch or folder read and the
                  load without queueing (then the same again, loaded)
 s3, disk cache   a fresh server over the first one's disk cache: first uses list and load, nothing is downloaded
TTFT (time to the first streamed chunk) is split by whether the adapter was loaded when the request was sent: a
request is a first use when it was sent before the first request of its adapter had its first chunk (it waited
for the fetch, or for the load, like that first one). Downloads: the server's counters (/metrics) and the GETs the
store answered (counted by a middleware in front of moto's app). Throughput is compared pass by pass with the
folder's pass in the same state (loaded with loaded, fresh server with fresh server). Everything (clients, server,
store) shares this process and its cores, as a small deployment shares a host.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import logging
import os
import queue
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import numpy as np  # noqa: E402

log = logging.getLogger("adapter_store")
BUCKET, PREFIX = "bench", "adapters"
SOURCE = f"s3://{BUCKET}/{PREFIX}"
SERVED = "smol"
FILES = ("adapter_config.json", "adapter_model.safetensors")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
STORE_COUNTS = ("downloads", "download_bytes", "cache_hits", "cache_misses", "fetch_failures", "evictions")


# ---- adapters ----------------------------------------------------------------------------------------------


def write_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` rank-`rank` LoRAs on q_proj and v_proj: one through peft, the others its tensors re-drawn with
    their own seeds (same keys, shapes and scale), so writing hundreds takes seconds."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    first = out / name_of(0)
    peft_model.save_pretrained(first)
    del peft_model, model
    tensors = load_file(first / "adapter_model.safetensors")
    folders = [first]
    for i in range(1, count):
        folder = out / name_of(i)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(first / "adapter_config.json", folder / "adapter_config.json")
        g = torch.Generator().manual_seed(i)
        save_file({k: torch.randn(v.shape, generator=g) * v.std() for k, v in tensors.items()},
                  folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders


def name_of(i: int) -> str:
    return f"lora-{i:03d}"


# ---- the object store ----------------------------------------------------------------------------------------


class CountingStore:
    """moto's S3 app behind a middleware counting what it answers: object GETs and listings."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        for key, value in CREDENTIALS.items():  # the server's boto3 reads them from the AWS chain, as in production
            os.environ.setdefault(key, value)
        self.app = DomainDispatcherApplication(create_backend_app)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server = make_server("127.0.0.1", 0, self, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def __call__(self, environ, start_response):
        method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
        kind = "LIST" if "list-type" in query else method
        with self._lock:
            self.counts[kind] += 1
        return self.app(environ, start_response)

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)

    def upload(self, folders: list[Path]) -> None:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.url)
        s3.create_bucket(Bucket=BUCKET)

        def put(folder: Path) -> None:
            for file in FILES:
                s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{folder.name}/{file}", Body=(folder / file).read_bytes())

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, folders))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---- the server ----------------------------------------------------------------------------------------------


@dataclass
class Server:
    port: int
    front: object  # AsyncEngine
    uvicorn_server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(60)
        self.front.shutdown()


def start_server(model_dir: Path, config, max_num_seqs: int) -> Server:
    """The app `loraplex serve` builds, under uvicorn in a thread, on a free port."""
    import uvicorn

    from loraplex.api.server import build_app
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.llm_engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max_num_seqs))
    front = AsyncEngine(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(front, config), log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return Server(sock.getsockname()[1], front, server, thread)


def store_counts(port: int) -> Counter[str]:
    """The adapter store's counters from /metrics (empty for a server without object storage)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    counts = Counter()
    for name in STORE_COUNTS:
        match = re.search(rf"^loraplex:adapter_store_{name}_total (\S+)$", text, re.M)
        if match:
            counts[name] = int(float(match.group(1)))
    return counts


# ---- load ----------------------------------------------------------------------------------------------------


@dataclass
class Result:
    adapter: str
    sent: float = 0.0
    first: float = 0.0  # when the first chunk came (0: none)
    done: float = 0.0
    tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.sent


@dataclass
class Pass:
    label: str
    results: list[Result]
    wall_s: float
    store: Counter[str] = field(default_factory=Counter)  # the server's counters, this pass's share
    wire: Counter[str] = field(default_factory=Counter)  # what the object store answered, this pass's share


def stream_once(conn: http.client.HTTPConnection, body: bytes, result: Result) -> None:
    result.sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        result.error = f"{resp.status}: {resp.read()[:200]!r}"
        return
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and not result.first:
            result.first = time.perf_counter()
        if chunk.get("usage"):
            result.tokens = chunk["usage"]["completion_tokens"]
    result.done = time.perf_counter()
    if not result.first or not result.tokens:
        result.error = "no chunk or no usage in the stream"


def run_pass(port: int, stream: list[tuple[str | None, list[int]]], clients: int, max_tokens: int) -> tuple[
        list[Result], float]:
    """`stream` (adapter name or None for the base model, prompt ids) sent in order by `clients` threads, each as
    soon as its previous request has finished."""
    todo: queue.Queue = queue.Queue()
    results = [Result(adapter or "") for adapter, _ in stream]
    for i, item in enumerate(stream):
        todo.put((i, item))

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        while True:
            try:
                i, (adapter, prompt) = todo.get_nowait()
            except queue.Empty:
                break
            body = json.dumps({"model": f"{SERVED}:{adapter}" if adapter else SERVED, "prompt": prompt,
                               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            try:
                stream_once(conn, body, results[i])
            except (OSError, http.client.HTTPException, ValueError) as exc:
                results[i].error = f"{type(exc).__name__}: {exc}"[:200]
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def measure(label: str, port: int, stream, args, store: CountingStore, clients: int | None = None) -> Pass:
    before, wire = store_counts(port), store.snapshot()
    results, wall = run_pass(port, stream, clients or args.clients, args.max_tokens)
    after = store_counts(port)
    failed = [r for r in results if r.error]
    if failed:
        log.warning("%s: %d of %d requests failed, e.g. %s", label, len(failed), len(results), failed[0].error)
    done = Pass(label, results, wall, after - before, store.snapshot() - wire)
    ttfts = [r.ttft for r in results if not r.error]
    log.info("%s: %d requests in %.1f s, %.1f tok/s, TTFT p50 %.0f ms, p99 %.0f ms", label, len(results), wall,
             rates(done)[1], pct(ttfts, 50) * 1e3, pct(ttfts, 99) * 1e3)
    return done


def merged(label: str, runs: list[Pass]) -> Pass:
    """Several passes as one: their requests together over their summed time."""
    return Pass(label, [r for p in runs for r in p.results], sum(p.wall_s for p in runs),
                sum((p.store for p in runs), Counter()), sum((p.wire for p in runs), Counter()))


def warm_up(port: int, args) -> None:
    """A few base-model requests, so no pass pays the engine's first steps."""
    run_pass(port, prompted([None] * args.clients, args, 0), args.clients, args.max_tokens)


def make_stream(args) -> list[str]:
    """Zipf(s) adapter names, rank 1 the most requested, the ranks shuffled over the names."""
    rng = np.random.default_rng(args.seed)
    weights = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    names = rng.permutation(args.adapters)
    return [name_of(int(names[k])) for k in rng.choice(args.adapters, size=args.requests, p=weights / weights.sum())]


def prompted(names: list[str | None], args, seed: int) -> list[tuple[str | None, list[int]]]:
    """`names` with random short prompts of their own: a pass given a new seed finds none of its prompts in a
    server's prefix cache, and two servers given the same seed do the same work."""
    rng = np.random.default_rng([args.seed, seed])
    return [(name, rng.integers(100, 49000, size=args.prompt_len).tolist()) for name in names]


# ---- report --------------------------------------------------------------------------------------------------


def split_ttft(p: Pass) -> tuple[list[float], list[float]]:
    """TTFTs of first uses (sent before their adapter's first request had its first chunk) and the rest; on a
    server that has every adapter loaded already, all are the rest."""
    results = p.results
    if "loaded" in p.label:
        return [], [r.ttft for r in results if not r.error]
    ready: dict[str, float] = {}
    for r in sorted((r for r in results if not r.error), key=lambda r: r.sent):
        ready.setdefault(r.adapter, r.first)
    first_use, loaded = [], []
    for r in results:
        if not r.error:
            (first_use if r.sent < ready[r.adapter] else loaded).append(r.ttft)
    return first_use, loaded


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def ttft_cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{pct(values, 50) * 1e3:.0f} / {pct(values, 99) * 1e3:.0f} ({len(values)})"


def rates(p: Pass) -> tuple[float, float]:
    ok = [r for r in p.results if not r.error]
    return len(ok) / p.wall_s, sum(r.tokens for r in ok) / p.wall_s


def table(passes: dict[str, Pass], against: dict[str, str]) -> str:
    rows = ["| pass | ok / sent | TTFT p50 / p99 ms, first use (n) | TTFT p50 / p99 ms, loaded (n) | req/s | "
            "tok/s | vs folder | downloads (MiB) | store GETs / LISTs | cache hits / misses |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, p in passes.items():
        first_use, loaded = split_ttft(p)
        rps, tps = rates(p)
        ratio = f"{tps / rates(passes[against[label]])[1]:.2f}x" if label in against else "-"
        ok = sum(1 for r in p.results if not r.error)
        s3 = label.startswith("s3")
        rows.append(" | ".join([
            f"| {label}", f"{ok} / {len(p.results)}", ttft_cell(first_use), ttft_cell(loaded), f"{rps:.2f}",
            f"{tps:.1f}", ratio,
            f"{p.store['downloads']} ({p.store['download_bytes'] / 2**20:.0f})" if s3 else "-",
            f"{p.wire['GET']} / {p.wire['LIST']}" if s3 else "-",
            f"{p.store['cache_hits']} / {p.store['cache_misses']}" if s3 else "-"]) + " |")
    return "\n".join(rows)


# ---- main ----------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=500, help="adapters in the bucket")
    parser.add_argument("--requests", type=int, default=320, help="requests per pass")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the adapter popularity")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (random ids)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (q_proj, v_proj)")
    parser.add_argument("--rounds", type=int, default=2, help="loaded passes per server, alternating")
    parser.add_argument("--solo", type=int, default=8, help="adapters outside the stream, first used one at a time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="where the temporary folder of adapters and cache goes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("loraplex", "botocore", "boto3", "urllib3", "werkzeug", "moto"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from loraplex.api.server import ServerConfig
    from loraplex.platform.model_store import materialize_default_model

    started = time.perf_counter()
    model = Path(materialize_default_model())
    work = Path(tempfile.mkdtemp(prefix="loraplex-adapter-store-", dir=args.work))
    try:
        folders = write_adapters(model, work / "adapters", args.adapters, args.rank)
        log.info("%d adapters written (%.1f MiB each) in %.1f s", len(folders),
                 sum((folders[0] / f).stat().st_size for f in FILES) / 2**20, time.perf_counter() - started)
        store = CountingStore()
        mark = time.perf_counter()
        store.upload(folders)
        log.info("uploaded to %s/ in %.1f s", SOURCE, time.perf_counter() - mark)
        # moto's store (every object in memory) and what wrote the adapters are no part of a server process:
        # frozen, so the collector's full passes, which stall whichever server is serving, do not walk them
        gc.collect()
        gc.freeze()
        names = make_stream(args)
        stream = prompted(names, args, 1)  # the first passes' (a fresh server's: no prefix cache to find)
        unused = sorted(set(map(name_of, range(args.adapters))) - set(names))[:args.solo]
        log.info("stream: %d requests over %d distinct adapters (Zipf s=%.2f over %d)", len(names), len(set(names)),
                 args.zipf, args.adapters)

        s3_config = ServerConfig(served_model_name=SERVED, model_path=str(model), adapter_sources=(SOURCE,),
                                 s3_endpoint_url=store.url, adapter_cache_dir=str(work / "cache"))
        folder_config = ServerConfig(served_model_name=SERVED, model_path=str(model),
                                     adapter_roots=(str(work / "adapters"),), enable_lora_resolver=True)
        passes: dict[str, Pass] = {}
        s3, folder = start_server(model, s3_config, args.clients), start_server(model, folder_config, args.clients)
        try:
            for server in (s3, folder):
                warm_up(server.port, args)
            passes["s3, cold cache"] = measure("s3, cold cache", s3.port, stream, args, store)
            passes["folder, fresh"] = measure("folder, fresh", folder.port, stream, args, store)
            # the loaded passes alternate between the servers, so both see the same drift of a shared machine
            rounds: dict[str, list[Pass]] = {"s3, loaded": [], "folder, loaded": []}
            pair = [("s3, loaded", s3), ("folder, loaded", folder)]
            for r in range(args.rounds):
                again = prompted(names, args, 3 + r)  # the same adapters, prompts new to both servers
                for label, server in (pair if r % 2 == 0 else pair[::-1]):
                    rounds[label].append(measure(f"{label} ({r + 1})", server.port, again, args, store))
            passes.update({label: merged(label, runs) for label, runs in rounds.items()})
            # first uses alone, one client: the fetch (or the folder read) and the load without queueing behind
            # other requests
            for label, server, seed in (("s3, cold cache, 1 client", s3, 1), ("folder, fresh, 1 client", folder, 1),
                                        ("s3, loaded, 1 client", s3, 2)) if unused else ():
                passes[label] = measure(label, server.port, prompted(unused, args, 100 + seed), args, store, 1)
        finally:
            s3.stop()
            folder.stop()
        restarted = start_server(model, s3_config, args.clients)  # over the disk cache the first one filled
        try:
            warm_up(restarted.port, args)
            passes["s3, disk cache"] = measure("s3, disk cache", restarted.port, stream, args, store)
        finally:
            restarted.stop()
        store.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    order = ("s3, cold cache", "s3, disk cache", "s3, loaded", "folder, fresh", "folder, loaded",
             "s3, cold cache, 1 client", "s3, loaded, 1 client", "folder, fresh, 1 client")
    passes = {label: passes[label] for label in order if label in passes}
    against = {"s3, cold cache": "folder, fresh", "s3, loaded": "folder, loaded", "s3, disk cache": "folder, fresh"}
    print(f"\n{args.requests} requests per pass, {args.clients} streaming clients, {args.max_tokens} tokens each, "
          f"Zipf s={args.zipf} over {args.adapters} rank-{args.rank} adapters; "
          f"{time.perf_counter() - started:.0f} s in all\n")
    print(table(passes, against))
    return 0


if __name__ == "__main__":
    sys.exit(main())
