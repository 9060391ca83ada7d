"""The running requests' block tables as one persistent int32 table, updated incrementally (vLLM's
`BlockTable`): each request keeps a row of a host buffer (pinned on CUDA) while its block list lives, and
a step writes only what changed since the last one: the blocks appended, the entries the sliding window
turned into `NULL_BLOCK` (a prefix that only grows), the block a copy-on-write replaced (the one at the
request's first new position). A request that joins, is preempted and comes back, or forks gets a new
list from the KV manager, so its row is written whole once. Rows of requests whose list is gone are
given back at the next step.

`commit` gathers the step's rows, in batch order, into a pinned staging buffer and copies them to the
device in one copy. The staging buffer is reused: the previous copy out of it is waited for (`CopyFence`: a
step may be built before the last one's tokens are read back) before it is written again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.platform.core.block_pool import NULL_BLOCK, Block
from loraplex.platform.device import CopyFence
from loraplex.platform.request import Request


@dataclass
class _Row:
    index: int
    blocks: list[Block]  # the KV manager's own list for the request (identity tells a new one)
    written: int = 0  # entries of `blocks` mirrored in the row
    nulls: int = 0  # leading entries known to be NULL_BLOCK in the row


class BlockTable:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 max_width: int | None = None) -> None:
        """`max_width`: the widest a row may grow (a graph's table width); None: as wide as a request needs."""
        self.device = device
        self.block_size = block_size
        self.max_width = max_width
        self._rows: dict[str, _Row] = {}
        self.num_written = 0  # entries written into host rows since the start (tests: O(changes) per step)
        self._allocate(max_rows, max_blocks)

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def _allocate(self, rows: int, width: int) -> None:
        """(Re)allocate the buffers at this size, keeping the rows' contents (growth is rare: doubling)."""
        pin = self.device.type == "cuda"
        old = getattr(self, "host", None)
        self.host = torch.zeros(rows, width, dtype=torch.int32, device="cpu", pin_memory=pin)
        if old is not None:
            self.host[:old.shape[0], :old.shape[1]] = old
        self._view = self.host.numpy()  # element writes through numpy: no tensor per write
        self.staging = torch.zeros(rows, width, dtype=torch.int32, device="cpu", pin_memory=pin) if pin else None
        self._fence = CopyFence(self.device)
        self.device_table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        taken = {row.index for row in self._rows.values()}
        self._free = [i for i in range(rows - 1, -1, -1) if i not in taken]  # popped lowest first

    def update(self, block_lists: dict[str, list[Block]], requests: list[Request]) -> list[int]:
        """Bring the rows of `requests` (whose block lists `block_lists`, the KV manager's, holds) up to date;
        returns each request's row, in order."""
        self._release_gone(block_lists)
        return [self._sync(req, block_lists[req.seq_id]) for req in requests]

    def _release_gone(self, block_lists: dict[str, list[Block]]) -> None:
        """Give back the rows of requests that finished or were preempted (their list is gone or replaced)."""
        gone = [seq_id for seq_id, row in self._rows.items() if block_lists.get(seq_id) is not row.blocks]
        if gone:
            self._free += [self._rows.pop(seq_id).index for seq_id in gone]
            self._free.sort(reverse=True)  # the lowest rows first: the rows in use stay few and low

    def _sync(self, req: Request, blocks: list[Block]) -> int:
        row = self._rows.get(req.seq_id)
        if row is None:
            row = self._rows[req.seq_id] = _Row(self._take_row(), blocks)
        if len(blocks) > self.width:
            self._grow(self.host.shape[0], len(blocks))
        if row.written > len(blocks):  # rejected drafts' blocks given back: rewritten from there when appended
            row.written, row.nulls = len(blocks), min(row.nulls, len(blocks))
        self._write_nulls(row)
        self._write_copied(row, req.num_computed_tokens)
        self._write_appended(row)
        return row.index

    def _take_row(self) -> int:
        if not self._free:  # more live requests than rows (forks): grow
            self._grow(2 * self.host.shape[0], self.width)
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        if self.max_width is not None and width > self.max_width:
            raise ValueError(f"a block table row of {width} blocks is wider than the {self.max_width} allowed")
        if width > self.width:
            width = max(width, 2 * self.width) if self.max_width is None else min(max(width, 2 * self.width),
                                                                                    self.max_width)
        self._allocate(rows, width)

    def _write_nulls(self, row: _Row) -> None:
        """Entries the sliding window gave back since the last step (they only extend the null prefix)."""
        view, blocks = self._view[row.index], row.blocks
        while row.nulls < row.written and blocks[row.nulls] is NULL_BLOCK:
            if view[row.nulls] != NULL_BLOCK.block_id:  # pool block 0 given back keeps its entry
                view[row.nulls] = NULL_BLOCK.block_id
                self.num_written += 1
            row.nulls += 1

    @staticmethod
    def _skip_nulls(row: _Row) -> None:
        """Past the null entries just written as they came (a prefix hit before the window): not again."""
        while row.nulls < row.written and row.blocks[row.nulls] is NULL_BLOCK:
            row.nulls += 1

    def _write_copied(self, row: _Row, num_computed: int) -> None:
        """Entries from the block of the request's first new position on may have changed since written: a
        copy-on-write replaces that block at allocation, and the blocks given back after rejected drafts come
        back as others (the list shrank and grew again: its length alone does not tell)."""
        for idx in range(num_computed // self.block_size, row.written):
            if self._view[row.index, idx] != row.blocks[idx].block_id:
                self._view[row.index, idx] = row.blocks[idx].block_id
                self.num_written += 1

    def _write_appended(self, row: _Row) -> None:
        new = row.blocks[row.written:]
        if new:
            self._view[row.index, row.written:len(row.blocks)] = [b.block_id for b in new]
            row.written = len(row.blocks)
            self.num_written += len(new)
            self._skip_nulls(row)

    def commit(self, rows: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The tables of `rows` in this order on the device, [B, width]: gathered on the host, then one copy.
        `out` (a graph's buffer, as wide as this table) receives them; else the table's own device buffer."""
        n = len(rows)
        target = (self.device_table if out is None else out)[:n]
        index = torch.tensor(rows, dtype=torch.long, device="cpu")
        if self.staging is None:  # CPU: the device is the host, gathered straight into the target
            torch.index_select(self.host, 0, index, out=target)
        else:
            self._fence.wait()  # the previous step's copy out of `staging` has run
            torch.index_select(self.host, 0, index, out=self.staging[:n])
            target.copy_(self.staging[:n], non_blocking=True)
            self._fence.record()
        return target
