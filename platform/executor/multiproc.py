"""Tensor parallelism: `MultiprocExecutor` starts and supervises `--tensor-parallel-size` worker processes
(`platform/worker/worker.py`, `worker_main`), sends each step's `ModelInput` (built on the engine's host) to every
rank and reads rank 0's answer.

Each call goes to every worker through its own pipe and waits for every answer, watching the processes. Every
call takes part in collectives, so a rank that fails one leaves the others waiting in it: a worker that exits,
closes its pipe or answers with an error fails the call at once with `WorkerDiedError`, the other workers are
stopped, and every later call fails the same way. Nothing waits forever. The engine's adapter slots reach the
workers as changes sent with the next step, each new one with the adapter's weights as the engine's registry read
and checked them (a worker never opens an adapter folder).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import secrets
import socket
import threading
import weakref
from multiprocessing.connection import wait
from pathlib import Path

import torch

from loraplex.adapters.peft_format import AdapterError, LoRAWeights
from loraplex.adapters.registry import AdapterRegistry
from loraplex.kernels.dispatch import to_device
from loraplex.platform.device import MemorySnapshot
from loraplex.platform.distributed import create_segment
from loraplex.platform.executor.abstract import Executor, WorkerDiedError
from loraplex.platform.resolve import ResolvedConfig
from loraplex.platform.worker.cuda_graphs import Capture
from loraplex.platform.worker.model_runner import ModelInput
from loraplex.platform.worker.worker import pack_adapter, rank_device, uses_shared_memory, worker_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint takes minutes


class MultiprocExecutor(Executor):
    uses_engine_slots = False
    input_device = torch.device("cpu")  # the step's tables go down a pipe

    def __init__(self, resolved: ResolvedConfig, adapters: AdapterRegistry,
                 memory_start: MemorySnapshot | None = None) -> None:
        """`memory_start`: unused (each rank measures its own device in its own process)."""
        self.device = resolved.device
        config, size = resolved.engine, resolved.engine.tensor_parallel_size
        context = multiprocessing.get_context("spawn")  # no fork of a process holding threads and a torch pool
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns, self.procs = [], []
        self.segment = create_segment(f"loraplex-tp-{os.getpid()}-{secrets.token_hex(8)}", size) \
            if uses_shared_memory(resolved.device, resolved.kernels.dtype) else None
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.segment)  # whatever starts
        threads = max(1, torch.get_num_threads() // size)
        for rank in range(size):
            parent, child = context.Pipe()
            proc = context.Process(target=worker_main, name=f"loraplex-tp{rank}", daemon=True,
                                   args=(config, rank, size, rank_device(resolved.device, rank), init_method, child,
                                         threads, self.segment and str(self.segment)))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.lock = threading.Lock()  # one call at a time: the engine thread's, or a closing thread's
        self.dead: str | None = None
        try:
            self._gather("start", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._unlink_segment()  # every rank has it mapped: the mappings stay, the name goes
        self.slot_changes: list[tuple[int, LoRAWeights | None]] = []
        self.changes_lock = threading.Lock()  # slots are emptied from other threads too (an unload)
        adapters.slots.listen(self._slot_changed)
        adapters.verify = _refuse_vocabulary_adapters
        log.info("tensor parallelism: %d worker processes (pids %s)", size, [p.pid for p in self.procs])

    # ---- the engine's calls ------------------------------------------------------------------

    def kv_blocks(self) -> int:
        return min(self.call("kv_blocks", every=True))  # CUDA: what the fullest device leaves

    def allocate_kv(self, num_blocks: int) -> None:
        self.call("allocate_kv", num_blocks)

    def capture_graphs(self, capture: Capture | None = None) -> None:
        self.call("capture_graphs", capture)

    def execute(self, step: ModelInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The step with the slot changes since the last one (each new adapter's weights as the registry holds
        them) and its block tables as a tensor of their own; rank 0's answer."""
        with self.changes_lock:
            taken = list(self.slot_changes)
        step = dataclasses.replace(step, table=step.table.detached(), slot_changes=[
            (slot, None if weights is None else pack_adapter(weights)) for slot, weights in taken])
        logits, prompt_hidden = self.call("execute", step)
        with self.changes_lock:  # sent: what came meanwhile goes with the next step
            del self.slot_changes[:len(taken)]
        return (None if logits is None else to_device(logits, self.device),
                [to_device(hidden, self.device) for hidden in prompt_hidden])

    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        return to_device(self.call("logits", hidden.cpu(), slots), self.device)

    def _slot_changed(self, slot: int, weights: LoRAWeights | None) -> None:
        """The engine's registry put an adapter in a slot (or emptied it): the workers follow at the next step."""
        with self.changes_lock:
            self.slot_changes.append((slot, weights))

    def call(self, method: str, *args, every: bool = False):
        """Every rank runs `method(*args)`; rank 0's answer (`every`: each rank's, in rank order)."""
        with self.lock:
            if self.dead is not None:
                raise WorkerDiedError(self.dead)
            payload = pickle.dumps((method, args, every))
            try:
                for conn in self.conns:
                    conn.send_bytes(payload)
            except OSError:
                self._fail("a tensor-parallel worker's pipe is closed")
            answers = self._gather(method, None)
            return answers if every else answers[0]

    def _gather(self, method: str, timeout: float | None) -> list:
        """Every rank's answer, in rank order; the first error, closed pipe or exit fails the call."""
        answers: dict[int, object] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            ready = wait([*waiting, *sentinels], timeout)
            if not ready:
                self._fail(f"tensor-parallel workers did not answer {method} within {timeout:.0f} s")
            for item in ready:
                rank = waiting.pop(item, None)
                if rank is None:
                    rank = sentinels.pop(item)
                    if rank in waiting.values():
                        self._fail(self._exited(rank, method))
                    continue
                answers[rank] = self._answer(item, rank, method)
        return [answers[rank] for rank in range(len(self.conns))]

    def _answer(self, conn, rank: int, method: str):
        try:
            status, reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # a worker's pipe closes as it exits
            self._fail(self._exited(rank, method))
        if status == "error":  # the others may wait in a collective for this one: stop them all
            self._fail(f"{method} failed on tensor-parallel {reply}")
        return reply

    def _exited(self, rank: int, method: str) -> str:
        self.procs[rank].join(timeout=1)  # its exit code, if it is exiting
        return f"tensor-parallel worker {rank} exited (code {self.procs[rank].exitcode}) during {method}"

    def _fail(self, why: str) -> None:
        self.dead = why
        log.error("%s: stopping every tensor-parallel worker", why)
        for proc in self.procs:
            proc.kill()
        self.close()
        raise WorkerDiedError(why)

    def _unlink_segment(self) -> None:
        if self.segment is not None:
            self.segment.unlink(missing_ok=True)

    def close(self) -> None:
        self._finalizer()


def _stop(procs, conns, segment: Path | None) -> None:
    if segment is not None:
        segment.unlink(missing_ok=True)
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refuse_vocabulary_adapters(info, weights) -> None:
    """Tensor parallelism splits the vocabulary over the ranks; an adapter's embedding or head weights are whole."""
    if weights.embedding or weights.head or weights.replacements:
        raise AdapterError(f"adapter {info.name!r} changes the embedding or the LM head (LoRA on them, or "
                           "modules_to_save): not served under tensor parallelism, whose vocabulary is split over "
                           "the ranks")
