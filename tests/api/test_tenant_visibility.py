"""What a tenant reads (#49): nothing computed from another tenant's traffic or state, and no server path.

Through a real server with four tenants: acme's traffic moves acme's `/v1/stats` and `/v1/adapters` only
(globex and initech, one sharing acme's `shared-*` pattern, read the same numbers before and after; the
admin still reads the server's); a tenant's in-flight counts are its own requests; an adapter unloaded
between `resolve` and the engine taking the request is the same 404 as a name never loaded, which never
lists what is loaded; a 409 for an adapter in use counts no requests; a tenant's load errors name its folders
relative to its adapter root."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from live_server import ADMIN_KEY, assert_error, http, start_server, wait_idle

ACME, GLOBEX, INITECH, UMBRELLA = "sk-acme-v", "sk-globex-v", "sk-initech-v", "sk-umbrella-v"
STATE_FIELDS = ("kv_cache_usage_perc", "max_loras")  # shared engine state: never in a tenant's stats
ROW_STATE = ("resident", "in_memory", "pinned")  # where an adapter is: moved by others' traffic


def _tenants(root) -> dict:
    return {"tenants": {
        "acme": {"api_keys": [ACME], "adapters": ["acme-*", "shared-*"]},
        "globex": {"api_keys": [GLOBEX], "adapters": ["globex-*", "shared-*"], "can_load_adapters": True,
                   "adapter_root": str(root)},
        "initech": {"api_keys": [INITECH], "adapters": ["initech-*"]},
        "umbrella": {"api_keys": [UMBRELLA], "adapters": ["umbrella-*"], "base_model": False}}}


def _broken_copies(src, root) -> None:
    """Folders in globex's root that fail to load, each for another reason."""
    def changed(name, change):
        shutil.copytree(src, root / name)
        tensors = load_file(root / name / "adapter_model.safetensors")
        change(tensors)
        save_file(tensors, root / name / "adapter_model.safetensors")

    def nan(tensors):
        key = next(k for k in tensors if "v_proj.lora_B" in k)
        tensors[key][0, :2] = float("nan")

    def shape(tensors):
        key = next(k for k in tensors if "q_proj.lora_B" in k)
        tensors[key] = torch.zeros(3, 5)

    changed("nan", nan)
    changed("shape", shape)
    shutil.copytree(src, root / "no-config")
    (root / "no-config" / "adapter_config.json").unlink()
    shutil.copytree(src, root / "bad-json")
    (root / "bad-json" / "adapter_config.json").write_text("{not json")
    shutil.copytree(src, root / "big-rank")
    config = json.loads((root / "big-rank" / "adapter_config.json").read_text())
    (root / "big-rank" / "adapter_config.json").write_text(json.dumps({**config, "r": 4096}))
    (root / "a-file").write_text("not a folder")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_adapters, tmp_path_factory):
    from loraplex.api.server import ServerConfig

    folder = tmp_path_factory.mktemp("visibility")
    real_root = folder / "globex-real"
    real_root.mkdir()
    shutil.copytree(tiny_adapters[3], real_root / "extra")
    _broken_copies(tiny_adapters[3], real_root)
    root = folder / "globex-root"  # as the tenants file gives it: a link; messages name the resolved folder
    root.symlink_to(real_root)
    server_root = folder / "server-root"  # the admin's own adapter root, a placeholder to tenants
    server_root.mkdir()
    path = folder / "tenants.json"
    path.write_text(json.dumps(_tenants(root)))
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), admin_api_key=ADMIN_KEY,
                          tenants_file=str(path), adapter_roots=(str(server_root),))
    server = start_server(tiny_model_dir, config, {"acme-a": tiny_adapters[0], "globex-b": tiny_adapters[1],
                                                   "initech-c": tiny_adapters[2], "shared-s": tiny_adapters[4]},
                          num_kv_blocks=256, max_num_seqs=8, max_loras=4)
    server.globex_root, server.adapters = root, tiny_adapters
    yield server
    server.stop()


def _complete(server, key: str, model: str = "tiny", max_tokens: int = 3, **fields):
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    return http(server, "/v1/completions", body, key=key)


def _stats(server, key: str) -> dict:
    status, body = http(server, "/v1/stats", key=key)
    assert status == 200, body
    return body


def _rows(server, key: str) -> dict:
    status, body = http(server, "/v1/adapters", key=key)
    assert status == 200, body
    return {"": body["base"], **{row["id"]: row for row in body["data"]}}


def _still(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "time"}


# ---- class 2: nothing a tenant reads moves with another's traffic ----------------------------------------


def test_another_tenants_traffic_moves_nothing_a_tenant_reads(served):
    before = {key: (_stats(served, key), _rows(served, key)) for key in (GLOBEX, INITECH, UMBRELLA)}
    acme, acme_rows, admin = _stats(served, ACME), _rows(served, ACME), _stats(served, ADMIN_KEY)
    served_tokens = 0
    for fields in ({}, {"model": "acme-a"}, {"model": "tiny:shared-s"},
                   {"adapters": [{"name": "acme-a", "weight": 0.5}, {"name": "shared-s", "weight": 0.5}]}):
        status, body = _complete(served, ACME, max_tokens=4, **fields)
        assert status == 200, body
        served_tokens += body["usage"]["completion_tokens"]
    wait_idle(served.engine)
    for key, (stats, rows) in before.items():  # the base row and the shared adapter too
        assert _still(_stats(served, key)) == _still(stats), key
        assert _rows(served, key) == rows, key
    after, after_rows = _stats(served, ACME), _rows(served, ACME)
    assert after["requests"] == acme["requests"] + 4
    assert after["generation_tokens"] == acme["generation_tokens"] + served_tokens == acme["generation_tokens"] + 16
    assert after["ttft_ms"]["count"] == acme["ttft_ms"]["count"] + 4
    assert after_rows[""]["requests"] == acme_rows[""]["requests"] + 1  # a mix names the base model, not it
    assert after_rows["acme-a"]["requests"] == acme_rows["acme-a"]["requests"] + 2
    assert after_rows["shared-s"]["requests"] == acme_rows["shared-s"]["requests"] + 2
    assert after_rows["shared-s"]["generation_tokens"] == acme_rows["shared-s"]["generation_tokens"] + 8
    for stats in (after, _stats(served, GLOBEX)):
        assert not set(STATE_FIELDS) & set(stats), stats
    for row in [*after_rows.values(), *_rows(served, GLOBEX).values()]:
        assert not set(ROW_STATE) & set(row), row
    server_wide = _stats(served, ADMIN_KEY)  # the admin's view is the server's, as before
    assert server_wide["requests"] == admin["requests"] + 4 and set(STATE_FIELDS) <= set(server_wide)
    assert set(ROW_STATE) <= set(_rows(served, ADMIN_KEY)["shared-s"])


@contextlib.contextmanager
def _held_engine(server, step_seconds: float):
    """The engine thread waits at its next step until `go` is set, then steps slowly."""
    go, real = threading.Event(), server.engine.step

    def step():
        go.wait(60)
        time.sleep(step_seconds)
        return real()

    server.engine.step = step
    try:
        yield go
    finally:
        go.set()
        del server.engine.step


def _until(server, key: str, check, what: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _stats(server, key)
        if check(stats):
            return stats
        time.sleep(0.02)
    raise AssertionError(f"{what}: {stats}")


def test_in_flight_counts_are_the_tenants_own_requests(served):
    wait_idle(served.engine)
    idle = {"num_requests_running": 0, "num_requests_waiting": 0, "running_adapters": [], "waiting_adapters": []}
    results = []
    with _held_engine(served, 0.05) as go:
        thread = threading.Thread(target=lambda: results.append(_complete(served, ACME, "acme-a", max_tokens=40)))
        thread.start()
        _until(served, ACME, lambda s: s["num_requests_waiting"] == 1 and s["waiting_adapters"] == ["acme-a"],
               "acme's request waiting")
        for key in (GLOBEX, INITECH):
            assert {k: _stats(served, key)[k] for k in idle} == idle
        go.set()
        _until(served, ACME, lambda s: s["num_requests_running"] == 1 and s["running_adapters"] == ["acme-a"],
               "acme's request running")
        for key in (GLOBEX, INITECH):
            assert {k: _stats(served, key)[k] for k in idle} == idle
        thread.join(60)
    assert results and results[0][0] == 200
    _until(served, ACME, lambda s: {k: s[k] for k in idle} == idle, "acme idle again")


def _race(server, when: str, name: str):
    """`name` unloaded after the API resolved it: before the input processor reads it, or before the
    engine pins it."""
    engine = server.engine
    target = engine.inputs if when == "process" else engine
    method = "process" if when == "process" else "add"
    real = getattr(target, method)

    def unloading_first(*args, **kwargs):
        with contextlib.suppress(ValueError):
            engine.adapters.unload(name)
        return real(*args, **kwargs)

    engine.adapters.load(name, str(server.adapters[5]))
    setattr(target, method, unloading_first)
    return target, method


@pytest.mark.parametrize("when", ["process", "add"])
def test_an_adapter_unloaded_mid_request_is_the_404_of_an_unknown_name(served, when):
    def raced(**fields):
        target, method = _race(served, when, "acme-gone")
        try:
            return _complete(served, ACME, **fields)
        finally:
            delattr(target, method)

    gone, never = raced(model="acme-gone"), _complete(served, ACME, "acme-never")
    assert_error(gone, 404)
    assert json.dumps(gone[1]).replace("acme-gone", "X") == json.dumps(never[1]).replace("acme-never", "X")
    assert gone[1]["error"]["param"] == "model"
    prefixed = raced(model="tiny:acme-gone"), _complete(served, ACME, "tiny:acme-never")
    assert json.dumps(prefixed[0][1]).replace("acme-gone", "X") == json.dumps(prefixed[1][1]).replace("acme-never",
                                                                                                        "X")
    mix = lambda other: [{"name": "acme-a", "weight": 0.5}, {"name": other, "weight": 0.5}]  # noqa: E731
    gone, never = raced(adapters=mix("acme-gone")), _complete(served, ACME, adapters=mix("acme-never"))
    assert_error(gone, 404)
    assert json.dumps(gone[1]).replace("acme-gone", "X") == json.dumps(never[1]).replace("acme-never", "X")
    assert gone[1]["error"]["param"] == "adapters[1].name"
    for name in ("globex-b", "initech-c", "shared-s"):  # what is loaded is never listed
        assert name not in json.dumps(gone[1])
    wait_idle(served.engine)
    assert not served.engine.adapters.num_pins()
    gc.collect()  # a refused request's timer leaves the in-flight count when dropped (api/admin/metrics.py)
    stats = _stats(served, ACME)
    assert (stats["num_requests_running"], stats["num_requests_waiting"]) == (0, 0), stats


# ---- class 3: no server path to a tenant, its own root included ------------------------------------------


ABSOLUTE = re.compile(r"(?<![\w.-])/[\w.-]")


@pytest.mark.parametrize("folder,status,names", [
    ("no-config", 400, ["no-config", "adapter_config.json is missing"]),
    ("bad-json", 400, ["bad-json", "not valid JSON"]),
    ("big-rank", 400, ["big-rank", "max_lora_rank"]),
    ("nan", 400, ["nan", "NaN"]),
    ("shape", 400, ["shape", "q_proj"]),
    ("missing", 404, ["missing"]),
    ("a-file", 404, ["a-file"]),
    ("extra/adapter_config.json", 404, ["extra/adapter_config.json"]),
    ("ABS/no-config", 400, ["no-config", "adapter_config.json is missing"]),  # its root as the tenants file says
    ("REAL/nan", 400, ["nan", "NaN"]),  # its root resolved
    ("ABS/missing", 404, ["missing"]),
])
def test_a_tenants_load_errors_name_its_folders_relative_to_its_root(served, folder, status, names):
    root = str(served.globex_root)
    lora_path = folder.replace("ABS", root).replace("REAL", os.path.realpath(root))
    body = {"lora_name": "globex-new", "lora_path": lora_path}
    refused = http(served, "/v1/load_lora_adapter", body, key=GLOBEX)
    assert_error(refused, status)
    message = refused[1]["error"]["message"]
    assert not ABSOLUTE.search(message), message
    assert os.path.realpath(root) not in message and root not in message
    for name in names:
        assert name in message, message


def test_only_the_tenants_own_root_is_relative(served):
    """Outside its root: refused without naming a folder; a folder of the server's is a placeholder."""
    from loraplex.api.tenancy.callers import Caller
    from loraplex.api.state import ServerState

    outside = http(served, "/v1/load_lora_adapter", {"lora_name": "globex-x", "lora_path": "../server-root"},
                   key=GLOBEX)
    assert_error(outside, 400, "adapter root")
    assert not ABSOLUTE.search(outside[1]["error"]["message"])
    state: ServerState = served.uvicorn_server.config.app.state.loraplex
    globex = Caller("tenant", state.tenants.current.by_name["globex"])
    server_root, real = state.config.adapter_roots[0], os.path.realpath(served.globex_root)
    text = f"{real}/nan and {served.globex_root}/extra/adapter_config.json, {server_root}/x, {real}"
    assert state.redacted(text, globex) == "nan and extra/adapter_config.json, <adapter root>/x, ."
    assert state.redacted(text) == f"{real}/nan and {served.globex_root}/extra/adapter_config.json, " \
                                   f"<adapter root>/x, {real}"  # another caller: its root is no server folder


def test_unloading_an_adapter_in_use_tells_no_count(served):
    """The requests holding a tenant's adapter may be another tenant's (a shared pattern): the 409 says so
    without counting them."""
    load = {"lora_name": "shared-g", "lora_path": "extra"}
    assert http(served, "/v1/load_lora_adapter", load, key=GLOBEX)[0] == 200
    results = []
    with _held_engine(served, 0.0) as go:
        thread = threading.Thread(target=lambda: results.append(_complete(served, ACME, "shared-g")))
        thread.start()
        deadline = time.monotonic() + 30
        while not served.engine.adapters.num_pins("shared-g") and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = http(served, "/v1/unload_lora_adapter", {"lora_name": "shared-g"}, key=GLOBEX)
        go.set()
        thread.join(60)
    assert_error(refused, 409, "in use")
    assert not re.search(r"\d", refused[1]["error"]["message"]), refused
    assert results[0][0] == 200
    wait_idle(served.engine)
    assert http(served, "/v1/unload_lora_adapter", {"lora_name": "shared-g"}, key=GLOBEX)[0] == 200
