"""The Files and Batch APIs (api/batch/): the stores' durable writes (atomic records, a torn journal line
dropped), input lines read into requests or their 400s, a runner retrying 429s and stopping at a cancel; then
through a real server and the official client: a batch of chat lines with malformed ones answered in input
order, a completions batch, listings, a cancel that keeps what finished, tenants who cannot see each other's
files or batches, uploads bounded by their own limit; and a `loraplex serve` killed with -9 mid-batch that
finishes the batch after a restart, every line answered exactly once."""

from __future__ import annotations

import asyncio
import io
import json
import time
from types import SimpleNamespace

import jsonschema
import openai
import pytest

from live_server import ADMIN_KEY, http, start_server
from test_serve_e2e import serving

ACME, GLOBEX = "sk-acme-batch", "sk-globex-batch"
TENANTS = {"tenants": {"acme": {"api_keys": [ACME], "adapters": [], "base_model": True},
                       "globex": {"api_keys": [GLOBEX], "adapters": [], "base_model": True}}}
MAX_FILE = 256 << 10


def jsonl(*lines) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def chat_line(custom_id: str, text: str, max_tokens: int = 4, **fields) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0, **fields}}


def completion_line(custom_id: str, prompt: str, max_tokens: int = 4, **fields) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}}


def finished(client, batch_id: str, polls: int = 1200, pause: float = 0.05):
    """The batch once it is no longer running (a bounded loop: a safety net, never a timing assertion)."""
    for _ in range(polls):
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(pause)
    raise AssertionError(f"batch {batch_id} still {batch.status}: {batch.request_counts}")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


# ---- the stores, the lines, the runner --------------------------------------------------------


def test_an_atomic_write_leaves_the_old_content_or_the_new_never_a_part(tmp_path):
    from loraplex.api.batch import durable

    path = tmp_path / "record.json"
    durable.write_atomically(path, [b"old"])

    def breaking():
        yield b"new, half of it"
        raise OSError("disk gone")

    with pytest.raises(OSError):
        durable.write_atomically(path, breaking())
    with pytest.raises(durable.TooLarge):
        durable.write_atomically(path, [b"x" * 10, b"y" * 10], limit=15)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary file left
    assert durable.write_atomically(path, [b"new"]) == 3 and path.read_bytes() == b"new"


def test_a_torn_last_journal_line_is_dropped_and_cut_off(tmp_path):
    from loraplex.api.batch.durable import Journal

    journal = Journal(tmp_path / "b.journal.jsonl")
    for line in (1, 3, 2):
        journal.append({"line": line, "ok": line != 3, "result": {"custom_id": f"c{line}"}})
    with open(journal.path, "ab") as out:
        out.write(b'{"line": 4, "ok": tr')  # a kill -9 in the middle of a write
    index = journal.scan()
    assert {n: ok for n, (_, ok) in index.items()} == {1: True, 3: False, 2: True}
    journal.append({"line": 4, "ok": True, "result": {"custom_id": "c4"}})  # starts on a line of its own
    index = journal.scan()
    with open(journal.path, "rb") as f:
        assert [journal.entry_at(f, index[n][0])["result"]["custom_id"] for n in (1, 2, 3, 4)] == ["c1", "c2", "c3",
                                                                                                    "c4"]


def test_the_file_store_is_read_back_and_keeps_owners_apart(tmp_path):
    from loraplex.api.batch.file_store import FileStore

    store = FileStore(tmp_path)
    kept = store.add("tenant:acme", "in.jsonl", "batch", [b"abc", b"def"])
    (tmp_path / "file-orphan.data").write_bytes(b"a crash before its record")
    again = FileStore(tmp_path)
    assert again.get("tenant:acme", kept.id) == kept and again.read(kept) == b"abcdef"
    assert again.get("tenant:globex", kept.id) is None and again.list("tenant:globex") == []
    assert not (tmp_path / "file-orphan.data").exists()
    assert not again.delete("tenant:globex", kept.id)
    assert again.delete("tenant:acme", kept.id) and FileStore(tmp_path).list("tenant:acme") == []


def test_input_lines_become_requests_or_their_400s():
    from loraplex.api.batch.batch_lines import read_lines, repeated_custom_id

    data = jsonl(chat_line("a", "hi"), b"{not json", [1, 2], {"method": "POST"},
                 {**chat_line("b", "hi"), "method": "GET"}, completion_line("c", "hi"),
                 {**chat_line("d", "hi"), "body": "text"}, chat_line("e", "hi", stream=True),
                 {**chat_line("f", "hi"), "extra": 1}) + b"\r\n\n"
    lines = read_lines(data, "/v1/chat/completions")
    assert [(line.number, line.custom_id, line.param) for line in lines] == [
        (1, "a", None), (2, None, None), (3, None, None), (4, None, "custom_id"), (5, "b", "method"),
        (6, "c", "url"), (7, "d", "body"), (8, "e", "body.stream"), (9, "f", "extra")]
    assert lines[0].problem is None and all(f"line {line.number}:" in line.problem for line in lines[1:])
    assert repeated_custom_id(lines) is None
    twice = read_lines(jsonl(chat_line("a", "x"), chat_line("b", "y"), chat_line("a", "z")), "/v1/chat/completions")
    assert "lines 1 and 3" in repeated_custom_id(twice)


def test_the_runner_retries_429s_and_a_cancel_stops_new_lines(tmp_path):
    """A fake app: the first two tries of each line are 429s (Retry-After 0), then a 200; the batch's lines are
    all answered once, none recorded as failed. A cancelled batch starts no line after the cancel and keeps the
    answers of the lines that were running."""
    from loraplex.api.batch.batch_lines import read_lines
    from loraplex.api.batch.batch_runner import BatchRunner
    from loraplex.api.batch.batch_store import BatchRecord, BatchStore
    from loraplex.api.batch.file_store import FileStore
    from loraplex.api.tenancy.callers import Caller

    tries: dict[str, int] = {}
    release = asyncio.Event()

    async def app(scope, receive, send):
        body = json.loads((await receive())["body"])
        text = body["messages"][0]["content"]
        tries[text] = tries.get(text, 0) + 1
        if text.startswith("slow"):
            await release.wait()
        status = 429 if tries[text] <= 2 and text.startswith("busy") else 200
        await send({"type": "http.response.start", "status": status, "headers": [(b"retry-after", b"0")]})
        await send({"type": "http.response.body", "body": json.dumps({"id": f"id-{text}", "text": text}).encode()})

    async def run(texts: list[str], cancel_after_start: bool = False):
        store, files = BatchStore(tmp_path / "batches"), FileStore(tmp_path / "files")
        lines = read_lines(jsonl(*(chat_line(t, t) for t in texts)), "/v1/chat/completions")
        record = BatchRecord.new("user", "/v1/chat/completions", "file-x", len(lines), None)
        await store.save(record)
        runner = BatchRunner(record, store, files, app, lambda: Caller("user"), 2, lines)
        task = asyncio.ensure_future(runner.run())
        if cancel_after_start:
            while sum(tries.get(t, 0) for t in texts) < 2:  # both workers hold a line
                await asyncio.sleep(0)
            record.enter("cancelling")
            runner.cancel()
            release.set()
        await task
        return record, files

    record, files = asyncio.run(run(["busy0", "busy1", "ok2"]))
    assert (record.status, record.completed, record.failed) == ("completed", 3, 0)
    output = [json.loads(line) for line in files.read(files.get("user", record.output_file_id)).splitlines()]
    assert [o["custom_id"] for o in output] == ["busy0", "busy1", "ok2"] and record.error_file_id is None
    assert [o["response"]["request_id"] for o in output] == ["id-busy0", "id-busy1", "id-ok2"]
    assert tries == {"busy0": 3, "busy1": 3, "ok2": 1}

    record, files = asyncio.run(run([f"slow{i}" for i in range(6)], cancel_after_start=True))
    assert (record.status, record.completed, record.total) == ("cancelled", 2, 6)
    output = [json.loads(line) for line in files.read(files.get("user", record.output_file_id)).splitlines()]
    assert [o["custom_id"] for o in output] == ["slow0", "slow1"]
    assert set(tries) == {"busy0", "busy1", "ok2", "slow0", "slow1"}  # no line started after the cancel


def test_a_batch_failed_by_a_bug_keeps_what_was_answered_and_one_server_holds_a_folder(tmp_path, monkeypatch):
    """A runner bug after lines were answered (and billed): the batch is failed, its answers in its files (a
    finished batch's journal is dropped). A second server over the same folder is refused."""
    from loraplex.api.batch.batch_lines import read_lines
    from loraplex.api.batch.batch_runner import BatchRunner
    from loraplex.api.batch.batch_store import BatchRecord, BatchStore
    from loraplex.api.batch.file_store import FileStore
    from loraplex.api.batch.service import BatchService
    from loraplex.api.server import ServerConfig
    from loraplex.api.tenancy.callers import Caller
    from loraplex.api.tenancy.tenants import TenantRegistry

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id": "x"}'})

    async def broken_finish(*args):
        raise RuntimeError("a bug")

    async def run():
        store, files = BatchStore(tmp_path / "batches"), FileStore(tmp_path / "files")
        lines = read_lines(jsonl(chat_line("a", "a"), chat_line("b", "b")), "/v1/chat/completions")
        record = BatchRecord.new("user", "/v1/chat/completions", "file-x", len(lines), None)
        runner = BatchRunner(record, store, files, app, lambda: Caller("user"), 2, lines)
        monkeypatch.setattr(runner, "_finish", broken_finish)
        await runner.run()
        return record, files

    record, files = asyncio.run(run())
    assert record.status == "failed" and record.errors[0]["code"] == "server_error"
    output = [json.loads(line) for line in files.read(files.get("user", record.output_file_id)).splitlines()]
    assert [o["custom_id"] for o in output] == ["a", "b"]

    config = ServerConfig(batch_dir=str(tmp_path / "shared"))
    first, second = BatchService(config, TenantRegistry(None)), BatchService(config, TenantRegistry(None))
    first.start(object())
    with pytest.raises(RuntimeError, match="another loraplex server"):
        second.start(object())
    asyncio.run(first.stop())
    second.start(object())  # free again once the first stopped
    asyncio.run(second.stop())


def test_an_expired_batch_answers_its_unrun_lines_as_expired(tmp_path):
    from loraplex.api.batch.batch_lines import read_lines
    from loraplex.api.batch.batch_runner import BatchRunner
    from loraplex.api.batch.batch_store import BatchRecord, BatchStore
    from loraplex.api.batch.file_store import FileStore
    from loraplex.api.tenancy.callers import Caller

    async def never_called(scope, receive, send):
        raise AssertionError("a line of an expired batch ran")

    async def run():
        store, files = BatchStore(tmp_path / "batches"), FileStore(tmp_path / "files")
        lines = read_lines(jsonl(chat_line("a", "hi"), b"[]", chat_line("b", "hi")), "/v1/chat/completions")
        record = BatchRecord.new("user", "/v1/chat/completions", "file-x", len(lines), None)
        record.expires_at = record.created_at - 1
        await store.save(record)
        await BatchRunner(record, store, files, never_called, lambda: Caller("user"), 2, lines).run()
        return record, files, store

    record, files, store = asyncio.run(run())
    assert (record.status, record.completed, record.failed, record.output_file_id) == ("expired", 0, 3, None)
    errors = [json.loads(line) for line in files.read(files.get("user", record.error_file_id)).splitlines()]
    assert [(e["custom_id"], e["error"]["code"] if e["error"] else None) for e in errors] == [
        ("a", "batch_expired"), (None, None), ("b", "batch_expired")]  # the malformed line: its own 400
    assert errors[1]["response"]["status_code"] == 400
    assert BatchStore(tmp_path / "batches").get("user", record.id).to_openai() == record.to_openai()


def test_the_batch_folder_flag_and_ray(tmp_path, monkeypatch):
    from loraplex.api.cli import build_parser
    from loraplex.api.launch import server_config

    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "cache"))
    given = server_config(build_parser().parse_args(["serve", "--batch-dir", str(tmp_path / "b" / "c")]), "/m")
    assert given.batch_dir == str(tmp_path / "b" / "c") and (tmp_path / "b" / "c").is_dir()
    assert server_config(build_parser().parse_args(["serve", "--port", "7"]), "/m").batch_dir == str(
        tmp_path / "cache" / "batches-7")
    # under Ray each replica would keep its own folder, and the ingress sends requests to any replica: off
    on_ray = server_config(build_parser().parse_args(["serve", "--ray"]), "/m")
    assert on_ray.batch_dir is None and on_ray.responses_store_max_count == 0  # stored responses too


def test_the_apis_are_off_without_a_batch_folder():
    from loraplex.api.batch.access import service_of
    from loraplex.api.errors import APIError

    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(loraplex=SimpleNamespace(batches=None))))
    with pytest.raises(APIError) as refused:
        service_of(request)
    assert refused.value.status == 403 and "--ray" in refused.value.message


# ---- through a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def batched(tiny_model_dir, tmp_path_factory):
    from loraplex.api.server import ServerConfig

    folder = tmp_path_factory.mktemp("batches")
    (folder / "tenants.json").write_text(json.dumps(TENANTS))
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), admin_api_key=ADMIN_KEY,
                          tenants_file=str(folder / "tenants.json"), batch_dir=str(folder / "store"),
                          max_request_body_bytes=64 << 10, max_file_bytes=MAX_FILE, max_batch_lines=40,
                          batch_concurrency=4)
    server = start_server(tiny_model_dir, config, num_kv_blocks=256, max_num_seqs=8)
    yield server
    server.stop()


def client_for(server, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_chat_batch_answers_every_line_in_input_order(batched):
    client = client_for(batched)
    data = jsonl(chat_line("first", "Hello world"), b'{"custom_id": "broken", "method": ',
                 chat_line("second", "The quick brown fox"), completion_line("elsewhere", "hi"),
                 {**chat_line("shapeless", "hi"), "body": ["not", "an", "object"]},
                 chat_line("refused", "hi", temperature="hot"), chat_line("streamed", "hi", stream=True),
                 chat_line("third", "Paged attention", max_tokens=6))
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.status, uploaded.bytes) == ("file", "batch", "processed",
                                                                                    len(data))
    assert uploaded.filename == "requests.jsonl" and client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == data
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.status == "in_progress" and batch.metadata == {"job": "nightly"}
    batch = finished(client, batch.id)
    assert batch.status == "completed" and batch.errors is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (8, 3, 5)
    assert None not in (batch.in_progress_at, batch.finalizing_at, batch.completed_at, batch.expires_at)
    assert batch.cancelled_at is None and batch.failed_at is None

    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert [o["custom_id"] for o in output] == ["first", "second", "third"]
    for o in output:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200 and o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    assert output[2]["response"]["body"]["usage"]["completion_tokens"] <= 6
    online = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello world"}],
                                            max_tokens=4, temperature=0)
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content

    assert [e["custom_id"] for e in errors] == [None, "elsewhere", "shapeless", "refused", "streamed"]
    assert all(e["response"]["status_code"] == 400 and e["error"] is None for e in errors)
    messages = [e["response"]["body"]["error"]["message"] for e in errors]
    assert "line 2: not valid JSON" in messages[0] and "line 4: url" in messages[1]
    assert "line 5: body" in messages[2] and "temperature" in messages[3] and "line 7: body.stream" in messages[4]
    for file_id in (batch.output_file_id, batch.error_file_id):
        assert client.files.retrieve(file_id).purpose == "batch_output"

    usage = http(batched, "/v1/usage", key=ADMIN_KEY)[1]  # billed as online calls, to the batch's tenant
    assert usage["tenants"]["acme"]["requests"] >= 4  # three lines and the online call


def test_structured_lines_hold_their_schema_on_chat_and_responses(batched):
    """Every structured answer of a batch validates (the grammar's guarantee on this path too); a line with a
    schema the grammar refuses is its online 400 in the error file."""
    client = client_for(batched)
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    text = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    respond = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                "body": {"model": "tiny", "input": f"Number {i}", "text": text, "max_output_tokens": 30,
                         "temperature": 0}} for i in range(3)]
    respond.append({**respond[0], "custom_id": "bad-schema", "body": {**respond[0]["body"], "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "many"}}}}})
    chat = [chat_line(f"c{i}", f"Number {i}", max_tokens=30, response_format=fmt) for i in range(3)]
    for endpoint, lines in (("/v1/responses", respond), ("/v1/chat/completions", chat)):
        upload = client.files.create(file=("structured.jsonl", jsonl(*lines)), purpose="batch")
        batch = finished(client, client.batches.create(input_file_id=upload.id, endpoint=endpoint,
                                                       completion_window="24h").id)
        output = lines_of(client, batch.output_file_id)
        assert [o["custom_id"] for o in output] == [line["custom_id"] for line in lines[:3]]
        for o in output:
            body = o["response"]["body"]
            text_out = body["output_text"] if endpoint == "/v1/responses" else body["choices"][0]["message"]["content"]
            jsonschema.validate(json.loads(text_out), schema)
        errors = lines_of(client, batch.error_file_id)
        assert [e["custom_id"] for e in errors] == (["bad-schema"] if endpoint == "/v1/responses" else [])
        assert all(e["response"]["status_code"] == 400 for e in errors)


def test_a_completions_batch_and_the_listings(batched):
    client = client_for(batched)
    data = jsonl(*(completion_line(f"c{i}", f"hello {i}", max_tokens=3) for i in range(3)))
    uploaded = client.files.create(file=("c.jsonl", data), purpose="batch")
    created = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
               for _ in range(2)]
    batch = finished(client, created[1].id)
    output = lines_of(client, batch.output_file_id)
    assert [o["custom_id"] for o in output] == ["c0", "c1", "c2"] and batch.error_file_id is None
    assert all(o["response"]["body"]["object"] == "text_completion" for o in output)
    finished(client, created[0].id)

    listed = [b.id for b in client.batches.list(limit=100)]
    assert listed[:2] == [created[1].id, created[0].id]  # newest first
    page = client.batches.list(limit=1, after=created[1].id)
    assert [b.id for b in page.data] == [created[0].id] and page.has_more == (len(listed) > 2)
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert batch.output_file_id in [f.id for f in client.files.list(purpose="batch_output")]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_what_a_batch_is_refused_for(batched):
    client = client_for(batched)
    good = client.files.create(file=("g.jsonl", jsonl(chat_line("a", "hi"))), purpose="batch")
    twice = client.files.create(file=("t.jsonl", jsonl(chat_line("a", "hi"), chat_line("a", "ho"))), purpose="batch")
    many = client.files.create(file=("m.jsonl", jsonl(*(chat_line(f"x{i}", "hi") for i in range(41)))),
                               purpose="batch")
    cases = [({"input_file_id": good.id, "endpoint": "/v1/embeddings"}, 400, "endpoint"),
             ({"input_file_id": good.id, "completion_window": "48h"}, 400, "completion_window"),
             ({"input_file_id": twice.id}, 400, "input_file_id"),
             ({"input_file_id": many.id}, 400, "input_file_id"),
             ({"input_file_id": "file-nope"}, 404, "input_file_id")]
    answers = []
    for fields, status, param in cases:
        body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
        code, answer = http(batched, "/v1/batches", body, key=ACME)
        assert (code, answer["error"]["param"]) == (status, param), answer
        answers.append(answer["error"]["message"])
    assert "lines 1 and 2" in answers[2] and "max_batch_lines" in answers[3]
    lone = (b'{"input_file_id": "%s", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
            b'"metadata": {"k": "\\ud800"}}' % good.id.encode())
    assert http(batched, "/v1/batches", raw=lone, key=ACME)[0] == 400
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("f.jsonl", b"{}\n"), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    assert http(batched, "/v1/batches", key=None)[0] == 401


def test_uploads_are_bounded_by_the_file_limit_not_the_body_limit(batched):
    client = client_for(batched)
    line = json.dumps(chat_line("p", "x" * 1000)).encode() + b"\n"
    bigger_than_a_body = line * ((100 << 10) // len(line))  # over max_request_body_bytes (64 KiB)
    assert client.files.create(file=("big.jsonl", bigger_than_a_body), purpose="batch").bytes == len(bigger_than_a_body)
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("huge.jsonl", io.BytesIO(b"x" * (MAX_FILE + 1))), purpose="batch")
    assert refused.value.status_code == 413 and "max_file_bytes" in refused.value.message
    assert http(batched, "/v1/chat/completions", raw=b" " * (65 << 10), key=ACME)[0] == 413  # the body limit holds


def test_a_cancelled_batch_keeps_what_finished(batched):
    client = client_for(batched)
    data = jsonl(*(completion_line(f"long{i}", f"count {i}", max_tokens=96, ignore_eos=True) for i in range(30)))
    uploaded = client.files.create(file=("long.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    for _ in range(1200):
        if client.batches.retrieve(batch.id).request_counts.completed >= 1:
            break
        time.sleep(0.02)
    with pytest.raises(openai.ConflictError, match="unfinished batch"):  # its lines are read again at a restart
        client.files.delete(uploaded.id)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = finished(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None and batch.completed_at is None
    counts = batch.request_counts
    assert counts.total == 30 and 1 <= counts.completed < 30 and counts.failed == 0
    output = lines_of(client, batch.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert len(ids) == counts.completed and ids == sorted(set(ids), key=lambda i: int(i[4:]))  # input order, once
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: as it is
    assert client.files.delete(uploaded.id).deleted  # the batch is done with it


def test_a_tenant_sees_only_its_own_files_and_batches(batched):
    acme, globex = client_for(batched, ACME), client_for(batched, GLOBEX)
    uploaded = acme.files.create(file=("mine.jsonl", jsonl(chat_line("m", "hi"))), purpose="batch")
    batch = acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    attempts = [lambda: globex.files.retrieve(uploaded.id), lambda: globex.files.content(uploaded.id),
                lambda: globex.files.delete(uploaded.id), lambda: globex.batches.retrieve(batch.id),
                lambda: globex.batches.cancel(batch.id),
                lambda: globex.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        assert "globex" not in refused.value.message and "acme" not in refused.value.message
    unknown = http(batched, "/v1/batches/batch_0000", key=GLOBEX)
    theirs = http(batched, f"/v1/batches/{batch.id}", key=GLOBEX)
    assert unknown[0] == theirs[0] == 404 and theirs[1]["error"]["message"] == f"No such batch: {batch.id}"
    assert uploaded.id not in [f.id for f in globex.files.list()]
    assert batch.id not in [b.id for b in globex.batches.list()]
    admin = client_for(batched, ADMIN_KEY)  # the admin keeps its own, as anyone
    with pytest.raises(openai.NotFoundError):
        admin.batches.retrieve(batch.id)
    assert finished(acme, batch.id).status == "completed"
    response = acme.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0)
    for attempt in (lambda: globex.responses.retrieve(response.id), lambda: globex.responses.delete(response.id),
                    lambda: globex.responses.input_items.list(response.id),
                    lambda: globex.responses.create(model="tiny", input="Hi", max_output_tokens=2,
                                                    previous_response_id=response.id)):
        with pytest.raises(openai.NotFoundError):  # another tenant's stored response: as unknown
            attempt()
    assert acme.responses.retrieve(response.id).id == response.id


# ---- kill -9 and a restart ----------------------------------------------------------------------


def test_a_batch_survives_kill_9_and_finishes_after_a_restart(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    flags = ("--dtype", "float32", "--served-model-name", "tiny", "--batch-dir", str(store), "--batch-concurrency",
             "1", "--num-kv-blocks", "128")
    data = jsonl(*(completion_line(f"r{i}", f"count {i}", max_tokens=48, ignore_eos=True) for i in range(24)))
    with serving(tiny_model_dir, *flags) as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        uploaded = client.files.create(file=("r.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        for _ in range(2000):
            done = client.batches.retrieve(batch.id).request_counts.completed
            if done >= 3:
                break
            time.sleep(0.01)
        proc.kill()  # kill -9: no drain, no lifespan's end
        proc.wait(30)
    assert 3 <= done < 24
    journal = store / "batches" / f"{batch.id}.journal.jsonl"
    before = {}
    for raw in journal.read_bytes().splitlines(keepends=True):
        if raw.endswith(b"\n"):
            entry = json.loads(raw)
            before[entry["result"]["custom_id"]] = entry["result"]["response"]["request_id"]
    assert len(before) >= done
    with serving(tiny_model_dir, *flags) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        batch = finished(client, batch.id)
        output = lines_of(client, batch.output_file_id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (24, 0)
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(24)]  # each once, in input order
    answered = {o["custom_id"]: o["response"]["request_id"] for o in output}
    assert all(answered[custom_id] == request_id for custom_id, request_id in before.items())  # not run again
    assert not journal.exists()
