"""The object-storage store and its disk cache against a real S3-compatible server (moto's, on 127.0.0.1): fetch
on first use, single flight, the size bound, a restart, a changed object, a broken download, a stopped store."""

import threading

import pytest

from loraplex.api.sources.adapter_cache import AdapterCache
from loraplex.api.sources.adapter_store import AdapterStore
from loraplex.api.sources.s3_source import StoreError, parse_url, valid_name
from s3_server import S3Server

BUCKET, PREFIX = "adapters", "team/prod"
URL = f"s3://{BUCKET}/{PREFIX}"


def never_busy(entry):
    return False


@pytest.fixture
def s3(tiny_adapters):
    server = S3Server()
    for i in range(4):
        server.put_adapter(BUCKET, PREFIX, f"a{i}", tiny_adapters[i])
    yield server
    server.stop()


def store_for(s3, folder, max_bytes=1 << 30, ttl_s=300.0, attempts=2) -> AdapterStore:
    return AdapterStore(AdapterCache(folder, max_bytes), (URL,), s3.url, timeout_s=5, max_attempts=attempts,
                        ttl_s=ttl_s)


def test_urls_and_names_are_checked():
    assert parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert parse_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("s3:/x", "http://bucket/p", "s3://B/p", "s3://"):
        with pytest.raises(ValueError):
            parse_url(bad)
    assert valid_name("acme-support-v3") and not valid_name("../x") and not valid_name("a/b") and not valid_name("")


def test_first_use_downloads_then_the_cache_serves(s3, tmp_path):
    store = store_for(s3, tmp_path)
    first = store.fetch("a0", (URL,), never_busy)
    assert first.downloaded and sorted(p.name for p in first.folder.iterdir()) == \
        ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert s3.gets("a0/") == 2  # one GET per object
    again = store.fetch("a0", (URL,), never_busy)
    assert not again.downloaded and again.folder == first.folder and s3.gets("a0/") == 2
    assert store.fetch("missing", (URL,), never_busy) is None
    assert store.fetch("../a0", (URL,), never_busy) is None
    assert store.counts["cache_hits"] == 1 and store.counts["cache_misses"] == 1 and store.counts["downloads"] == 1


def test_concurrent_first_uses_download_once(s3, tmp_path):
    store = store_for(s3, tmp_path)
    folders, barrier = [], threading.Barrier(16)

    def fetch():
        barrier.wait()
        folders.append(store.fetch("a1", (URL,), never_busy).folder)

    threads = [threading.Thread(target=fetch) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(folders) == 16 and len(set(folders)) == 1
    assert s3.gets("a1/") == 2 and store.counts["downloads"] == 1


def test_the_size_bound_evicts_the_least_recently_used_but_never_a_busy_one(s3, tmp_path):
    one = store_for(s3, tmp_path / "probe").fetch("a0", (URL,), never_busy).folder
    size = sum(f.stat().st_size for f in one.iterdir() if f.name != "manifest.json")
    store = store_for(s3, tmp_path / "cache", max_bytes=int(2.5 * size))
    a0 = store.fetch("a0", (URL,), never_busy).folder
    a1 = store.fetch("a1", (URL,), never_busy).folder
    held = {a0}
    third = store.fetch("a2", (URL,), lambda entry: entry.folder in held)  # a0 in use: a1 goes
    assert [e.folder for e in third.evicted] == [a1] and a0.exists() and not a1.exists()
    assert store.cache.nbytes() <= 2.5 * size
    held.clear()
    fourth = store.fetch("a3", (URL,), never_busy)
    assert [e.folder for e in fourth.evicted] == [a0] and store.counts["evictions"] == 2


def test_a_restart_keeps_verified_entries_and_drops_damaged_ones(s3, tmp_path):
    store = store_for(s3, tmp_path)
    good = store.fetch("a0", (URL,), never_busy).folder
    bad = store.fetch("a1", (URL,), never_busy).folder
    (bad / "adapter_model.safetensors").write_bytes(b"damaged")
    (good.parent / ".part-leftover").mkdir()
    restarted = store_for(s3, tmp_path)
    assert restarted.cache.entry_of(good) is not None and restarted.cache.entry_of(bad) is None
    assert not bad.exists() and not (good.parent / ".part-leftover").exists()
    gets = s3.gets()
    assert not restarted.fetch("a0", (URL,), never_busy).downloaded and s3.gets() == gets  # warm: a listing only
    assert restarted.fetch("a1", (URL,), never_busy).downloaded


def test_a_changed_object_is_a_new_version_after_the_ttl(s3, tmp_path, tiny_adapters):
    store = store_for(s3, tmp_path, ttl_s=0.0)
    old = store.fetch("a0", (URL,), never_busy).folder
    assert store.current("a0", old, never_busy) is None  # unchanged: nothing to do
    s3.put_adapter(BUCKET, PREFIX, "a0", tiny_adapters[1])
    new = store.current("a0", old, never_busy)
    assert new is not None and new.downloaded and new.folder != old and new.folder.parent == old.parent
    late = store_for(s3, tmp_path / "other", ttl_s=3600)
    kept = late.fetch("a0", (URL,), never_busy).folder
    s3.put_adapter(BUCKET, PREFIX, "a0", tiny_adapters[2])
    assert late.current("a0", kept, never_busy) is None  # inside its TTL: not listed again


def test_a_broken_download_leaves_nothing_and_a_later_one_succeeds(s3, tmp_path):
    store = store_for(s3, tmp_path, attempts=1)
    s3.cut.add(f"{PREFIX}/a2/adapter_model.safetensors")
    with pytest.raises(StoreError) as info:
        store.fetch("a2", (URL,), never_busy)
    assert info.value.status == 503 and "127.0.0.1" not in info.value.reason and BUCKET not in info.value.reason
    assert not list(tmp_path.glob("*/*/*")) and store.counts["fetch_failures"] == 1
    s3.cut.clear()
    assert store.fetch("a2", (URL,), never_busy).downloaded


def test_a_stopped_store_is_a_clear_error_then_works_again(s3, tmp_path):
    store = store_for(s3, tmp_path, attempts=1)
    s3.stop()
    try:
        with pytest.raises(StoreError, match="unreachable") as info:
            store.fetch("a3", (URL,), never_busy)
        assert info.value.status == 503
    finally:
        s3.start()
    assert store.fetch("a3", (URL,), never_busy).downloaded


def test_a_store_that_does_not_answer_in_time_is_a_504(s3, tmp_path):
    store = AdapterStore(AdapterCache(tmp_path, 1 << 30), (URL,), s3.url, timeout_s=0.5, max_attempts=1)
    s3.delay_s = 1.5
    try:
        with pytest.raises(StoreError, match="in time") as info:
            store.fetch("a0", (URL,), never_busy)
        assert info.value.status == 504
    finally:
        s3.delay_s = 0.0
    assert store.fetch("a0", (URL,), never_busy).downloaded
