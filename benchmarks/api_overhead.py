"""The API layer's cost per call: median latency of short completions through a real server on the tiny random
model (where the HTTP path, not the model, is most of a call), without tenants (`--api-key` only) or with a
tenants file (`--tenants`: the caller is a tenant with every limit set, so each call takes and settles a lease).

    python benchmarks/api_overhead.py [--tenants] [--calls 300] [--streams 150] [--ledger-file]

`--ledger-file` keeps the usage ledger in a SQLite file as `loraplex serve` does (default here: in memory); a
commit from before the ledger ignores it.

Compare two commits side by side in ONE run, alternating: check the other commit out into a worktree and point
the `loraplex` package at it (a folder whose `loraplex/` holds that tree's `__init__.py` and links to its five
package folders) with PYTHONPATH; this script and its test helpers stay the current tree's (BENCHMARKS.md,
"Tenant isolation: the API's cost").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "api")]

KEY = "sk-bench-1"
TENANTS = {"tenants": {"bench": {"api_keys": [KEY], "requests_per_minute": 10**9, "tokens_per_minute": 10**12,
                                 "max_concurrent": 10**6},
                       "other": {"api_keys": ["sk-other"]}, "third": {"api_keys": ["sk-third"]}}}


def serve(folder: Path, tenants: bool, ledger_file: bool = False):
    from conftest import make_tiny_model
    from live_server import start_server

    from loraplex.api.server import ServerConfig

    model = make_tiny_model(folder / "tiny")
    extra = {}
    if ledger_file and "usage_db" in {f.name for f in dataclasses.fields(ServerConfig)}:
        extra["usage_db"] = str(folder / "usage.db")
    if tenants:
        (folder / "tenants.json").write_text(json.dumps(TENANTS))
        extra = {"tenants_file": str(folder / "tenants.json"), "admin_api_key": "sk-admin"}
    config = ServerConfig(served_model_name="tiny", model_path=str(model), api_key=None if tenants else KEY, **extra)
    return start_server(model, config, num_kv_blocks=256, max_num_seqs=8)


def call_s(url: str, body: dict) -> float:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", action="store_true", help="call as a tenant (a tenants file, limits set)")
    parser.add_argument("--calls", type=int, default=300, help="non-streamed calls, 1 token each")
    parser.add_argument("--streams", type=int, default=150, help="streamed calls, 8 tokens each")
    parser.add_argument("--ledger-file", action="store_true", help="the usage ledger in a file, as `serve` has it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = serve(Path(folder), args.tenants, args.ledger_file)
        try:
            body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}
            for _ in range(30):  # warm-up
                call_s(server.url, body)
            plain = [call_s(server.url, body) for _ in range(args.calls)]
            streamed = [call_s(server.url, {**body, "max_tokens": 8, "stream": True, "ignore_eos": True})
                        for _ in range(args.streams)]
        finally:
            server.stop()
    import loraplex.api.server as served

    print(json.dumps({"package": str(Path(served.__file__).resolve().parent.parent), "tenants": args.tenants,
                      "call_ms_p50": round(statistics.median(plain) * 1e3, 3),
                      "stream8_ms_p50": round(statistics.median(streamed) * 1e3, 3)}))


if __name__ == "__main__":
    main()
