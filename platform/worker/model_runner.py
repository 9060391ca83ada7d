"""Owns the model and its paged KV cache; turns a SchedulerOutput into one flat batch, runs the
forward pass and returns the logits of each request whose chunk reaches its last token (and
the hidden states of prompt positions whose logprobs a request asked for).

The batch is built on the host from the scheduler's lists, then copied to the engine's device
(through pinned memory on CUDA, without waiting); the block tables are a persistent int32
`BlockTable` updated by what changed since the last step. The maxima the kernels need are known on
the host, so a step reads nothing back from the device but the sampled tokens. Decode batches
replay a captured CUDA graph (`cuda_graphs.py`) when one is enabled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loraplex.adapters.lora_layers import LoRAContext
from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import to_device
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.sgmv import LoRABatch
from loraplex.platform.core.block_table import BlockTable
from loraplex.platform.config import ModelConfig
from loraplex.platform.worker.cuda_graphs import Capture, DecodeGraphs, DecodeInputs, capture_sizes
from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request
from loraplex.platform.core.scheduler import SchedulerOutput


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


@torch.inference_mode()
def profile_step(model: torch.nn.Module, config: ModelConfig, kv_dtype: torch.dtype, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, device: torch.device) -> None:
    """The largest step the scheduler can build: max_num_batched_tokens prompt tokens (in
    sequences of at most max_model_len) through the model into a KV cache just big enough, then
    the logits of max_num_seqs rows; what it peaks at is the engine's memory other than its KV."""
    lens = [min(max_model_len, max_num_batched_tokens - start) for start in range(0, max_num_batched_tokens,
                                                                                 max_model_len)]
    per_seq = [-(-n // block_size) for n in lens]
    kv = torch.zeros(config.num_layers, 2, sum(per_seq), block_size, config.num_kv_heads, config.head_dim,
                     dtype=kv_dtype, device=device)
    first = [sum(per_seq[:i]) for i in range(len(lens))]
    tables = [[f + j for j in range(n)] + [0] * (max(per_seq) - n) for f, n in zip(first, per_seq)]
    slots = [(f * block_size) + p for f, n in zip(first, lens) for p in range(n)]
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]

    def put(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = PagedAttentionMetadata.build(put(slots), put(tables), put(lens), put(starts), block_size, max(lens),
                                        max(lens))
    positions = put([p for n in lens for p in range(n)])
    hidden = model(torch.zeros(len(slots), dtype=torch.long, device=device), positions,
                   [(kv[i, 0], kv[i, 1]) for i in range(config.num_layers)], meta)
    rows = hidden[-1:].expand(max_num_seqs, -1)
    model.compute_logits(rows).softmax(dim=-1).sort(dim=-1, descending=True)  # the sampler's top-p, at worst
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_cache_for(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The paged KV tensor [layers, 2, blocks, block_size, kv_heads, head_dim] (a tensor-parallel rank: its KV
    heads) and each layer's (K, V) views of it."""
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return cache, [(cache[i, 0], cache[i, 1]) for i in range(config.num_layers)]


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """The scheduler's copy-on-write: each (source, destination) block, every layer's K and V."""
    for src, dst in copies:
        kv_cache[:, :, dst].copy_(kv_cache[:, :, src])


def forward_batch(model: torch.nn.Module, lora: LoRAContext, kv_caches: list, step, block_tables: torch.Tensor,
                  block_size: int, lora_slots: list[int] | None,
                  mix_passes: list[tuple[list[int], list[float]]] | None, device: torch.device) -> torch.Tensor:
    """One flat batch through the model: `step` is a `StepInputs` (or a tensor-parallel rank's `StepMessage`,
    which carries the same fields), `block_tables` its rows on the device; each token's adapter from `lora_slots`
    or, with adapter mixes, the weighted `mix_passes`."""
    def put(values: list) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long, device="cpu"), device)

    meta = PagedAttentionMetadata.build(
        slot_mapping=put(step.slots), block_tables=block_tables, seq_lens=put(step.seq_lens),
        query_start_loc=put(step.starts), block_size=block_size, max_query_len=step.max_query_len,
        max_seq_len=max(step.seq_lens))
    if mix_passes is not None:
        batch = LoRABatch.build_passes(mix_passes, device)
    else:
        batch = LoRABatch.build(lora_slots, device) if lora_slots is not None else None
    with lora.mapping(batch=batch):
        return model(put(step.token_ids), put(step.positions), kv_caches, meta)


@dataclass
class PromptRows:
    """Hidden states of prompt positions first..first+len-1: position p predicts prompt token p+1."""

    request: Request
    hidden: torch.Tensor
    first: int  # the index of the prompt token the first row predicts
    slot: int  # the request's adapter slot (-1: none), for an adapter that changes the head
    head: Callable[[torch.Tensor, list[int] | None], torch.Tensor]  # the runner's compute_logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of some of these rows, through the request's adapter's head where it has one."""
        return self.head(hidden, [self.slot] * len(hidden) if self.slot >= 0 else None)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, kv: KVCacheManager,
                 kv_dtype: torch.dtype, lora: LoRAContext, device: torch.device = torch.device("cpu")) -> None:
        """`lora`: the step's adapter mapping that the model's LoRA layers read (`adapters/lora_layers.py`)."""
        self.model, self.lora = model, lora
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.kv_cache, self.kv_caches = kv_cache_for(config, kv.pool.num_blocks, kv.block_size, kv_dtype, device)
        self.graphs: DecodeGraphs | None = None
        # sized by the first steps (rows and width double as needed) until graphs fix them
        self.block_table = BlockTable(8, 16, kv.block_size, device)
        if device.type == "cpu":
            cpu_kernels.library()  # build (once per machine) now rather than in the first step

    def enable_graphs(self, capture: Capture, max_num_seqs: int, max_model_len: int, null_slot: int | None,
                      mix_passes: int = 0) -> None:
        """Capture the decode graphs (every padded size, with and without LoRA when `null_slot`
        is given, and for adapter mixes of up to `mix_passes` adapters); from then on decode steps that
        fit replay them."""
        max_blocks = -(-max_model_len // self.block_size)
        # a graph's table is as wide as max_model_len; the runner's rows are copied into it as they are
        self.block_table = BlockTable(max_num_seqs, max_blocks, self.block_size, self.device, max_width=max_blocks)
        with torch.inference_mode():  # as the steps that replay them run
            self.graphs = DecodeGraphs(self.model, self.lora, self.kv_caches, capture_sizes(max_num_seqs),
                                       max_blocks, self.block_size, max_model_len, null_slot, capture, mix_passes)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, adapter_slots: dict[str, int] | None = None
                ) -> tuple[torch.Tensor, list[Request], list[PromptRows]]:
        """Returns logits [R, vocab] (model dtype: a row per request, and one more per draft it verifies), the
        requests they belong to, and for requests that asked for prompt logprobs the hidden states of their
        chunk's prompt positions. `adapter_slots` maps each scheduled request's adapter to its device slot."""
        copy_blocks(self.kv_cache, sched.block_copies)
        lora_slots = self._lora_slots(sched, adapter_slots or {})
        mix_passes = self._mix_passes(sched, adapter_slots or {})
        step = self._prepare(sched)
        graphs = self.graphs
        if graphs is not None and step.decode_only \
                and graphs.fits(len(step.sampled), lora_slots is not None, len(mix_passes or ())) \
                and not self.lora.changes_embedding(lora_slots):  # no graph holds a table per slot
            hidden = graphs.run(DecodeInputs(step.token_ids, step.positions, step.slots, self.block_table,
                                             step.table_rows, step.seq_lens, lora_slots, mix_passes))
            return self.logits(hidden, lora_slots), step.sampled, []  # one token per request: rows = tokens
        hidden = self._forward(step, lora_slots, mix_passes)
        prompt_hidden = [PromptRows(req, hidden[rows], first, lora_slots[rows.start] if lora_slots else -1,
                                    self.compute_logits) for req, rows, first in step.prompt_rows]
        if not step.sampled:
            return hidden.new_empty(0, 0), [], prompt_hidden
        last_rows = to_device(torch.tensor(step.last_rows, dtype=torch.long, device="cpu"), self.device)
        row_slots = [lora_slots[row] for row in step.last_rows] if lora_slots else None
        return self.logits(hidden[last_rows], row_slots), step.sampled, prompt_hidden

    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        """The model's logits of these rows (model dtype), each through its adapter's head where it changes it
        (`slots`: each row's, -1: none; None: the base head for every row)."""
        with self.lora.mapping(rows=slots):
            return self.model.logits(hidden)

    def compute_logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        return self.logits(hidden, slots).float()

    @staticmethod
    def _mix_passes(sched: SchedulerOutput, adapter_slots: dict[str, int]
                    ) -> list[tuple[list[int], list[float]]] | None:
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

    @staticmethod
    def _lora_slots(sched: SchedulerOutput, adapter_slots: dict[str, int]) -> list[int] | None:
        """Each new token's adapter slot (-1: none, and for a mix, whose adapters change no embedding or
        head: `_mix_passes` holds its slots); None when no request uses an adapter."""
        if not adapter_slots:
            return None
        token_slots: list[int] = []
        for req, num_new in sched.scheduled:
            token_slots += [adapter_slots[req.adapter] if req.adapter is not None else -1] * num_new
        return token_slots

    def _forward(self, step: "StepInputs", lora_slots: list[int] | None,
                 mix_passes: list[tuple[list[int], list[float]]] | None = None) -> torch.Tensor:
        return forward_batch(self.model, self.lora, self.kv_caches, step, self.block_table.commit(step.table_rows),
                             self.block_size, lora_slots, mix_passes, self.device)

    def _prepare(self, sched: SchedulerOutput) -> "StepInputs":
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        last_rows: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[tuple[Request, slice, int]] = []
        for req, num_new in sched.scheduled:
            begin = req.num_computed_tokens
            end = begin + num_new
            blocks = self.kv.req_blocks[req.seq_id]
            known = min(end, req.num_tokens)
            token_ids += req.token_slice(begin, known) + req.spec_token_ids[:end - known]  # drafts after the known
            positions += range(begin, end)
            slots += [blocks[p // bs].block_id * bs + p % bs for p in range(begin, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            predicting = min(end, len(req.prompt_token_ids) - 1)  # positions that predict a prompt token
            if req.prompt_logprobs is not None and begin < predicting:
                prompt_rows.append((req, slice(starts[-2], starts[-2] + predicting - begin), begin + 1))
            if end == req.num_tokens + len(req.spec_token_ids):  # the chunk completes the known tokens: sample
                last_rows += range(starts[-1] - 1 - len(req.spec_token_ids), starts[-1])  # a row per draft more
                sampled.append(req)
        max_query_len = max(num_new for _, num_new in sched.scheduled)
        table_rows = self.block_table.update(self.kv.req_blocks, [req for req, _ in sched.scheduled])
        return StepInputs(token_ids, positions, slots, table_rows, seq_lens, starts, max_query_len, last_rows, sampled,
                          prompt_rows)


@dataclass
class StepInputs:
    """One step's flat batch on the host."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    table_rows: list[int]  # each request's row of the runner's BlockTable
    seq_lens: list[int]
    starts: list[int]
    max_query_len: int
    last_rows: list[int]
    sampled: list[Request]
    prompt_rows: list[tuple[Request, slice, int]]

    @property
    def decode_only(self) -> bool:
        """One new token per request, each sampled, no prompt logprobs: what a decode graph runs."""
        return self.max_query_len == 1 and len(self.sampled) == len(self.seq_lens) and not self.prompt_rows
