"""A rank's model runner: owns its model (or shard), the LoRA context its layers read and its paged KV cache;
runs one `ModelInput` (the flat batch the engine built on its host, `platform/core/input_batch.py`) and returns the
logits of the rows the engine samples and the hidden states of prompt positions whose logprobs a request asked for.

The same runner runs under one rank or several (`worker.py`): the inputs are copied to the rank's device
(through pinned memory on CUDA, without waiting); the maxima the kernels need are known on the host, so a step
reads nothing back from the device but what the engine samples. Decode batches replay a captured CUDA graph
(`cuda_graphs.py`) when one is enabled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraplex.adapters.lora_layers import LoRAContext
from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import to_device
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.worker.cuda_graphs import Capture, DecodeGraphs, capture_sizes, gather_pending


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


class Table(Protocol):
    """A step's block-table rows, in batch order: `to` a rank's device (where they are not already), then `commit`
    puts them there (into `out`, a graph's buffer as wide as the table, when given) and returns them."""

    def to(self, device: torch.device) -> "Table": ...

    def commit(self, out: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class TableRows:
    """In the engine's process: rows of its persistent `BlockTable`, copied to the device in one copy at commit."""

    table: object  # core/block_table.BlockTable, on the device of the rank in the engine's process
    rows: list[int]

    def to(self, device: torch.device) -> "TableRows":
        return self

    def commit(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.table.commit(self.rows, out)

    def detached(self) -> "TableTensor":
        """The rows as a host tensor of their own, for another process."""
        return TableTensor(self.commit().cpu().clone())


@dataclass
class TableTensor:
    """In a worker process: the rows as the engine sent them."""

    rows: torch.Tensor  # [R, width] int32: on the host as sent, then on the rank's device

    def to(self, device: torch.device) -> "TableTensor":
        return TableTensor(to_device(self.rows, device))

    def commit(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self.rows
        return out[:len(self.rows)].copy_(self.rows, non_blocking=True)


@dataclass
class ModelInput:
    """One step's flat batch on the host, the same for every rank."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # each token's KV slot
    table: Table
    seq_lens: list[int]
    starts: list[int]  # query start offsets, one more than requests
    max_query_len: int
    last_rows: list[int]  # the rows whose logits the engine samples
    prompt_rows: list[tuple[int, int]]  # [start, end) of the hidden rows kept for prompt logprobs
    lora_slots: list[int] | None = None  # each token's adapter slot (-1: none); None: no adapter in the step
    mix_passes: list[tuple[list[int], list[float]]] | None = None  # with adapter mixes: (slots, weights) per pass
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before the step
    slot_changes: list[tuple[int, bytes | None]] = field(default_factory=list)  # a worker's own slots: see worker.py
    # --async-scheduling (in the engine's process only): (token index, row) of each input whose id is the previous
    # step's sampled token at that row of `previous_tokens`, a device tensor the host has not read yet
    pending: list[tuple[int, int]] = field(default_factory=list)
    previous_tokens: torch.Tensor | None = None

    @property
    def row_slots(self) -> list[int] | None:
        """The adapter slot of each sampled row (for an adapter that changes the head)."""
        return [self.lora_slots[row] for row in self.last_rows] if self.lora_slots else None

    @property
    def decode_only(self) -> bool:
        """One new token per request, each sampled, no prompt logprobs: what a decode graph runs."""
        return self.max_query_len == 1 and len(self.last_rows) == len(self.seq_lens) and not self.prompt_rows


def step_slots(step: ModelInput) -> list[int] | None:
    """Every slot a step's tokens use, its adapter mixes' passes too."""
    if step.mix_passes is None:
        return step.lora_slots
    return [slot for slots, _ in step.mix_passes for slot in slots]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, lora: LoRAContext, kv_dtype: torch.dtype,
                 block_size: int, device: torch.device = torch.device("cpu")) -> None:
        """`lora`: the step's adapter mapping that the model's LoRA layers read (`adapters/lora_layers.py`)."""
        self.model, self.config, self.lora = model, config, lora
        self.kv_dtype, self.block_size, self.device = kv_dtype, block_size, device
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list = []
        self.graphs: DecodeGraphs | None = None
        if device.type == "cpu":
            cpu_kernels.library()  # build (once per machine) now rather than in the first step

    def allocate_kv(self, num_blocks: int) -> None:
        self.kv_cache, self.kv_caches = kv_cache_for(self.config, num_blocks, self.block_size, self.kv_dtype,
                                                     self.device)

    def enable_graphs(self, capture: Capture, max_num_seqs: int, max_model_len: int, null_slot: int | None,
                      mix_passes: int = 0) -> None:
        """Capture the decode graphs (every padded size, with and without LoRA when `null_slot`
        is given, and for adapter mixes of up to `mix_passes` adapters); from then on decode steps that
        fit replay them. The engine's block table is as wide as a graph's from then on (`InputBatch.fix_width`)."""
        max_blocks = -(-max_model_len // self.block_size)
        with torch.inference_mode():  # as the steps that replay them run
            self.graphs = DecodeGraphs(self.model, self.lora, self.kv_caches, capture_sizes(max_num_seqs),
                                       max_blocks, self.block_size, max_model_len, null_slot, capture, mix_passes)

    @torch.inference_mode()
    def execute(self, step: ModelInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The logits of `step.last_rows` [R, vocab] in the model's dtype (None when no row is sampled) and the
        hidden rows of each `prompt_rows` run."""
        copy_blocks(self.kv_cache, step.block_copies)
        step.table = step.table.to(self.device)  # a worker process's rows arrive on the host
        graphs = self.graphs
        if graphs is not None and step.decode_only \
                and graphs.fits(len(step.last_rows), step.lora_slots is not None, len(step.mix_passes or ())) \
                and not self.lora.needs_eager(step_slots(step)):  # no graph holds a table or extras per slot
            return self.logits(graphs.run(step), step.lora_slots), []  # one token per request: rows = tokens
        hidden = self.forward(step)
        prompt_hidden = [hidden[start:end] for start, end in step.prompt_rows]
        if not step.last_rows:
            return None, prompt_hidden
        last_rows = to_device(torch.tensor(step.last_rows, dtype=torch.long, device="cpu"), self.device)
        return self.logits(hidden[last_rows], step.row_slots), prompt_hidden

    def forward(self, step: ModelInput) -> torch.Tensor:
        """One flat batch through the model; each token's adapter from `lora_slots` or, with adapter mixes, the
        weighted `mix_passes`."""
        def put(values: list) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.long, device="cpu"), self.device)

        meta = PagedAttentionMetadata.build(
            slot_mapping=put(step.slots), block_tables=step.table.commit(),
            seq_lens=put(step.seq_lens), query_start_loc=put(step.starts), block_size=self.block_size,
            max_query_len=step.max_query_len, max_seq_len=max(step.seq_lens))
        if step.mix_passes is not None:
            batch = LoRABatch.build_passes(step.mix_passes, self.device)
        else:
            batch = LoRABatch.build(step.lora_slots, self.device) if step.lora_slots is not None else None
        input_ids = put(step.token_ids)
        gather_pending(input_ids, step)
        with self.lora.mapping(batch=batch):
            return self.model(input_ids, put(step.positions), self.kv_caches, meta)

    def logits(self, hidden: torch.Tensor, slots: list[int] | None) -> torch.Tensor:
        """The model's logits of these rows (model dtype), each through its adapter's head where it changes it
        (`slots`: each row's, -1: none; None: the base head for every row)."""
        with self.lora.mapping(rows=slots):
            return self.model.logits(hidden)
