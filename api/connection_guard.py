"""The connection guard of `loraplex serve`: uvicorn's h11 protocol with the limits uvicorn lacks
(a read deadline per request, a cap on idle keep-alive connections, a bound on unsent output and a
stall timeout), configured from `ServerConfig`, and stricter request framing than h11's (no request
with both Content-Length and Transfer-Encoding, no folded lines or control characters in headers)."""

from __future__ import annotations

import json
import logging
import re
import socket

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from h11._receivebuffer import ReceiveBuffer
from uvicorn.protocols.http.h11_impl import H11Protocol

from loraplex.api.openai import openai_format as fmt
from loraplex.api.settings import ServerConfig

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 200  # of h11's reason for a refusal, echoed to the client (it may quote a whole header)
# control characters other than HTAB: h11 refuses NUL and whitespace ones, not the rest
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def guarded_protocol(server: ServerConfig) -> type[H11Protocol]:
    """The guarded protocol class for one server: its limits, and its own set of idle connections."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"limits": server, "idle": {}})


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the limits uvicorn lacks (it only times out idle keep-alives):
    - a request's headers and body must all arrive within read_timeout_s of its first byte (of the
      connection, for the first request), else a 408 and the connection closes: a client sending
      a byte at a time (slowloris) holds a connection for no longer;
    - at most max_idle_connections idle keep-alive connections: the longest idle one is closed;
    - at most about stream_buffer_bytes of a response wait for the client (the kernel's send
      buffer and the transport's), then writing waits: a client that takes no bytes for
      stall_timeout_s is dropped; its handler sees the disconnect and aborts its requests, so a
      stream nobody reads holds its KV blocks and batch slot no longer;
    - request framing as strict as RFC 9112 allows (`_StrictConnection`): a request h11 would
      read one way and a proxy in front another gets a 400 and the connection closes, so no second
      request can be smuggled in its body.
    Every refusal is a 400 in OpenAI's error shape (uvicorn's own is plain text)."""

    limits: ServerConfig
    idle: dict  # idle keep-alive connections of this server, longest idle first

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        size = config.h11_max_incomplete_event_size
        self.conn = _StrictConnection(h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = self._stall_timer = None
        self._unsent = 0
        half = self.limits.stream_buffer_bytes // 2
        sock = transport.get_extra_info("socket")
        if sock is not None:  # the kernel doubles what it is given, for its own bookkeeping
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, half // 2)
        transport.set_write_buffer_limits(high=half)
        self._watch_reads()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.idle.pop(self, None)
        self._read_timer = _cancelled(self._read_timer)
        self._stall_timer = _cancelled(self._stall_timer)

    def data_received(self, data: bytes) -> None:
        self.idle.pop(self, None)
        super().data_received(data)
        self._watch_reads()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        self._watch_reads()  # a pipelined request may have begun
        if self.timeout_keep_alive_task is not None:  # idle until the client's next request
            self._keep_idle()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 (or `_StrictConnection`) refused: the reason, in OpenAI's
        error shape, then the connection closes with whatever followed the request unread."""
        reason = getattr(self.conn, "refusal", None) or msg
        log.info("refused a request from %s: %s", _peer(self), reason)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # else a response is under way: only close
            self.transport.write(_error_response(400, "Bad Request", f"invalid HTTP request: {reason}"))
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unsent = self.transport.get_write_buffer_size()
        self._stall_timer = self.loop.call_later(self.limits.stall_timeout_s, self._check_stall)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall_timer = _cancelled(self._stall_timer)

    def _receiving(self) -> bool:
        """Whether a request is on its way: its body is coming, or its headers are (or, on a new
        connection, should be); uvicorn's own keep-alive timer covers a connection between requests."""
        their = self.conn.their_state
        return their is h11.SEND_BODY or (their is h11.IDLE and self.timeout_keep_alive_task is None)

    def _watch_reads(self) -> None:
        """The read deadline runs from a request's first byte to its last; bytes in between do not
        extend it."""
        if self.transport.is_closing() or not self._receiving():
            self._read_timer = _cancelled(self._read_timer)
        elif self._read_timer is None:
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or not self._receiving():
            return
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if self.flow.read_paused or answering:
            self._watch_reads()  # the server stopped reading or is answering: not the client's delay
            return
        timeout = self.limits.read_timeout_s
        log.info("closed a connection from %s: its request did not arrive within %gs", _peer(self), timeout)
        if self.conn.their_state is h11.IDLE:  # no request yet, so no handler to answer: we do
            self.transport.write(_error_response(408, "Request Timeout", f"the request did not arrive within "
                                                 f"{timeout:g}s (read_timeout_s)"))
        self.transport.close()

    def _keep_idle(self) -> None:
        self.idle[self] = None
        while len(self.idle) > self.limits.max_idle_connections:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            oldest.timeout_keep_alive_handler()  # as if its keep-alive timed out

    def _check_stall(self) -> None:
        self._stall_timer = None
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # the client takes bytes, slowly: it is reading, give it time
            self._unsent = unsent
            self._stall_timer = self.loop.call_later(self.limits.stall_timeout_s, self._check_stall)
            return
        log.warning("dropped the connection from %s: it took no bytes of its response for %gs (its requests "
                    "are aborted)", _peer(self), self.limits.stall_timeout_s)
        self.transport.abort()


class _StrictConnection(h11.Connection):
    """h11's server side, refusing what h11 accepts but a proxy may frame differently: a request
    with both Content-Length and Transfer-Encoding (h11 goes by the latter; RFC 9112 lets a server
    refuse it, and the connection must close after either way), Transfer-Encoding in HTTP/1.0 (its
    framing is faulty), folded header lines (h11 unfolds them) and control characters in header
    values. A refusal raises h11.RemoteProtocolError, as h11's own do, and is kept in `refusal`."""

    refusal: str | None = None

    def __init__(self, our_role, max_incomplete_event_size: int) -> None:
        super().__init__(our_role, max_incomplete_event_size)
        # folding is gone from the parsed headers: only the buffer's lines show it (h11's private
        # attribute; the obs-fold cases of tests/api/test_framing.py fail if it is renamed)
        self._receive_buffer = _UnfoldedBuffer()

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, (h11.Request, h11.EndOfMessage)):  # a request's headers, or its trailers
                _check_headers(event)
            return event
        except h11.RemoteProtocolError as exc:
            self.refusal = str(exc)[:MAX_REASON_CHARS]
            raise


class _UnfoldedBuffer(ReceiveBuffer):
    """h11's receive buffer, refusing header lines folded onto the next line (obs-fold): RFC 9112
    lets a server refuse them rather than unfold them, and a proxy may not unfold them alike."""

    def maybe_extract_lines(self):
        lines = super().maybe_extract_lines()
        if lines and any(line.startswith((b" ", b"\t")) for line in lines):
            raise h11.LocalProtocolError("a header line is folded onto the next one (obs-fold)")
        return lines


def _check_headers(event) -> None:
    names = set()
    for name, value in event.headers:
        if _CONTROL.search(value):
            raise h11.RemoteProtocolError(f"a control character in the {name.decode()!r} header")
        names.add(name)
    if not isinstance(event, h11.Request) or b"transfer-encoding" not in names:
        return
    if b"content-length" in names:
        raise h11.RemoteProtocolError("the request has both Content-Length and Transfer-Encoding; "
                                      "its length is ambiguous")
    if event.http_version == b"1.0":
        raise h11.RemoteProtocolError("Transfer-Encoding in an HTTP/1.0 request")


def _cancelled(timer) -> None:
    if timer is not None:
        timer.cancel()
    return None


def _peer(protocol: H11Protocol) -> str:
    return "%s:%d" % protocol.client if protocol.client else "a client"


def _error_response(status: int, phrase: str, message: str) -> bytes:
    """A whole response that closes the connection, written without h11: it is sent where h11 has
    no request to answer, or has refused one."""
    body = json.dumps(fmt.error_body(status, message)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, phrase.encode(), len(body), body))
