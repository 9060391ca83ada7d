"""Compile processes (grammar/compile_pool.py): `python -m loraplex.grammar.compile_worker SOCKET_FD
NICE` starts a zygote: a fresh interpreter (never a fork of the threaded server) that lowers its
CPU priority, imports the backends' modules once, reads its set-up (tokenizer, vocab size, stop
ids, backend name) and then forks one worker per request on its socket. It has a single thread
(no thread pools: OMP_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false), so forking it is safe, and a
worker starts in milliseconds instead of re-importing everything. Under `auto` torch is not
imported up front: a worker imports it only if a spec reaches xgrammar or outlines.

A worker says "ready", then compiles spec after spec with the server's chain
(grammar/compiler.py) and sends back each `Compiled` with its grammar exported (native objects
may not pickle; the server restores them: `export` / `restore` in each backend), or the error.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds

PR_SET_PDEATHSIG = 1
PRELOAD = {"llguidance": ["llguidance.hf", "loraplex.grammar.backends.llguidance_backend"],
           "xgrammar": ["xgrammar", "loraplex.grammar.backends.xgrammar_backend"],
           "outlines": ["xgrammar", "loraplex.grammar.backends.outlines_backend"],
           "auto": ["llguidance.hf", "loraplex.grammar.backends.llguidance_backend"]}


def _die_with_parent() -> None:
    """SIGKILL when the parent ends (the server for the zygote, the zygote for a worker): no
    compile outlives the server, whatever way it ends."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: closed pipes still end the loops below
        pass
    if os.getppid() != parent:
        os._exit(0)


def zygote() -> None:
    _die_with_parent()
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.nice(int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the server ends us
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they end
    control = Connection(os.dup(sock.fileno()))
    try:
        setup = control.recv()
    except EOFError:
        return
    from loraplex.grammar.backend import GrammarError
    from loraplex.grammar.compiler import SpecCompiler

    for module in PRELOAD[setup[3]]:
        importlib.import_module(module)
    compiler = SpecCompiler(*setup)
    try:  # built once, here, for every worker (the first backend tried; under auto, never torch's)
        compiler.get("llguidance" if setup[3] == "auto" else setup[3])
    except GrammarError:  # that backend cannot serve this tokenizer: each compile says so
        pass
    control.send(("ready", len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1))
    while True:
        try:
            control.recv()  # a request for one more worker; its two pipe ends follow
            inbox_fd, outbox_fd = recvfds(sock, 2)
        except (EOFError, OSError):
            return
        pid = os.fork()
        if pid == 0:
            control.close()
            sock.close()
            _die_with_parent()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                worker(Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False), compiler)
            finally:
                os._exit(0)
        os.close(inbox_fd)
        os.close(outbox_fd)
        control.send(pid)


def worker(inbox: Connection, outbox: Connection, compiler) -> None:
    from loraplex.grammar.backend import GrammarError

    compiler.on_build = lambda start: outbox.send(("building",) if start else ("built",))
    outbox.send(("ready",))
    while True:
        try:
            spec = inbox.recv()
        except EOFError:  # the server closed the pool, or is gone
            return
        try:
            compiled = compiler.compile(spec)
            compiled.grammar = compiler.get(compiled.backend).export(compiled.grammar)
            message = ("done", compiled)
        except GrammarError as exc:
            message = ("error", exc)
        except Exception as exc:  # a bug: the server sees it as one, not as a bad spec
            message = ("error", RuntimeError(f"grammar compile failed: {type(exc).__name__}: {exc}"))
        outbox.send(message)


if __name__ == "__main__":
    zygote()
