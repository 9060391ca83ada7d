"""`/health` is liveness, `/ready` readiness (#68): a server whose grammar compile workers are still
starting is alive but not ready, and says what it waits for; once they run, ready."""

from __future__ import annotations

import time

from live_server import assert_error, http, start_server

from loraplex.api.server import ServerConfig


def test_ready_waits_for_the_grammar_workers_and_health_does_not(tiny_model_dir):
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir))
    server = start_server(tiny_model_dir, config, num_kv_blocks=64, grammar_compile_workers=1)
    try:
        assert http(server, "/health", key=None)[0] == 200
        assert_error(http(server, "/ready", key=None), 503, "grammar compile workers are starting")
        server.engine.grammars.warm_up()  # what `loraplex serve` does at start (build_engine_client)
        for _ in range(300):
            if http(server, "/ready", key=None)[0] == 200:
                break
            time.sleep(0.1)
        assert http(server, "/ready", key=None) == (200, {"ready": True})
    finally:
        server.stop()


def test_a_failed_engine_is_neither_alive_nor_ready(tiny_model_dir):
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir))
    server = start_server(tiny_model_dir, config, num_kv_blocks=64, grammar_compile_workers=0)
    try:
        assert http(server, "/ready", key=None)[0] == 200  # no compile workers to wait for
        server.front.fail_all("the engine failed in a test")
        for path in ("/health", "/ready"):
            assert_error(http(server, path, key=None), 503)
    finally:
        server.stop()
