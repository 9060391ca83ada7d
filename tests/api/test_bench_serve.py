"""`loraplex bench serve` briefly against a live server: every metric printed, the JSON written,
adapters and structured requests mixed in."""

from __future__ import annotations

import json

import numpy as np

from live_server import USER_KEY, live  # noqa: F401 (fixture)
from loraplex.api.bench_serve import arrival_gaps
from loraplex.api.cli import main


def test_bench_serve_against_a_live_server(live, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", live.url, "--api-key", USER_KEY, "--adapters", "a0,a1",
               "--num-prompts", "12", "--request-rate", "50", "--max-concurrency", "6", "--input-len", "12",
               "--output-len", "8", "--structured-fraction", "0.25", "--save-result", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    for label in ("Successful requests", "Benchmark duration", "Request throughput", "Output token throughput",
                  "Total token throughput", "Mean TTFT", "Median TTFT", "P99 TTFT", "Mean TPOT", "P99 ITL",
                  "Median E2EL"):
        assert label in text, label
    result = json.loads(out.read_text())
    assert result["successful_requests"] == 12 and result["failed_requests"] == 0
    requests = result["requests"]
    assert {r["adapter"] for r in requests} == {"a0", "a1"}
    assert any(r["structured"] for r in requests)
    assert all(r["output_tokens"] == 8 for r in requests if not r["structured"])
    assert "api_key" not in result["settings"]
    assert result["mean_ttft_ms"] > 0 and result["output_token_throughput"] > 0


def test_bench_serve_counts_failures(live, tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", live.url + "/v1", "--api-key", USER_KEY, "--adapters", "missing",
               "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--no-progress"])
    assert rc == 1
    assert "Failed requests                         3" in capsys.readouterr().out


def test_arrivals_have_the_requested_rate():
    gaps = arrival_gaps(4000, rate=20.0, burstiness=0.5, rng=np.random.default_rng(0))
    assert abs(np.mean(gaps) - 1 / 20) < 0.005
    assert np.var(gaps) > (1 / 20) ** 2  # burstier than Poisson (variance 1/rate^2)
    assert arrival_gaps(3, float("inf"), 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
