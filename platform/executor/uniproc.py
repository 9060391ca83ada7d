"""One rank in the engine's own process: the `Worker` is called directly, its tensors stay on the device, and it
serves from the engine's adapter slots (its registry loads adapters straight into them)."""

from __future__ import annotations

import torch

from loraplex.adapters.registry import AdapterRegistry
from loraplex.platform.device import MemorySnapshot
from loraplex.platform.executor.abstract import Executor
from loraplex.platform.resolve import ResolvedConfig
from loraplex.platform.worker.cuda_graphs import Capture
from loraplex.platform.worker.model_runner import ModelInput
from loraplex.platform.worker.worker import Worker


class UniprocExecutor(Executor):
    uses_engine_slots = True
    in_process = True

    def __init__(self, resolved: ResolvedConfig, adapters: AdapterRegistry,
                 memory_start: MemorySnapshot | None = None) -> None:
        """`memory_start`: CUDA's memory before the engine allocated anything (its adapter slots included)."""
        self.worker = Worker(resolved, slots=adapters.slots, memory_start=memory_start)
        self.input_device = self.worker.device

    def kv_blocks(self) -> int:
        return self.worker.kv_blocks()

    def allocate_kv(self, num_blocks: int) -> None:
        self.worker.allocate_kv(num_blocks)

    def capture_graphs(self, capture: Capture | None = None) -> None:
        self.worker.capture_graphs(capture)

    def execute(self, step: ModelInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        return self.worker.execute(step)

    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        return self.worker.logits(hidden, slots)
