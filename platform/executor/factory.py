"""The executor for a resolved config, picked once before the engine is built."""

from __future__ import annotations

from loraplex.platform.executor.abstract import Executor
from loraplex.platform.executor.multiproc import MultiprocExecutor
from loraplex.platform.executor.uniproc import UniprocExecutor
from loraplex.platform.resolve import ResolvedConfig


def executor_class(resolved: ResolvedConfig) -> type[Executor]:
    """One rank in the engine's process, or a worker process per rank under tensor parallelism."""
    return MultiprocExecutor if resolved.engine.tensor_parallel_size > 1 else UniprocExecutor
