"""The engine's side of a step's batch: from the scheduler's output and the adapters' slots, the flat `ModelInput`
every rank runs (`platform/worker/model_runner.py`), and what the engine keeps to read the answer (the requests
sampled, the prompt runs whose logprobs were asked for).

The block tables are a persistent int32 `BlockTable` updated by what changed since the last step, on the device
the executor's ranks read them from (`Executor.input_device`): the engine's device in its own process, the host
for worker processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loraplex.platform.core.block_table import BlockTable
from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.core.scheduler import SchedulerOutput
from loraplex.platform.request import Request
from loraplex.platform.worker.model_runner import ModelInput, TableRows


@dataclass
class PromptRows:
    """Hidden states of prompt positions first..first+len-1: position p predicts prompt token p+1."""

    request: Request
    hidden: torch.Tensor
    first: int  # the index of the prompt token the first row predicts
    slot: int  # the request's adapter slot (-1: none), for an adapter that changes the head
    head: Callable[[torch.Tensor, list[int] | None], torch.Tensor]  # the executor's logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of some of these rows, through the request's adapter's head where it has one."""
        return self.head(hidden, [self.slot] * len(hidden) if self.slot >= 0 else None).float()


@dataclass
class StepBatch:
    inputs: ModelInput
    sampled: list[Request]  # the requests whose rows are sampled, in row order
    prompt_runs: list[tuple[Request, int, int]]  # (request, first prompt token predicted, adapter slot), per run


class InputBatch:
    def __init__(self, kv: KVCacheManager, device: torch.device) -> None:
        self.kv, self.device, self.block_size = kv, device, kv.block_size
        # sized by the first steps (rows and width double as needed) until graphs fix them
        self.block_table = BlockTable(8, 16, kv.block_size, device)

    def fix_width(self, max_num_seqs: int, max_model_len: int) -> None:
        """Decode graphs read tables as wide as max_model_len: the rows are kept that wide from now on."""
        max_blocks = -(-max_model_len // self.block_size)
        self.block_table = BlockTable(max_num_seqs, max_blocks, self.block_size, self.device, max_width=max_blocks)

    def build(self, sched: SchedulerOutput, adapter_slots: dict[str, int],
              in_flight: dict[Request, int] | None = None) -> StepBatch:
        """`adapter_slots` maps each scheduled request's adapter to its slot; `in_flight` (--async-scheduling) each
        request with a pending token to its row in the previous step's sampled ids: its input there is gathered
        on the device (`ModelInput.pending`)."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        last_rows: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[tuple[int, int]] = []
        prompt_runs: list[tuple[Request, int, int]] = []
        lora_slots = _lora_slots(sched, adapter_slots)
        pending: list[tuple[int, int]] = []
        for req, num_new in sched.scheduled:
            begin = req.num_computed_tokens
            end = begin + num_new
            blocks = self.kv.req_blocks[req.seq_id]
            known = min(end, req.num_tokens)
            token_ids += req.token_slice(begin, known) + req.spec_token_ids[:end - known]  # drafts after the known
            if end > known and req.num_pending:  # its one pending token, last: an id the device has
                pending.append((len(token_ids), in_flight[req]))
                token_ids.append(0)
            positions += range(begin, end)
            slots += [blocks[p // bs].block_id * bs + p % bs for p in range(begin, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            predicting = min(end, len(req.prompt_token_ids) - 1)  # positions that predict a prompt token
            if req.prompt_logprobs is not None and begin < predicting:
                prompt_rows.append((starts[-2], starts[-2] + predicting - begin))
                prompt_runs.append((req, begin + 1, lora_slots[starts[-2]] if lora_slots else -1))
            if end == req.num_tokens_with_pending + len(req.spec_token_ids):  # the chunk completes the known tokens
                last_rows += range(starts[-1] - 1 - len(req.spec_token_ids), starts[-1])  # a row per draft more
                sampled.append(req)
        rows = self.block_table.update(self.kv.req_blocks, [req for req, _ in sched.scheduled])
        inputs = ModelInput(token_ids, positions, slots, TableRows(self.block_table, rows), seq_lens, starts,
                            max(num_new for _, num_new in sched.scheduled), last_rows, prompt_rows, lora_slots,
                            _mix_passes(sched, adapter_slots), list(sched.block_copies), pending=pending)
        return StepBatch(inputs, sampled, prompt_runs)


def _mix_passes(sched: SchedulerOutput, adapter_slots: dict[str, int]) -> list[tuple[list[int], list[float]]] | None:
    """A step with adapter mixes: K passes (K the largest mix), pass k each new token's k-th (slot, weight)
    (slot -1: none; a plain adapter's token is in pass 0 at weight 1); None when no request has a mix."""
    mixes = [req.mix for req, _ in sched.scheduled if req.mix is not None]
    if not mixes:
        return None
    passes = [([], []) for _ in range(max(len(mix.entries) for mix in mixes))]
    for req, num_new in sched.scheduled:
        entries = req.mix.entries if req.mix is not None else ((req.adapter, 1.0),) if req.adapter else ()
        for k, (slots, weights) in enumerate(passes):
            slot, weight = (adapter_slots[entries[k][0]], entries[k][1]) if k < len(entries) else (-1, 0.0)
            slots += [slot] * num_new
            weights += [weight] * num_new
    return passes


def _lora_slots(sched: SchedulerOutput, adapter_slots: dict[str, int]) -> list[int] | None:
    """Each new token's adapter slot (-1: none, and for a mix, whose adapters change no embedding or
    head: `_mix_passes` holds its slots); None when no request uses an adapter."""
    if not adapter_slots:
        return None
    token_slots: list[int] = []
    for req, num_new in sched.scheduled:
        token_slots += [adapter_slots[req.adapter] if req.adapter is not None else -1] * num_new
    return token_slots
