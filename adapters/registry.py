"""The adapter registry: name -> adapter; on disk -> CPU LRU (bounded by `lora_memory` bytes and
optionally `max_cpu_loras`) -> slot (`max_loras` per batch); pins while requests use an adapter.

Loading reads and validates the folder in the caller's thread (never the engine's); only the
registration takes the lock. `unload` of a pinned adapter is refused with `AdapterInUseError`
(the API answers 409): weights are never pulled from under a running request. Slots are filled
by the engine thread between steps (`assign_slots`).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.adapters.peft_format import AdapterError, LoRAWeights, read_peft_adapter
from loraplex.adapters.slots import LoRASlots
from loraplex.platform.models.model_config import ModelConfig


class AdapterInUseError(AdapterError):
    pass


class UnknownAdapterError(AdapterError):
    """No adapter of that name. The message names nothing else (it may reach a client of the server,
    who must not learn what else is loaded); `name` for the caller's own wording."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown adapter {name!r}")
        self.name = name

    def __reduce__(self):
        return type(self), (self.name,)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    content_hash: str
    confined: bool = False  # from an adapter root: every read follows no link (peft_format)
    target_modules: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()  # modules whose full weight the adapter brings (embed_tokens, lm_head)
    kinds: tuple[str, ...] = ("lora",)  # "lora" or "dora", then what else it holds (lora_bias, rank_pattern, ...)


@dataclass(frozen=True)
class AdapterStatus:
    """Where an adapter is now: in a device slot (resident), its weights in memory, requests holding it."""

    resident: bool
    in_memory: bool
    pins: int


class AdapterRegistry:
    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, lora_memory: int | None = None, device: torch.device | None = None,
                 stacked: bool = False) -> None:
        """`stacked`: slots are copies on `device` (the Triton kernels' layout), not pointers."""
        # called with each adapter read for a load, before it is registered: raising refuses the load (tensor
        # parallelism refuses adapters on the vocabulary this way)
        self.verify: Callable[[AdapterInfo, LoRAWeights], None] | None = None
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_lora_rank}")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.config = config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.lora_memory = lora_memory  # bytes of adapter weights kept in memory; None: no byte bound
        self.dtype = dtype
        self._lock = threading.RLock()
        self._adapters: dict[str, AdapterInfo] = {}
        self._cpu: OrderedDict[str, LoRAWeights] = OrderedDict()  # LRU, most recent last
        self._cpu_bytes = 0
        self._pins: Counter[str] = Counter()
        self._slots = LoRASlots(config, max_loras, dtype, device, max_lora_rank if stacked else None)
        self.base_tokenizer = None  # the served model's, set by the engine: an adapter's own is read against it
        self._slot_of: dict[str, tuple[int, str]] = {}  # name -> (slot, content hash)
        self._slot_lru: OrderedDict[int, str | None] = OrderedDict((i, None) for i in range(max_loras))
        self.num_slot_loads = 0

    # ---- registration (any thread) ----------------------------------------------------------

    def load(self, name: str, path: str, replace: bool = False, confined: bool = False) -> AdapterInfo:
        """Read, validate and register a PEFT folder. `confined`: the path came from a client and
        was checked to lie inside an adapter root; the read then follows no symbolic link."""
        if not name or not isinstance(name, str) or ":" in name or not name.isprintable() \
                or name != name.encode("utf-8", "replace").decode("utf-8"):
            raise AdapterError(f"adapter name must be a non-empty, printable UTF-8 string without ':', got {name!r}")
        with self._lock:
            if name in self._adapters and not replace:
                raise AdapterError(f"adapter {name!r} is already loaded (from {self._adapters[name].path})")
        weights = self._read(name, path, confined)  # slow part, unlocked
        info = AdapterInfo(name, weights.path, weights.rank, weights.content_hash, confined,
                           tuple(sorted(weights.target_modules)), tuple(sorted(weights.modules_to_save)), weights.kinds)
        if self.verify is not None:
            self.verify(info, weights)
        with self._lock:
            if name in self._adapters:
                if not replace:
                    raise AdapterError(f"adapter {name!r} is already loaded (from {self._adapters[name].path})")
                self._check_unpinned(name)
            self._adapters[name] = info
            self._cache(weights)
        return info

    def unload(self, name: str) -> None:
        with self._lock:
            self.get(name)
            self._check_unpinned(name)
            del self._adapters[name]
            self._drop(name)
            held = self._slot_of.get(name)
            if held is not None:  # a stacked slot outlives its CPU copy, not its adapter
                self._vacate(held[0])

    def get(self, name: str) -> AdapterInfo:
        with self._lock:
            info = self._adapters.get(name)
        if info is None:
            raise UnknownAdapterError(name)
        return info

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return list(self._adapters.values())

    def pin(self, name: str, weights: LoRAWeights | None = None) -> AdapterInfo:
        """Hold the adapter for a request. `weights` (from `prefetch`) go back into the CPU cache
        if the LRU dropped them meanwhile, so the engine thread never reads disk for them."""
        with self._lock:
            info = self.get(name)
            if weights is not None:
                if weights.content_hash != info.content_hash:
                    raise AdapterError(f"adapter {name!r} was replaced while the request was queued; retry")
                if name not in self._cpu:
                    self._cache(weights)
            self._pins[name] += 1
            return info

    def pin_all(self, names: tuple[str, ...], weights: tuple[LoRAWeights | None, ...]) -> list[AdapterInfo]:
        """`pin` for each adapter of a mix, all or none: a failed one leaves none of them pinned."""
        pinned: list[AdapterInfo] = []
        with self._lock:
            try:
                for name, prefetched in zip(names, weights, strict=True):
                    pinned.append(self.pin(name, prefetched))
            except BaseException:
                for info in pinned:
                    self.unpin(info.name)
                raise
        return pinned

    def unpin(self, name: str) -> None:
        with self._lock:
            if self._pins[name] <= 0:
                raise RuntimeError(f"adapter {name!r} unpinned more often than pinned")
            self._pins[name] -= 1
            if not self._pins[name]:
                del self._pins[name]
                self._trim()  # pinned adapters may have pushed the cache over its budget

    def status(self) -> dict[str, AdapterStatus]:
        """Each registered adapter's residency, for the console."""
        with self._lock:
            return {name: AdapterStatus(name in self._slot_of, name in self._cpu, self._pins[name])
                    for name in self._adapters}

    def num_pins(self, name: str | None = None) -> int:
        with self._lock:
            return self._pins[name] if name else sum(self._pins.values())

    def _check_unpinned(self, name: str) -> None:
        if self._pins[name]:
            raise AdapterInUseError(f"adapter {name!r} is in use by {self._pins[name]} request(s); "
                                    f"unload it once they finish")

    def prefetch(self, name: str) -> LoRAWeights:
        """The adapter's weights in CPU memory, read from disk in the caller's thread if the LRU
        dropped them; hand them to `pin`, so the engine thread never reads disk for them."""
        return self._weights(self.get(name))

    def memory(self) -> tuple[int, int]:
        """(adapters, bytes) held in the CPU cache now."""
        with self._lock:
            return len(self._cpu), self._cpu_bytes

    def _read(self, name: str, path: str, confined: bool) -> LoRAWeights:
        return read_peft_adapter(name, path, self.config, self.max_lora_rank, self.dtype, confined, self._slots.base,
                                 self._slots.norm_dims, self.base_tokenizer)

    def _cache(self, weights: LoRAWeights) -> None:
        self._drop(weights.name)
        self._cpu[weights.name] = weights
        self._cpu_bytes += weights.nbytes
        self._trim(keep=weights.name)

    def _trim(self, keep: str | None = None) -> None:
        # least recently used first, but never an adapter that requests are using
        evictable = [n for n in self._cpu if not self._pins[n] and n != keep]
        while evictable and self._over_budget():
            self._drop(evictable.pop(0))

    def _over_budget(self) -> bool:
        return (self.max_cpu_loras is not None and len(self._cpu) > self.max_cpu_loras) or \
            (self.lora_memory is not None and self._cpu_bytes > self.lora_memory)

    def _drop(self, name: str) -> None:
        """Forget an unpinned adapter's weights: out of the cache, and on the CPU out of its slot too, so memory
        is really returned (a CPU slot holds references to the weights it points at). A stacked slot holds its
        own device copy in memory allocated once: it stays, and the adapter's next request uses it with no
        reload (emptying it cost every finished request a write per table)."""
        weights = self._cpu.pop(name, None)
        if weights is not None:
            self._cpu_bytes -= weights.nbytes
        held = self._slot_of.get(name)
        if held is not None and not self._pins[name] and not self._slots.stacked:
            self._vacate(held[0])

    # ---- slots (engine thread) --------------------------------------------------------------

    @property
    def slots(self) -> LoRASlots:
        return self._slots

    def assign_slots(self, names: set[str]) -> dict[str, int]:
        """Give every named adapter a slot, reusing the least recently used slots that hold none
        of them. On the CPU a slot points at the adapter's weights in the cache (no copy; stacked
        slots copy them to the device). The
        scheduler admits at most `max_loras` distinct adapters at once."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"{len(names)} adapters in flight, max_loras={self.max_loras}")
        with self._lock:
            wanted = {n: self._adapters[n] for n in sorted(names)}  # sorted: deterministic slots
        out = {}
        for name, info in wanted.items():
            held = self._slot_of.get(name)
            if held is None or held[1] != info.content_hash:
                weights = self._weights(info)  # pinned adapters are in memory: no disk read here
                with self._lock:
                    slot = next(s for s, holder in self._slot_lru.items() if holder not in names)
                    self._vacate(slot)
                    self._slots.load(slot, weights)
                    self._slot_of[name], self._slot_lru[slot] = (slot, info.content_hash), name
                self.num_slot_loads += 1
            with self._lock:
                slot = self._slot_of[name][0]
                self._slot_lru.move_to_end(slot)
            out[name] = slot
        return out

    def _vacate(self, slot: int) -> None:
        holder = self._slot_lru[slot]
        if holder is not None and self._slot_of.get(holder, (None,))[0] == slot:
            del self._slot_of[holder]
        self._slot_lru[slot] = None
        self._slots.clear(slot)

    def _weights(self, info: AdapterInfo) -> LoRAWeights:
        with self._lock:
            weights = self._cpu.get(info.name)
            if weights is not None and weights.content_hash == info.content_hash:
                self._cpu.move_to_end(info.name)
                return weights
        weights = self._read(info.name, info.path, info.confined)
        if weights.content_hash != info.content_hash:
            raise AdapterError(f"adapter {info.name!r} changed on disk since it was loaded ({info.path})")
        with self._lock:
            self._cache(weights)
        return weights
