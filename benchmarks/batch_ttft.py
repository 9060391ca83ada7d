"""Batch work yields to interactive work (issue #64): an interactive chat request's time to first token on an
idle `loraplex serve`, and while a Batch API batch of --lines lines runs; the same again with the load sent
as plain concurrent chat requests (priority 0, as many at once as the batch runs), which shows what the batch
priority buys.

    python benchmarks/batch_ttft.py --lines 96 --probes 12

The default model (or --model), float32, prefix caching on: every probe is a different prompt so none hits
the cache, and the load's prompts differ from the probes'. Reports the median and max TTFT per phase and the
loaded / idle ratios (the issue's bar: the batch phase's median at most 3x the idle one's).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

import openai

log = logging.getLogger(__name__)
TOPICS = ["rivers", "volcanoes", "bridges", "owls", "glaciers", "lighthouses", "deserts", "comets", "forests",
          "harbours", "castles", "tides", "storms", "caves", "meadows", "islands"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model: str | None, batch_dir: str, extra: list[str]):
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.api.cli", "serve", *([model] if model else []), "--port", str(port),
           "--usage-db", "memory", "--dtype", "float32", "--batch-dir", batch_dir, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def ttft(client: openai.OpenAI, model: str, i: int) -> float:
    """One streamed chat request's time to its first content token, in seconds."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Probe {i}: say one word about {TOPICS[i % 16]}."}],
        max_tokens=4, temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def probes(client: openai.OpenAI, model: str, count: int, offset: int) -> list[float]:
    out = []
    for i in range(count):
        out.append(ttft(client, model, offset + i))
        time.sleep(0.2)  # probes arrive apart, as interactive users do
    return out


def batch_lines(model: str, lines: int, new_tokens: int) -> bytes:
    rows = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Document {i}: write about {TOPICS[i % 16]} "
                                                               f"number {i}."}]}} for i in range(lines)]
    return "\n".join(json.dumps(r) for r in rows).encode()


def with_batch(client: openai.OpenAI, model: str, args) -> tuple[list[float], dict]:
    upload = client.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(model, args.lines, args.new_tokens))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 2:  # running at full width
        time.sleep(0.2)
    loaded = probes(client, model, args.probes, 1000)
    done = client.batches.retrieve(batch.id).request_counts
    return loaded, {"batch_lines_done_during_probes": done.completed, "batch_lines": done.total}


def with_chat_load(client: openai.OpenAI, model: str, args) -> list[float]:
    """The same load as plain chat requests at priority 0, `--concurrency` at a time."""
    stop = threading.Event()

    def worker(k: int) -> None:
        n = 0
        while not stop.is_set():
            client.chat.completions.create(model=model, max_tokens=args.new_tokens, temperature=0,
                                           extra_body={"ignore_eos": True}, messages=[
                                               {"role": "user", "content": f"Load {k}-{n}: write about rivers."}])
            n += 1

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    try:
        return probes(client, model, args.probes, 2000)
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def summary(name: str, values: list[float], idle: float | None) -> str:
    median = statistics.median(values)
    ratio = f", {median / idle:.2f}x idle" if idle else ""
    return f"{name:>22}: median {median * 1000:7.1f} ms, max {max(values) * 1000:7.1f} ms{ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lines", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=8, help="the server's --batch-concurrency, and the "
                                                                     "chat load's concurrent requests")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe request otherwise
    import tempfile

    with tempfile.TemporaryDirectory() as folder, \
            serving(args.model, folder, ["--batch-concurrency", str(args.concurrency)]) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("LORAPLEX_API_KEY") or "none",
                               max_retries=0, timeout=600)
        model = next(m.id for m in client.models.list().data if m.parent is None)
        probes(client, model, 3, 500)  # warm-up
        idle = probes(client, model, args.probes, 0)
        loaded, counts = with_batch(client, model, args)
        chat = with_chat_load(client, model, args)
    base = statistics.median(idle)
    log.info("%s", summary("idle", idle, None))
    log.info("%s", summary(f"batch of {args.lines} running", loaded, base))
    log.info("%s", summary(f"{args.concurrency} chat requests", chat, base))
    log.info("%s", json.dumps(counts))


if __name__ == "__main__":
    main()
