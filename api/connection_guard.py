"""The connection guard of `loraplex serve`: uvicorn's h11 protocol with the limits uvicorn lacks
(a read deadline per request, a cap on idle keep-alive connections, a bound on unsent output and a
stall timeout), configured from `ServerConfig`."""

from __future__ import annotations

import json
import logging
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from loraplex.api import openai_format as fmt
from loraplex.api.settings import ServerConfig

log = logging.getLogger(__name__)


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
      stream nobody reads holds its KV blocks and batch slot no longer."""

    limits: ServerConfig
    idle: dict  # idle keep-alive connections of this server, longest idle first

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
        if not self._receiving():
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
            self.transport.write(_timeout_response(f"the request did not arrive within {timeout:g}s "
                                                   "(read_timeout_s)"))
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


def _cancelled(timer) -> None:
    if timer is not None:
        timer.cancel()
    return None


def _peer(protocol: H11Protocol) -> str:
    return "%s:%d" % protocol.client if protocol.client else "a client"


def _timeout_response(message: str) -> bytes:
    body = json.dumps(fmt.error_body(408, message)).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))
