"""schemathesis against /openapi.json of a live server: bounded random bodies for the main
routes; none may get a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from live_server import ADMIN_KEY, USER_KEY, live  # noqa: F401 (fixtures)

ROUTES = r"^/(v1/(completions|chat/completions|models|load_lora_adapter|unload_lora_adapter)|tokenize|detokenize)$"


def test_no_server_errors(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json").include(path_regex=ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 7
    for operation in operations:
        admin = "lora_adapter" in operation.path

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {ADMIN_KEY if admin else USER_KEY}"},
                                   checks=[not_a_server_error], timeout=60)

        check()
    assert live.front.is_alive
