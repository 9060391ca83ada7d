"""Tensor parallelism, the engine's side: `TPExecutor` starts and supervises `--tensor-parallel-size` worker
processes (`tp_worker.py`), and `TPRunner` is the model runner the engine uses with them: it builds each step's
flat batch on the host as `ModelRunner` does and sends it to every rank; rank 0 answers with the logits.

Each call goes to every worker through its own pipe and waits for every answer, watching the processes: a
worker that exits fails the call at once with `WorkerDiedError` (and every later one: the group cannot go on
without it), never a hang. The engine's adapter slots reach the workers as changes sent with the next step;
an adapter being loaded is read by every rank first, and a rank that cannot read it fails the load on all.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import socket
import threading
import weakref
from multiprocessing.connection import wait

import torch

from loraplex.adapters.registry import AdapterInfo
from loraplex.kernels.dispatch import to_device
from loraplex.platform.block_table import BlockTable
from loraplex.platform.config import EngineConfig
from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.model_runner import ModelRunner, PromptRows
from loraplex.platform.request import Request
from loraplex.platform.scheduler import SchedulerOutput
from loraplex.platform.tp_worker import AdapterRef, StepMessage, worker_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint takes minutes


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or failed inside a step: the engine cannot go on."""


class TPExecutor:
    def __init__(self, config: EngineConfig, num_blocks: int | None) -> None:
        size = config.tensor_parallel_size
        context = multiprocessing.get_context("spawn")  # no fork of a process holding threads and a torch pool
        port = _free_port()
        init_method, segment = f"tcp://127.0.0.1:{port}", f"loraplex-tp-{os.getpid()}-{port}"
        threads = max(1, torch.get_num_threads() // size)
        self.conns, self.procs = [], []
        for rank in range(size):
            parent, child = context.Pipe()
            proc = context.Process(target=worker_main, name=f"loraplex-tp{rank}", daemon=True,
                                   args=(config, rank, size, init_method, num_blocks, child, threads, segment))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.lock = threading.Lock()  # a step (engine thread) and an adapter read (a load's thread) take turns
        self.dead: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            self._gather("start", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        log.info("tensor parallelism: %d worker processes (pids %s)", size, [p.pid for p in self.procs])

    def call(self, method: str, *args, fatal: bool = True, every: bool = False):
        """Every rank runs `method(*args)`; rank 0's answer (`every`: each rank's, in rank order). `fatal`: a
        failure leaves the ranks out of step (a collective was under way), so the executor is dead after it."""
        with self.lock:
            if self.dead is not None:
                raise WorkerDiedError(self.dead)
            payload = pickle.dumps((method, args))
            try:
                for conn in self.conns:
                    conn.send_bytes(payload)
            except OSError:
                self._fail("a tensor-parallel worker's pipe is closed")
            try:
                answers = self._gather(method, None)
                return answers if every else answers[0]
            except WorkerDiedError:
                raise
            except RuntimeError as exc:
                if fatal:
                    self._fail(str(exc))
                raise

    def _gather(self, method: str, timeout: float | None):
        """Every rank's answer, rank 0's returned; a worker that exits first fails it."""
        answers: dict[int, tuple] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            ready = wait([*waiting, *sentinels], timeout)
            if not ready:
                self._fail(f"tensor-parallel workers did not answer {method} within {timeout:.0f} s")
            for item in ready:
                if item in waiting:
                    try:
                        answers[waiting.pop(item)] = pickle.loads(item.recv_bytes())
                    except (EOFError, OSError):
                        pass  # its sentinel says how it ended
                else:
                    rank = sentinels.pop(item)
                    if rank not in answers:
                        self._fail(f"tensor-parallel worker {rank} exited (code {self.procs[rank].exitcode}) "
                                   f"during {method}")
        errors = [reply for _, (status, reply) in sorted(answers.items()) if status == "error"]
        if errors:
            raise RuntimeError(f"{method} failed on tensor-parallel {'; '.join(errors)}")
        return [reply for _, (_, reply) in sorted(answers.items())]

    def _fail(self, why: str) -> None:
        self.dead = why
        log.error("%s: stopping every tensor-parallel worker", why)
        for proc in self.procs:  # the others may wait in a collective for the one that is gone
            proc.kill()
        self.close()
        raise WorkerDiedError(why)

    def check_adapter(self, info: AdapterInfo) -> None:
        """Every rank reads and shards the adapter (kept for its first slot); one that cannot fails the load,
        and what the others read is dropped."""
        try:
            self.call("check_adapter", _ref(info), fatal=False)
        except WorkerDiedError:
            raise
        except RuntimeError:
            self.call("forget_adapter", info.content_hash, fatal=False)
            raise

    def close(self) -> None:
        self._finalizer()


def _stop(procs, conns) -> None:
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _ref(info: AdapterInfo) -> AdapterRef:
    return AdapterRef(info.name, info.path, info.content_hash, info.confined)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPRunner(ModelRunner):
    """The engine's model runner under tensor parallelism: the batch built here, the model run by the workers."""

    def __init__(self, executor: TPExecutor, kv: KVCacheManager, adapters, device: torch.device) -> None:
        self.executor, self.kv, self.device = executor, kv, device
        self.block_size = kv.block_size
        self.block_table = BlockTable(8, 16, kv.block_size, torch.device("cpu"))
        self.graphs = None
        self.adapters = adapters
        self.slot_changes: list[tuple[int, AdapterRef | None]] = []
        self.forgotten: list[str] = []  # content hashes of adapters unloaded since the last step
        self.changes_lock = threading.Lock()
        adapters.slots.listen(self._slot_changed)
        adapters.unloaded = self._unloaded

    def _slot_changed(self, slot: int, weights) -> None:
        """The engine's registry put an adapter in a slot (or emptied it): the workers follow at the next step."""
        ref = None if weights is None else _ref(self.adapters.get(weights.name))
        with self.changes_lock:
            self.slot_changes.append((slot, ref))

    def _unloaded(self, info: AdapterInfo) -> None:
        with self.changes_lock:
            self.forgotten.append(info.content_hash)

    def enable_graphs(self, *args, **kwargs) -> None:
        raise ValueError("CUDA graphs are not captured under tensor parallelism (the workers run eager)")

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, adapter_slots: dict[str, int] | None = None
                ) -> tuple[torch.Tensor, list[Request], list[PromptRows]]:
        lora_slots = self._lora_slots(sched, adapter_slots or {})
        mix_passes = self._mix_passes(sched, adapter_slots or {})
        step = self._prepare(sched)
        with self.changes_lock:
            changes, forgotten, self.slot_changes, self.forgotten = self.slot_changes, self.forgotten, [], []
        row_slots = [lora_slots[row] for row in step.last_rows] if lora_slots else None
        runs = [(rows.start, rows.stop) for _, rows, _ in step.prompt_rows]
        msg = StepMessage(changes, forgotten, list(sched.block_copies), step.token_ids, step.positions, step.slots,
                          self.block_table.commit(step.table_rows).clone(), step.seq_lens, step.starts,
                          step.max_query_len, lora_slots, mix_passes, step.last_rows, row_slots, runs)
        logits, prompt_hidden = self.executor.call("step", msg)
        prompt = [PromptRows(req, to_device(hidden, self.device), first,
                             lora_slots[rows.start] if lora_slots else -1, self.compute_logits)
                  for (req, rows, first), hidden in zip(step.prompt_rows, prompt_hidden)]
        if logits is None:
            return torch.empty(0, 0), [], prompt
        return to_device(logits, self.device), step.sampled, prompt

    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        return to_device(self.executor.call("logits", hidden.cpu(), slots), self.device)

