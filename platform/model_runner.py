"""Owns the model and its paged KV cache; turns a SchedulerOutput into one flat batch, runs the
forward pass and returns the logits of each request whose chunk reaches its last token (and
the hidden states of prompt positions whose logprobs a request asked for)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels import cpu_kernels
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.sgmv import LoRABatch
from loraplex.platform.config import ModelConfig
from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request
from loraplex.platform.scheduler import SchedulerOutput


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


@dataclass
class PromptRows:
    """Hidden states of prompt positions first..first+len-1: position p predicts prompt token p+1."""

    request: Request
    hidden: torch.Tensor
    first: int  # the index of the prompt token the first row predicts


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, kv: KVCacheManager,
                 kv_dtype: torch.dtype) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        shape = (config.num_layers, 2, kv.pool.num_blocks, kv.block_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(config.num_layers)]
        cpu_kernels.library()  # build (~1 s, once per machine) now rather than in the first step

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, adapter_slots: dict[str, int] | None = None
                ) -> tuple[torch.Tensor, list[Request], list[PromptRows]]:
        """Returns logits [R, vocab], the R requests they belong to, and for requests that asked
        for prompt logprobs the hidden states of their chunk's prompt positions. `adapter_slots`
        maps each scheduled request's adapter to its device slot."""
        for src, dst in sched.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        lora = self._lora_batch(sched, adapter_slots or {})
        input_ids, positions, meta, last_rows, sampled, prompt_rows = self._prepare(sched)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora)
        prompt_hidden = [PromptRows(req, hidden[rows], first) for req, rows, first in prompt_rows]
        if not sampled:
            return hidden.new_empty(0, 0), [], prompt_hidden
        return self.model.compute_logits(hidden[last_rows]), sampled, prompt_hidden

    @staticmethod
    def _lora_batch(sched: SchedulerOutput, adapter_slots: dict[str, int]) -> LoRABatch | None:
        if not adapter_slots:
            return None
        token_slots: list[int] = []
        for req, num_new in sched.scheduled:
            token_slots += [adapter_slots[req.adapter] if req.adapter is not None else -1] * num_new
        return LoRABatch.build(token_slots)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        starts = [0]
        last_rows: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[tuple[Request, slice, int]] = []
        for req, num_new in sched.scheduled:
            begin = req.num_computed_tokens
            end = begin + num_new
            table = self.kv.block_ids(req)
            token_ids += req.token_slice(begin, end)
            positions += range(begin, end)
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
            tables.append(table)
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            predicting = min(end, len(req.prompt_token_ids) - 1)  # positions that predict a prompt token
            if req.prompt_logprobs is not None and begin < predicting:
                prompt_rows.append((req, slice(starts[-2], starts[-2] + predicting - begin), begin + 1))
            if end == req.num_tokens:  # this chunk completes the known tokens: sample next
                last_rows.append(starts[-1] - 1)
                sampled.append(req)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        meta = PagedAttentionMetadata.build(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            query_start_loc=torch.tensor(starts, dtype=torch.long),
            block_size=bs,
        )
        return (torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                meta, torch.tensor(last_rows, dtype=torch.long), sampled, prompt_rows)
