"""The tenants file and each tenant's limits (#42), without a server."""

from __future__ import annotations

import hashlib
import json

import pytest

from loraplex.api.tenancy.quotas import RateLimited, TenantLimits, TooLarge
from loraplex.api.tenancy.tenants import Tenant, TenantsError, load_tenants, parse_tenants

GOOD = {"tenants": {
    "acme": {"api_keys": ["sk-acme-1"], "adapters": ["acme-*"], "base_model": True, "requests_per_minute": 600,
             "tokens_per_minute": 200000, "max_concurrent": 32, "weight": 2},
    "globex": {"api_keys": ["sha256:" + hashlib.sha256(b"sk-globex").hexdigest()], "adapters": ["globex-*"],
               "base_model": False, "can_load_adapters": True, "adapter_root": "/srv/adapters/globex"}}}


def test_keys_plain_and_hashed_identify_their_tenant(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(GOOD))
    tenants = load_tenants(path)
    assert tenants.identify("sk-acme-1").name == "acme"
    assert tenants.identify("sk-globex").name == "globex"
    assert tenants.identify("sk-acme-2") is None and tenants.identify("") is None
    assert tenants.identify("sha256:" + hashlib.sha256(b"sk-globex").hexdigest()) is None  # the digest is no key
    acme, globex = tenants.by_name["acme"], tenants.by_name["globex"]
    assert acme.may_use(None) and not globex.may_use(None)
    assert acme.may_use("acme-support") and not acme.may_use("globex-x") and not acme.may_use("acme")
    assert acme.weight == 2.0 and acme.max_concurrent == 32 and globex.requests_per_minute is None


def test_prefix_cache_namespaces_are_the_tenants_own_unless_shared():
    data = json.loads(json.dumps(GOOD))
    data["tenants"]["globex"]["prefix_cache"] = "shared:acme"
    tenants = parse_tenants(data)
    assert tenants.by_name["acme"].cache_namespace == "tenant:acme"
    assert tenants.by_name["globex"].cache_namespace == "group:acme"  # a group named like a tenant is not it


def test_an_adapter_source_is_read_without_its_trailing_slash():
    data = json.loads(json.dumps(GOOD))
    data["tenants"]["acme"]["adapter_source"] = "s3://acme-adapters/prod/"
    tenants = parse_tenants(data)
    assert tenants.by_name["acme"].adapter_source == "s3://acme-adapters/prod"
    assert tenants.by_name["globex"].adapter_source is None


def test_toml_is_read_too(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.acme]\napi_keys = ["k1"]\nadapters = ["acme-*"]\nweight = 3\n')
    assert load_tenants(path).by_name["acme"].weight == 3.0


@pytest.mark.parametrize("change,fragment", [
    (lambda t: t["acme"].update(api_keys=[]), "tenants.acme.api_keys"),
    (lambda t: t["acme"].update(api_keys=["sha256:abc"]), "tenants.acme.api_keys[0]: sha256:"),
    (lambda t: t["acme"].update(requests_per_minute=0), "tenants.acme.requests_per_minute"),
    (lambda t: t["acme"].update(weight=-1), "tenants.acme.weight"),
    (lambda t: t["acme"].update(base_model="yes"), "tenants.acme.base_model"),
    (lambda t: t["acme"].update(quota=5), "tenants.acme: unknown field 'quota'"),
    (lambda t: t["globex"].update(adapter_root="relative/dir"), "tenants.globex.adapter_root"),
    (lambda t: t["globex"].pop("adapter_root"), "tenants.globex: can_load_adapters needs adapter_root"),
    (lambda t: t["globex"].update(api_keys=["sk-acme-1"]), "a key of tenant 'acme' too"),
    (lambda t: t["acme"].update(adapters="acme-*"), "tenants.acme.adapters"),
    (lambda t: t["acme"].update(prefix_cache="shared"), "tenants.acme.prefix_cache"),
    (lambda t: t["acme"].update(prefix_cache="shared:"), "tenants.acme.prefix_cache"),
    (lambda t: t["acme"].update(prefix_cache=" shared:x"), "tenants.acme.prefix_cache"),
    (lambda t: t["acme"].update(prefix_cache=True), "tenants.acme.prefix_cache"),
    (lambda t: t["acme"].update(adapter_source="https://bucket/x"), "tenants.acme.adapter_source"),
    (lambda t: t["acme"].update(adapter_source=["s3://bucket/x"]), "tenants.acme.adapter_source"),
])
def test_a_bad_file_names_the_entry(change, fragment):
    data = json.loads(json.dumps(GOOD))
    change(data["tenants"])
    with pytest.raises(TenantsError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_tenants(data, "t.json")


def test_unreadable_or_malformed_files(tmp_path):
    with pytest.raises(TenantsError, match="cannot be read"):
        load_tenants(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TenantsError, match="not valid JSON"):
        load_tenants(bad)
    bad.write_text('{"acme": {}}')
    with pytest.raises(TenantsError, match='one key, "tenants"'):
        load_tenants(bad)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tenant(**limits) -> Tenant:
    return Tenant("t", (b"x" * 32,), **limits)


def test_requests_per_minute_refill_and_retry_after():
    clock = Clock()
    limits, tenant = TenantLimits(clock), _tenant(requests_per_minute=2)
    limits.admit(tenant).release()
    limits.admit(tenant).release()
    with pytest.raises(RateLimited, match="2 requests per minute") as refused:
        limits.admit(tenant)
    assert refused.value.retry_after == "30"
    clock.now += 30
    limits.admit(tenant).release()


def test_tokens_are_reserved_and_the_unused_given_back():
    clock = Clock()
    limits, tenant = TenantLimits(clock), _tenant(tokens_per_minute=100, max_concurrent=4)
    first = limits.admit(tenant)
    first.reserve(60)  # prompt + max_tokens x sequences
    with pytest.raises(RateLimited, match="this call needs 50") as refused:
        limits.admit(tenant).reserve(50)  # 40 left: refused at once, its seat given back
    assert refused.value.retry_after_s == pytest.approx(10 * 60 / 100)
    assert limits.running("t") == 1
    first.use(25)  # what it was billed: 35 of its 60 come back
    first.release()
    first.release()  # once only
    second = limits.admit(tenant)
    second.reserve(75)
    second.release()
    with pytest.raises(TooLarge, match="tokens_per_minute 100") as too_large:
        limits.admit(tenant).reserve(101)  # no wait would ever let it through
    assert too_large.value.param == "max_tokens" and limits.running("t") == 0


def test_sequences_count_against_concurrency_and_requests_per_minute():
    clock = Clock()
    limits, tenant = TenantLimits(clock), _tenant(requests_per_minute=10, max_concurrent=4)
    three = limits.admit(tenant, sequences=3)
    with pytest.raises(RateLimited, match="max_concurrent"):
        limits.admit(tenant, sequences=2)
    with pytest.raises(TooLarge, match="max_concurrent 4"):
        limits.admit(tenant, sequences=5)
    three.release()
    limits.admit(tenant, sequences=4).release()  # 7 of 10 taken this minute
    with pytest.raises(RateLimited, match="10 requests per minute") as refused:
        limits.admit(tenant, sequences=4)
    assert refused.value.retry_after_s == pytest.approx(1 * 60 / 10)
    with pytest.raises(TooLarge, match="requests_per_minute 10"):
        limits.admit(_tenant(requests_per_minute=10), sequences=11)


def test_a_bucket_in_debt_refuses_new_calls_until_the_refill():
    clock = Clock()
    limits, tenant = TenantLimits(clock), _tenant(tokens_per_minute=100)
    lease = limits.admit(tenant)
    lease.reserve(10)
    lease.use(130)  # billed past its reservation (the bill is what was delivered): 100 - 130 = -30
    lease.release()
    with pytest.raises(RateLimited, match="100 tokens per minute") as refused:
        limits.admit(tenant)
    assert refused.value.retry_after_s == pytest.approx(31 * 60 / 100)
    clock.now += 19
    limits.admit(tenant).release()


def test_replicas_enforce_their_share_of_each_limit():
    limits, tenant = TenantLimits(Clock(), share=0.5), _tenant(requests_per_minute=5, max_concurrent=3)
    leases = [limits.admit(tenant), limits.admit(tenant)]  # ceil(3 / 2) at once, ceil(5 / 2) a minute
    with pytest.raises(RateLimited, match="max_concurrent"):
        limits.admit(tenant)
    for lease in leases:
        lease.release()
    limits.admit(tenant).release()
    with pytest.raises(RateLimited, match="3 requests per minute"):
        limits.admit(tenant)


def test_a_call_larger_than_a_replicas_share_waits_for_a_full_bucket_then_runs():
    """Behind a Ray ingress each replica holds a part of each limit; a call within the tenant's limit but past
    that part is no 400: it runs once nothing else holds the replica's part."""
    clock = Clock()
    limits = TenantLimits(clock, share=0.25)
    tenant = _tenant(max_concurrent=4, tokens_per_minute=1000, requests_per_minute=8)  # 1, 250 and 2 here
    big = limits.admit(tenant, sequences=2)
    with pytest.raises(RateLimited, match="max_concurrent"):
        limits.admit(tenant)
    big.reserve(300)  # more than the 250 here, within the 1000 of the file
    big.use(300)
    big.release()
    clock.now += 60
    with pytest.raises(TooLarge, match="tokens_per_minute 1000"):
        limits.admit(tenant).reserve(1001)
    with pytest.raises(TooLarge, match="max_concurrent 4"):
        limits.admit(tenant, sequences=5)
