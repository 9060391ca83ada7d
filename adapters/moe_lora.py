"""LoRA on a mixture-of-experts layer, per token (`moe_weights.py` reads it): the router's logits, each
(token, expert) pair's expert weights, and Qwen2-MoE's shared expert and its gate, each with the token's adapter.

The MoE block (`platform/models/moe.py`) takes an optional delta (`MoEDelta`, built per step by `LoRAMoE`) and
adds what it returns at each of those points; the block knows nothing of adapters. A pair's expert delta is
`scale * (x A_e^T) B_e^T` of its token's adapter and its expert, batched per adapter with `bmm` over the pairs'
gathered A_e and B_e (peft adds the same delta to the merged expert weight). A step holding such a slot runs
eagerly (a decode graph is captured without them).
"""

from __future__ import annotations

import torch

from loraplex.adapters.moe_weights import ExpertLoRA, LoRA, MoELoRA
from loraplex.kernels.lora_batch import LoRABatch


class MoESlots:
    """One sparse layer's adapters, per slot."""

    def __init__(self, num_slots: int) -> None:
        self.loras: list[MoELoRA | None] = [None] * num_slots
        self.active_slots: set[int] = set()  # on the host: a step none of whose slots is here pays a set test

    def set(self, slot: int, lora: MoELoRA | None) -> None:
        self.loras[slot] = lora
        (self.active_slots.add if lora is not None else self.active_slots.discard)(slot)

    def clear(self, slot: int) -> None:
        self.set(slot, None)

    def used_by(self, batch: LoRABatch) -> bool:
        return not self.active_slots.isdisjoint(batch.host_slots)


class MoEDelta:
    """What one step's adapters add inside one sparse layer (`batch`: the step's tokens by slot)."""

    def __init__(self, slots: MoESlots, batch: LoRABatch, num_tokens: int) -> None:
        self.slots, self.batch = slots, batch
        self.present = [s for s in batch.host_slots if slots.loras[s] is not None]
        self.token_slot = None
        if self.present:
            self.token_slot = torch.full((num_tokens,), -1, dtype=torch.long, device=batch.token_order.device)
            self.token_slot.index_copy_(0, batch.token_order, batch.order_slots)

    def router(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The router's logits with each token's adapter."""
        return self._per_token(x, logits, lambda m: m.router)

    def shared(self, part: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the shared expert's `part`: "gate_up", "down" or "gate") with each token's adapter; gate_up is the
        concatenation of gate_proj's and up_proj's."""
        if part != "gate_up":
            return self._per_token(x, y, lambda m: m.shared.get("down_proj" if part == "down" else part))
        width = y.shape[1] // 2
        self._per_token(x, y[:, :width], lambda m: m.shared.get("gate_proj"))
        self._per_token(x, y[:, width:], lambda m: m.shared.get("up_proj"))
        return y

    def experts(self, part: str, rows: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor, y: torch.Tensor
                ) -> torch.Tensor:
        """`y` (the pairs' expert outputs of `part`: "gate_up" or "down"; `rows` their inputs, `tokens` and `ids`
        each pair's token and expert) with each pair's adapter delta."""
        if not self.present:
            return y
        pair_slot = self.token_slot.index_select(0, tokens)
        for slot in self.present:
            lora: ExpertLoRA | None = getattr(self.slots.loras[slot], part)
            if lora is None:
                continue
            pairs = (pair_slot == slot).nonzero().squeeze(1)
            if not len(pairs):
                continue
            experts = ids.index_select(0, pairs)
            x = rows.index_select(0, pairs).unsqueeze(1).to(lora.a.dtype)  # [p, 1, in]
            h = torch.bmm(x, lora.a.index_select(0, experts).transpose(1, 2))  # [p, 1, r]
            delta = torch.bmm(h, lora.b.index_select(0, experts).transpose(1, 2)).squeeze(1)  # [p, out]
            y.index_add_(0, pairs, delta.to(y.dtype), alpha=lora.scale)
        return y

    def _per_token(self, x: torch.Tensor, y: torch.Tensor, part) -> torch.Tensor:
        for slot, idx in self.batch.segments():
            moe = self.slots.loras[slot]
            lora: LoRA | None = part(moe) if moe is not None else None
            if lora is None:
                continue
            h = x.index_select(0, idx).to(lora.a.dtype) @ lora.a.T
            y.index_add_(0, idx, (h @ lora.b.T).to(y.dtype), alpha=lora.scale)
        return y
