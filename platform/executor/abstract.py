"""The executor: how the engine reaches its ranks. The engine calls the same methods whatever the number of ranks
(vLLM's `Executor`); `factory.executor_class` picks the implementation once, from the resolved config:
`UniprocExecutor` (one rank, in the engine's process) or `MultiprocExecutor` (tensor parallelism: a worker process
per rank). Both run `worker.Worker`s, each with the one `ModelRunner`, and are built as
`cls(resolved, adapters, memory_start)`: the engine's adapter registry, and CUDA's memory before the engine allocated
anything (`device.MemorySnapshot`; a worker process measures its own)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from loraplex.platform.worker.cuda_graphs import Capture
from loraplex.platform.worker.model_runner import ModelInput


class WorkerDiedError(RuntimeError):
    """A worker process exited or failed a call: the engine cannot go on."""


class Executor(ABC):
    # whether the ranks serve from the engine's own adapter slots (its registry's, on the device); else the slots
    # are the engine's bookkeeping on the host and each rank follows them (`ModelInput.slot_changes`)
    uses_engine_slots: bool
    # whether rank 0 runs in the engine's process, so a step may read the engine's device tensors (the previous
    # step's sampled ids: --async-scheduling)
    in_process: bool = False
    input_device: torch.device  # where a step's block tables are put for the ranks to read

    @abstractmethod
    def kv_blocks(self) -> int:
        """The KV blocks every rank's device can hold (CUDA: profiled; the fullest rank decides)."""

    @abstractmethod
    def allocate_kv(self, num_blocks: int) -> None: ...

    @abstractmethod
    def capture_graphs(self, capture: Capture | None = None) -> None:
        """Every rank's decode graphs (`capture`: CUDA's unless given, as tests give the CPU stand-in)."""

    @abstractmethod
    def execute(self, step: ModelInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Rank 0's answer on the engine's device: the logits of the sampled rows (None: none) and the hidden rows
        of each prompt run."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        """The logits of these hidden rows, each through its adapter's head (`slots`; None: the base head)."""

    def close(self) -> None:
        """Stop what the executor started outside the engine's process."""
