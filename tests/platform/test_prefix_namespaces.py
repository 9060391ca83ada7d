"""The prefix cache's namespaces (#49): a tenant's namespace and a request's `cache_salt` enter every block's
hash, so equal prompts share KV only within one namespace and under one salt; the blocks a request holds are
the same whatever its namespace."""

from __future__ import annotations

import pytest

from conftest import assert_all_blocks_free
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.core.fair_share import TenantShare

PROMPT = list(range(3, 3 + 80))  # five full blocks; a hit stops before the last token: four are found


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=256)


def _cached(llm, rid: str, tenant: TenantShare | None, salt: str | None = None) -> tuple[int, int]:
    """(prompt tokens found in the cache, blocks held while running) for one greedy request."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt=salt)
    engine.add(engine.inputs.process(rid, PROMPT, params, tenant=tenant))
    held, cached = 0, None
    while engine.has_unfinished():
        engine.step()
        held = max(held, sum(len(b) for b in engine.core.kv.req_blocks.values()))
        request = next((r for r in engine.core.scheduler.running if r.request_id == rid), None)
        cached = request.num_cached_tokens if request is not None and cached is None else cached
    assert_all_blocks_free(engine)
    return cached or 0, held


def test_equal_prompts_share_kv_only_within_a_namespace_and_salt(llm):
    acme, globex = TenantShare("acme", cache_namespace="tenant:acme"), TenantShare("globex",
                                                                                   cache_namespace="tenant:globex")
    partners = [TenantShare(n, cache_namespace="group:partners") for n in ("initech", "hooli")]
    first = _cached(llm, "acme-1", acme)
    assert first[0] == 0
    assert _cached(llm, "globex-1", globex)[0] == 0  # another tenant: nothing of acme's
    assert _cached(llm, "nobody-1", None)[0] == 0  # the server-wide namespace: nothing either
    assert _cached(llm, "acme-salted", acme, "s1")[0] == 0  # acme under a salt: another namespace
    again = _cached(llm, "acme-2", acme)
    assert again[0] == 64
    assert again[1] == first[1]  # the same blocks held: namespaces cost no memory
    assert _cached(llm, "acme-salted-2", acme, "s1")[0] == 64
    assert _cached(llm, "globex-salted", globex, "s1")[0] == 0  # a salt never crosses tenants
    _cached(llm, "initech-1", partners[0])
    assert _cached(llm, "hooli-1", partners[1])[0] == 64  # a shared group
    assert _cached(llm, "nobody-2", None)[0] == 64  # requests of nobody still share among themselves


def test_a_salt_is_a_short_non_empty_string():
    for bad in ("", "x" * 1025, 5, True):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)
