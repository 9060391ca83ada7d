"""Issue 49: HTTP/1.1 message framing stays strict behind the connection guard, through a real server on
127.0.0.1 configured as `loraplex serve` configures uvicorn. Raw sockets, so the test controls every byte:
a request whose length is ambiguous or malformed is refused with one 400 in OpenAI's error shape and the
connection closes, so nothing smuggled after it on the connection is ever answered."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.parse

import pytest

from live_server import USER_KEY, http, start_server
from loraplex.api.server import ServerConfig

READ_TIMEOUT_S = 2.0
WAIT_S = 4.0  # longer than a refusal takes; a connection still open then was kept
AUTH = b"Authorization: Bearer " + USER_KEY.encode() + b"\r\n"
# answered only if it is parsed as a request of its own; it asks for the connection to close, so a
# server that answers it closes right after and the test does not wait for a keep-alive timeout
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Connection: close\r\n\r\n"


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), api_key=USER_KEY,
                          read_timeout_s=READ_TIMEOUT_S)
    server = start_server(tiny_model_dir, config, guarded=True, num_kv_blocks=32, max_num_seqs=4)
    yield server
    server.stop()


def exchange(server, data: bytes) -> tuple[bytes, bool]:
    """Sends `data` on a fresh connection; what came back within WAIT_S, and whether the server closed."""
    parts = urllib.parse.urlsplit(server.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=WAIT_S)
    received, deadline = b"", time.monotonic() + WAIT_S
    try:
        sock.sendall(data)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                return received, False
            except ConnectionResetError:  # closed with bytes of ours left unread
                return received, True
            if not chunk:
                return received, True
            received += chunk
        return received, False
    finally:
        sock.close()


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in `data`, in order: status, headers (lower-case names), body."""
    found = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (ln.partition(":") for ln in lines)}
        if headers.get("transfer-encoding") == "chunked":
            body, data = unchunked(data)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            body, data = data[:length], data[length:]
        else:  # the body ends where the connection does
            body, data = data, b""
        found.append((int(status_line.split()[1]), headers, body))
    return found


def unchunked(data: bytes) -> tuple[bytes, bytes]:
    body = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body, data.partition(b"\r\n")[2]  # no trailers in our responses
        body, data = body + data[:size], data[size + 2:]


def refused(server, data: bytes) -> tuple[dict[str, str], bytes]:
    """Exactly one response, a 400 that says the connection closes, and the server closed it: nothing
    sent after the refused request (SMUGGLED, where the test appends it) was read as a request."""
    received, closed = exchange(server, data)
    answers = responses(received)
    assert [status for status, _, _ in answers] == [400], received
    assert b'"object":"list"' not in received.replace(b" ", b""), received
    _, headers, body = answers[0]
    assert headers.get("connection", "").lower() == "close", headers
    assert closed, "the connection stayed open after the refusal"
    return headers, body


def assert_refused(server, data: bytes, fragment: str = "") -> dict:
    """`refused`, with a body in OpenAI's error shape that says why."""
    headers, body = refused(server, data)
    assert headers.get("content-type") == "application/json", headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400, error
    assert fragment.lower() in error["message"].lower(), error
    return error


def post(headers: bytes, body: bytes, target: bytes = b"/tokenize") -> bytes:
    return b"POST " + target + b" HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Type: application/json\r\n" \
        + headers + b"\r\n" + body


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


PROMPT = b'{"prompt": "hello"}'
COMPLETION = b'{"model": "tiny", "prompt": "hello", "max_tokens": 1}'


@pytest.mark.parametrize("framing", [
    "Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n",
    "Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n",
    "Transfer-Encoding: Chunked\r\nContent-Length: {n}\r\n",
])
def test_a_request_with_both_content_length_and_transfer_encoding_is_refused_and_nothing_smuggled(guarded, framing):
    # a front end that goes by Content-Length sees one request; the chunked reading sees two
    body = chunked(COMPLETION) + SMUGGLED
    data = post(framing.format(n=len(body)).encode(), body, b"/v1/completions")
    error = assert_refused(guarded, data, "Transfer-Encoding")
    assert "content-length" in error["message"].lower()


def test_both_framing_headers_are_refused_on_a_kept_alive_connection_too(guarded):
    # the refusal applies to every request of a connection, not only to its first
    body = chunked(PROMPT) + SMUGGLED
    first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    second = post(b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body), body)
    received, closed = exchange(guarded, first + second)
    assert [status for status, _, _ in responses(received)] == [200, 400], received
    assert closed and b'"object":"list"' not in received.replace(b" ", b"")


REFUSED = {
    "differing Content-Length headers": post(b"Content-Length: 19\r\nContent-Length: 20\r\n", PROMPT),
    "differing Content-Length values in one header": post(b"Content-Length: 19, 20\r\n", PROMPT),
    "Content-Length with a sign": post(b"Content-Length: +19\r\n", PROMPT),
    "negative Content-Length": post(b"Content-Length: -1\r\n", PROMPT),
    "Content-Length with a space inside": post(b"Content-Length: 1 9\r\n", PROMPT),
    "Content-Length in hex": post(b"Content-Length: 0x13\r\n", PROMPT),
    "Content-Length with letters": post(b"Content-Length: 19a\r\n", PROMPT),
    "Transfer-Encoding chunked, identity": post(b"Transfer-Encoding: chunked, identity\r\n", chunked(PROMPT)),
    "Transfer-Encoding gzip, chunked": post(b"Transfer-Encoding: gzip, chunked\r\n", chunked(PROMPT)),
    "Transfer-Encoding gzip": post(b"Transfer-Encoding: gzip\r\n", PROMPT),
    "Transfer-Encoding identity": post(b"Transfer-Encoding: identity\r\n", PROMPT),
    "Transfer-Encoding xchunked": post(b"Transfer-Encoding: xchunked\r\n", chunked(PROMPT)),
    "Transfer-Encoding chunked with a vertical tab": post(b"Transfer-Encoding:\x0bchunked\r\n", chunked(PROMPT)),
    "duplicate Transfer-Encoding headers": post(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
                                                chunked(PROMPT)),
    "space before the colon of Transfer-Encoding": post(b"Transfer-Encoding : chunked\r\n", chunked(PROMPT)),
    "space before the colon of Content-Length": post(b"Content-Length : 19\r\n", PROMPT),
    "tab before the colon": post(b"X-Note\t: a\r\nContent-Length: 19\r\n", PROMPT),
    "Transfer-Encoding folded onto the next line": post(b"Transfer-Encoding:\r\n chunked\r\n", chunked(PROMPT)),
    "a folded header value": post(b"X-Note: a\r\n b\r\nContent-Length: 19\r\n", PROMPT),
    "a chunk size that is not hex": post(b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + PROMPT + b"\r\n0\r\n\r\n"),
    "a negative chunk size": post(b"Transfer-Encoding: chunked\r\n", b"-13\r\n" + PROMPT + b"\r\n0\r\n\r\n"),
    "a chunk size with a 0x prefix": post(b"Transfer-Encoding: chunked\r\n", b"0x13\r\n" + PROMPT + b"\r\n0\r\n\r\n"),
    "a chunk not ended by CRLF": post(b"Transfer-Encoding: chunked\r\n", b"13\r\n" + PROMPT + b"XX0\r\n\r\n"),
    "NUL in a header value": post(b"X-Note: a\x00b\r\nContent-Length: 19\r\n", PROMPT),
    "a control character in a header value": post(b"X-Note: a\x01b\r\nContent-Length: 19\r\n", PROMPT),
    "a bare CR in a header value": post(b"X-Note: a\rb\r\nContent-Length: 19\r\n", PROMPT),
    "NUL in a header name": post(b"X-No\x00te: a\r\nContent-Length: 19\r\n", PROMPT),
    "DEL in a header value": post(b"X-Note: a\x7fb\r\nContent-Length: 19\r\n", PROMPT),
    "Transfer-Encoding in HTTP/1.0": post(b"Transfer-Encoding: chunked\r\n", chunked(PROMPT)).replace(
        b"HTTP/1.1", b"HTTP/1.0", 1),
    "a control character in a trailer": post(b"Transfer-Encoding: chunked\r\n", chunked(PROMPT)[:-2]
                                             + b"X-Trailer: a\x01b\r\n\r\n"),
    "a folded trailer": post(b"Transfer-Encoding: chunked\r\n", chunked(PROMPT)[:-2]
                             + b"X-Trailer: a\r\n b\r\n\r\n"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_malformed_framing_is_refused_and_the_connection_closed(guarded, case):
    refused(guarded, REFUSED[case] + SMUGGLED)


@pytest.mark.parametrize("case,fragment", [
    ("differing Content-Length headers", "Content-Length"),
    ("Transfer-Encoding gzip", "Transfer-Encoding"),
    ("a chunk size that is not hex", "chunk"),
    ("a folded header value", "fold"),
    ("a control character in a header value", "control character"),
])
def test_a_refusal_says_why_in_openai_error_shape(guarded, case, fragment):
    assert_refused(guarded, REFUSED[case], fragment)


def test_bare_lf_line_endings_are_not_a_way_around_the_checks(guarded):
    # h11 reads a bare LF as a line end: a request written with them is checked like any other
    body = chunked(PROMPT) + SMUGGLED
    head = b"POST /tokenize HTTP/1.1\nHost: x\nContent-Type: application/json\n" + AUTH.replace(b"\r\n", b"\n")
    data = head + b"Content-Length: %d\nTransfer-Encoding: chunked\n\n" % len(body) + body
    assert_refused(guarded, data, "Transfer-Encoding")


@pytest.mark.parametrize("framing,body", [
    (b"Content-Length: %d\r\n" % len(PROMPT), PROMPT),
    (b"Transfer-Encoding: chunked\r\n", chunked(PROMPT)),
    (b"Transfer-Encoding:   Chunked  \r\n", chunked(PROMPT)),
    (b"Content-Length: 19, 19\r\n", PROMPT),
])
def test_well_framed_requests_are_answered_and_the_connection_kept(guarded, framing, body):
    received, closed = exchange(guarded, post(framing, body) + SMUGGLED)
    answers = responses(received)
    assert [status for status, _, _ in answers] == [200, 200], received
    assert json.loads(answers[0][2])["count"] > 0
    assert json.loads(answers[1][2])["object"] == "list"
    assert closed  # by the second request's own Connection: close


def test_the_server_goes_on_after_refusals(guarded):
    for case in list(REFUSED)[:3]:
        assert_refused(guarded, REFUSED[case])
    assert http(guarded, "/health", key=None)[0] == 200


def test_a_refusal_logs_its_reason_once(guarded, caplog):
    body = chunked(PROMPT) + SMUGGLED
    with caplog.at_level(logging.INFO, logger="loraplex.api.connection_guard"):
        assert_refused(guarded, post(b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body), body))
    lines = [r.getMessage() for r in caplog.records if r.name == "loraplex.api.connection_guard"]
    assert len(lines) == 1 and "Transfer-Encoding" in lines[0], lines
