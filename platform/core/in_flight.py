"""--async-scheduling: a step whose sampled ids are still on the device (`InFlight`). The next step is scheduled
and launched first, its inputs for these sequences gathered from `tokens` on the device; then `read` waits for
this step's ids alone (their copy to the host was queued right after the sampler, before the next step's work),
and the host appends them while the device runs the next step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.platform.request import Request


@dataclass
class InFlight:
    seqs: list[Request]  # in row order of `tokens`
    tokens: torch.Tensor  # [R] int64 on the device
    host: torch.Tensor  # [R] on the host: the copy of `tokens` (pinned on CUDA, landing when `event` has run)
    event: torch.cuda.Event | None

    @staticmethod
    def start(seqs: list[Request], tokens: torch.Tensor) -> "InFlight":
        """Queue the copy of `tokens` to the host (no wait)."""
        if tokens.device.type != "cuda":
            return InFlight(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, device="cpu", pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return InFlight(seqs, tokens, host, event)

    @property
    def rows(self) -> dict[Request, int]:
        """Each sequence's row in `tokens`: where the next step gathers its input id."""
        return {seq: row for row, seq in enumerate(self.seqs)}

    def read(self) -> list[int]:
        """The sampled ids: waits for this step's sampler and copy only."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
