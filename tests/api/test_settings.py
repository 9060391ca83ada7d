"""Server and cluster settings come from their dataclasses' fields: the flags' defaults are the
fields' defaults (one place each), given flags arrive unchanged, keys fall back to the environment."""

from __future__ import annotations

import pytest

from loraplex.api.cli import build_parser
from loraplex.api.flags import values
from loraplex.api.launch import server_config
from loraplex.api.settings import ClusterConfig, ServerConfig


def test_flag_defaults_are_the_settings_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("LORAPLEX_API_KEY", raising=False)
    monkeypatch.delenv("LORAPLEX_ADMIN_API_KEY", raising=False)
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    args = build_parser().parse_args(["serve"])
    # the defaults resolved at start: the usage ledger's file and the batch folder, in the cache, named by the port
    assert server_config(args, "/models/m") == ServerConfig(served_model_name="m", model_path="/models/m",
                                                            usage_db=str(tmp_path / "usage-8000.db"),
                                                            batch_dir=str(tmp_path / "batches-8000"))
    assert ClusterConfig(**values(ClusterConfig, args)) == ClusterConfig()


def test_given_flags_reach_the_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_ADMIN_API_KEY", "from-env")
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    args = build_parser().parse_args([
        "serve", "--host", "0.0.0.0", "--port", "9", "--served-model-name", "base", "--api-key", "k",
        "--adapter-root", str(tmp_path), "--adapter-root", str(tmp_path), "--enable-lora-resolver",
        "--max-waiting-requests", "3", "--max-request-body-bytes", "1MiB", "--request-timeout", "2.5",
        "--shutdown-timeout", "4", "--disable-ui", "--read-timeout", "7", "--keep-alive-timeout", "2",
        "--max-idle-connections", "9", "--stream-buffer-bytes", "64KiB", "--stall-timeout", "3", "--replicas", "3", "--ray-routing", "round-robin",
        "--ray-address", "auto", "--ray-num-cpus", "5"])
    assert server_config(args, "/m") == ServerConfig(
        served_model_name="base", model_path="/m", host="0.0.0.0", port=9, api_key="k", admin_api_key="from-env",
        adapter_roots=(str(tmp_path),) * 2, enable_lora_resolver=True, max_waiting_requests=3,
        max_request_body_bytes=1 << 20, request_timeout_s=2.5, shutdown_timeout_s=4.0, enable_ui=False,
        read_timeout_s=7.0, keep_alive_timeout_s=2.0, max_idle_connections=9, stream_buffer_bytes=64 << 10,
        stall_timeout_s=3.0, usage_db=str(tmp_path / "usage-9.db"), batch_dir=str(tmp_path / "batches-9"))
    assert ClusterConfig(**values(ClusterConfig, args)) == ClusterConfig(replicas=3, routing="round-robin",
                                                                          address="auto", num_cpus=5)


def test_usage_db_memory_keeps_nothing_and_a_missing_folder_is_refused(tmp_path):
    assert server_config(build_parser().parse_args(["serve", "--usage-db", "memory"]), "/m").usage_db is None
    given = server_config(build_parser().parse_args(["serve", "--usage-db", str(tmp_path / "b.db")]), "/m")
    assert given.usage_db == str(tmp_path / "b.db")
    with pytest.raises(ValueError, match="folder does not exist"):
        server_config(build_parser().parse_args(["serve", "--usage-db", str(tmp_path / "no" / "b.db")]), "/m")


def test_a_traces_endpoint_that_is_no_http_url_is_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="otlp-traces-endpoint must be an http"):
        server_config(build_parser().parse_args(["serve", "--otlp-traces-endpoint", "127.0.0.1:4317"]), "/m")
