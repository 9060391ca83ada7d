"""The usage ledger (#68): rows billed once by id, windows and days, the CSV adding up to the
totals; and through a real `loraplex serve`: every answered request's usage kept across a kill -9 and
a restart, read back by `GET /v1/usage` and `loraplex usage`."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sqlite3
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from live_server import ADMIN_KEY, assert_error, http
from test_serve_e2e import serving

from loraplex.api.admin.ledger import COUNTS, UsageLedger, UsageRow, parse_time
from loraplex.api.admin.usage_export import as_csv

DAY = 86400.0
T0 = parse_time("2026-03-01T12:00:00Z", "since")


def _rows() -> list[UsageRow]:
    return [UsageRow("a", T0, "acme", ("",), 1, 10, 5, 2),
            UsageRow("b", T0 + 60, "acme", ("x", "y"), 1, 7, 3),
            UsageRow("c", T0 + DAY, "", ("x",), 1, 1, 1),
            UsageRow("d", T0 + DAY, "acme", (), rate_limited=1)]


def test_rows_are_billed_once_per_id_and_summed_per_tenant_adapter_and_day(tmp_path):
    ledger = UsageLedger(str(tmp_path / "u.db"))
    ledger.record_many(_rows())
    ledger.record(_rows()[1])  # sent again (a replica's report retried): billed once
    usage = ledger.usage()
    ledger.close()
    assert usage["totals"] == {"requests": 3, "prompt_tokens": 18, "generation_tokens": 9, "reasoning_tokens": 2,
                               "rate_limited": 1}
    assert usage["tenants"] == {"acme": {"requests": 2, "prompt_tokens": 17, "generation_tokens": 8,
                                         "reasoning_tokens": 2, "rate_limited": 1}}  # '' (no tenant): totals only
    assert usage["adapters"]["x"] == {"requests": 2, "prompt_tokens": 8, "generation_tokens": 4, "reasoning_tokens": 0}
    assert usage["adapters"]["y"]["requests"] == usage["adapters"][""]["requests"] == 1  # a mix: each adapter
    assert list(usage["days"]) == ["2026-03-01", "2026-03-02"]
    assert usage["days"]["2026-03-02"]["totals"]["requests"] == 1


def test_a_window_keeps_since_and_drops_until(tmp_path):
    ledger = UsageLedger(None)
    ledger.record_many(_rows())
    assert ledger.usage(since=T0 + 60)["totals"]["requests"] == 2
    assert ledger.usage(until=T0 + 60)["totals"]["requests"] == 1
    assert ledger.usage(since=T0 + 2 * DAY)["totals"] == dict.fromkeys(COUNTS, 0)
    ledger.close()


def test_what_flush_returns_from_is_on_disk_for_another_process(tmp_path):
    path = tmp_path / "u.db"
    ledger = UsageLedger(str(path))
    ledger.record_many(_rows())
    assert ledger.flush()
    count = sqlite3.connect(path).execute("SELECT count(*) FROM usage").fetchone()[0]
    assert count == 4  # committed: no close, no checkpoint needed (WAL is read too)
    ledger.close()


def test_the_csv_lines_add_up_to_the_totals():
    lines = list(csv.DictReader(io.StringIO(as_csv(_rows()))))
    assert {(r["day"], r["tenant"], r["adapter"]) for r in lines} >= {("2026-03-01", "acme", "x+y")}
    for count in COUNTS:
        assert sum(int(r[count]) for r in lines) == sum(getattr(row, count) for row in _rows())


@pytest.mark.parametrize("value", ["yesterday", "2026-13-01", "1e400x", "nan", "inf", "1e400"])
def test_a_bad_window_is_a_clear_error(value):
    with pytest.raises(ValueError, match="since must be"):
        parse_time(value, "since")
    assert parse_time("2026-03-01", "since") == parse_time("2026-03-01T00:00:00+00:00", "since")
    assert parse_time("20260301", "since") == parse_time("2026-03-01", "since")  # a date, not seconds
    assert parse_time("2026-03-01T00:00:00z", "since") == parse_time("2026-03-01", "since")


# ---- through a real server ------------------------------------------------------------------

ACME, INITECH, LIMITED = "sk-acme-9", "sk-initech-9", "sk-limited-9"
TENANTS = {"tenants": {
    "acme": {"api_keys": [ACME], "adapters": ["acme-*"], "base_model": True},
    "initech": {"api_keys": [INITECH], "adapters": ["initech-*"], "base_model": True},
    "limited": {"api_keys": [LIMITED], "adapters": [], "base_model": True, "requests_per_minute": 2}}}


@pytest.fixture
def served_with_a_ledger(tiny_model_dir, tiny_adapters, tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps(TENANTS))
    db = tmp_path / "usage.db"
    flags = ("--dtype", "float32", "--served-model-name", "tiny", "--usage-db", str(db), "--tenants", str(tenants), "--lora-modules",
             f"acme-a={tiny_adapters[0]}", f"initech-c={tiny_adapters[2]}", "--num-kv-blocks", "128")
    return lambda: serving(tiny_model_dir, *flags, env={"LORAPLEX_ADMIN_API_KEY": ADMIN_KEY}), db


def _ask(server, key: str, model: str, stream: bool = False, **fields) -> tuple[int, dict]:
    body = {"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **fields}
    if not stream:
        return http(server, "/v1/completions", body, key=key)
    body.update(stream=True, stream_options={"include_usage": True})
    status, text = http(server, "/v1/completions", body, key=key)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return status, events[-1]  # the usage chunk


def _traffic(server) -> dict[str, dict[str, int]]:
    """Requests of three tenants, plain, streamed and mixed, and a 429: what each tenant was told it used."""
    told: dict[str, dict[str, int]] = {}
    asks = [(ACME, "tiny", False, {}), (ACME, "tiny:acme-a", True, {}), (INITECH, "tiny:initech-c", False, {}),
            (ACME, "tiny", False, {"adapters": [{"name": "acme-a", "weight": 1.0}]}),
            (LIMITED, "tiny", False, {}), (LIMITED, "tiny", True, {})]
    for key, model, stream, fields in asks:
        status, answer = _ask(server, key, model, stream, **fields)
        assert status == 200, answer
        tenant = told.setdefault(key, {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0})
        tenant["requests"] += 1
        tenant["prompt_tokens"] += answer["usage"]["prompt_tokens"]
        tenant["generation_tokens"] += answer["usage"]["completion_tokens"]
    assert_error(_ask(server, LIMITED, "tiny"), 429)
    return told


def _committed_rows(db) -> int:
    try:
        return sqlite3.connect(db).execute("SELECT count(*) FROM usage").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_usage_survives_kill_9_and_a_restart(served_with_a_ledger):
    start, db = served_with_a_ledger
    with start() as (url, proc):
        told = _traffic(SimpleNamespace(url=url))
        for _ in range(100):  # a commit follows each answer within one transaction's time
            if _committed_rows(db) == 7:
                break
            time.sleep(0.1)
        assert _committed_rows(db) == 7  # six answers and one 429
        proc.kill()  # kill -9: no drain, no close
        proc.wait(30)
    with start() as (url, _):
        usage = http(SimpleNamespace(url=url), "/v1/usage", key=ADMIN_KEY)[1]
        window = http(SimpleNamespace(url=url), f"/v1/usage?since={time.time() + 60:.0f}", key=ADMIN_KEY)[1]
        assert_error(http(SimpleNamespace(url=url), "/v1/usage?until=soon", key=ADMIN_KEY), 400, "until")
    names = {ACME: "acme", INITECH: "initech", LIMITED: "limited"}
    for key, counts in told.items():
        tenant = usage["tenants"][names[key]]
        assert {k: tenant[k] for k in counts} == counts, (key, tenant)
    assert usage["tenants"]["limited"]["rate_limited"] == 1
    assert usage["adapters"]["acme-a"]["requests"] == 2  # alone, and in the mix
    assert window["totals"]["requests"] == 0
    exported = subprocess.run([sys.executable, "-m", "loraplex.api.cli", "usage", "--usage-db", str(db),
                               "--format", "csv"], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = list(csv.DictReader(io.StringIO(exported)))
    assert sum(int(r["generation_tokens"]) for r in lines) == usage["totals"]["generation_tokens"]
    assert sum(int(r["requests"]) for r in lines) == 6


def test_a_replicas_rows_reach_the_clusters_ledger_and_wait_out_its_absence(monkeypatch):
    from loraplex.api.admin import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "RETRY_S", 0.0)
    monkeypatch.setattr(ledger_module, "AWAY_S", 0.0)
    cluster, away = UsageLedger(None), [True]

    def send(rows):
        if away[0]:
            raise ConnectionError("the catalog is restarting")
        cluster.record_many(rows)
        assert cluster.flush()

    replica = ledger_module.RemoteLedger(send, cluster.usage)
    replica.record_many(_rows()[:2])
    assert replica.flush()  # tried, failed: kept, and the waiter is not held
    assert replica.unsent and cluster.usage()["totals"]["requests"] == 0
    away[0] = False
    replica.record(_rows()[2])
    assert replica.usage()["totals"]["requests"] == 3  # the kept rows went with the next batch
    replica.close()
    cluster.close()


def test_rows_a_write_could_not_take_are_kept_for_the_next(tmp_path, monkeypatch):
    from loraplex.api.admin import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "BUSY_S", 0.0)
    path = tmp_path / "u.db"
    ledger = UsageLedger(str(path))
    blocker = sqlite3.connect(path, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the file: the ledger's write fails
    ledger.record(_rows()[0])
    ledger.flush()
    blocker.rollback()
    blocker.close()
    assert ledger.usage()["totals"]["requests"] == 1  # kept, and written by the next commit, a flush's too
    ledger.record(_rows()[1])
    assert ledger.usage()["totals"]["requests"] == 2
    ledger.close()


def test_a_write_that_raises_wakes_its_waiters_and_the_writer_goes_on(tmp_path, monkeypatch):
    ledger = UsageLedger(str(tmp_path / "u.db"))
    real, calls = ledger._write, []

    def broken_once(handle, rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("a bug in a sink")
        real(handle, rows)

    monkeypatch.setattr(ledger, "_write", broken_once)

    async def bill(row):
        ledger.record(row)
        await asyncio.wait_for(ledger.committed(), 10)  # never a hang

    asyncio.run(bill(_rows()[0]))
    asyncio.run(bill(_rows()[1]))
    assert ledger.usage()["totals"]["requests"] == 1  # the second row, written after the failure
    ledger.close()
    asyncio.run(asyncio.wait_for(ledger.committed(), 10))  # after close: nothing to wait on
    assert ledger.flush() is False


def test_reads_of_an_in_memory_ledger_never_meet_its_writer_locked():
    import threading

    ledger, done = UsageLedger(None), threading.Event()

    def bill() -> None:  # rows keep coming while the ledger is read: the writer and the reader meet
        for i in range(3000):
            ledger.record(UsageRow(f"r{i}", T0, "t", ("",), 1, 1, 1))
            if i % 50 == 0:
                ledger.flush()
        done.set()

    billing = threading.Thread(target=bill)
    billing.start()
    while not done.is_set():
        ledger.usage()  # a table lock here was an OperationalError (a 500 at /v1/usage)
    billing.join()
    assert ledger.usage()["totals"]["requests"] == 3000
    ledger.close()
