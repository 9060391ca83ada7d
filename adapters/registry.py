"""The adapter registry: name -> adapter; its folder -> the disk tier (its prepared weights, `spill.py`) -> CPU
LRU (bounded by `lora_memory` bytes and optionally `max_cpu_loras`) -> slot (`max_loras` per batch); pins while
requests use an adapter; where each adapter is and what bringing it in cost (`residency`).

Loading reads and validates the folder in the caller's thread (never the engine's); only the
registration takes the lock. `unload` of a pinned adapter is refused with `AdapterInUseError`
(the API answers 409): weights are never pulled from under a running request. Slots are filled
by the engine thread between steps (`assign_slots`) or ahead of a step by the prefetcher's thread (`preload`),
which never touches a slot the last step used.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.adapters.peft_format import AdapterError, LoRAWeights, read_peft_adapter
from loraplex.adapters.slots import LoRASlots
from loraplex.adapters.spill import SpillStore
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
    tier: str = "disk"  # where it is now: "slot", "cpu", "spill" (its prepared file) or "disk" (its folder)
    hits: int = 0  # requests (and slot fills) that found it in memory
    misses: int = 0  # reads it needed: from its prepared file or its folder
    bytes_read: int = 0  # bytes those reads brought into memory


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0


def preloadable(weights: LoRAWeights) -> bool:
    """Whether filling its slot touches LoRA factors only, which `preload` may do beside a running step (the
    tables of biases, DoRA's factors, norms, experts and the vocabulary are the engine thread's)."""
    return not (weights.eager or weights.embedding is not None or weights.head is not None or weights.replacements
                or weights.tokens or weights.moe or weights.norms
                or any(t.bias is not None or t.factor is not None or t.replacement is not None
                       for t in weights.terms.values()))


class AdapterRegistry:
    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, lora_memory: int | None = None, device: torch.device | None = None,
                 stacked: bool = False, spill: SpillStore | None = None) -> None:
        """`stacked`: slots are copies on `device` (the Triton kernels' layout), not pointers. `spill`: the disk tier
        (None: what the CPU cache drops is read from its folder again)."""
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
        self._busy: set[int] = set()  # the slots the last `assign_slots` gave out: its step may be reading them
        self._loading: set[int] = set()  # slots `preload` is filling outside the lock
        self._loaded = threading.Condition(self._lock)  # a fill of `preload` ended
        self.spill = spill
        self._counters: dict[str, Counters] = {}
        self.totals = Counters()  # over every adapter ever loaded: what /metrics counts (never goes down)
        self.num_slot_loads = 0  # slot fills of the engine thread
        self.num_preloads = 0  # slot fills of the prefetcher's
        self.num_step_loads = 0  # slot fills `assign_slots` had to do itself (a step waited on them)
        self.num_step_reads = 0  # reads `assign_slots` had to do itself (weights not in memory)

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
                if self.spill is not None:
                    self.spill.drop(name)  # the old version's prepared file
            self._adapters[name] = info
            self._cache(weights)
        return info

    def unload(self, name: str) -> None:
        with self._lock:
            self.get(name)
            self._check_unpinned(name)
            del self._adapters[name]
            self._drop(name)
            self._counters.pop(name, None)
            if self.spill is not None:
                self.spill.drop(name)
            held = self._slot_of.get(name)
            if held is not None:  # a stacked slot outlives its CPU copy, not its adapter
                self._vacate(held[0])

    def close(self) -> None:
        """Stop the disk tier's writer and remove its files."""
        if self.spill is not None:
            self.spill.close()

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
        """Each registered adapter's residency and what bringing it in cost, for the console and /v1/adapters."""
        with self._lock:
            return {name: self._status_of(name) for name in self._adapters}

    def _status_of(self, name: str) -> AdapterStatus:
        counters = self._counters.get(name) or Counters()
        return AdapterStatus(name in self._slot_of, name in self._cpu, self._pins[name], self._tier(name),
                             counters.hits, counters.misses, counters.bytes_read)

    def _tier(self, name: str) -> str:
        if name in self._slot_of:
            return "slot"
        if name in self._cpu:
            return "cpu"
        info = self._adapters.get(name)
        return "spill" if info is not None and self.spill is not None and \
            self.spill.has(name, info.content_hash) else "disk"

    def ready(self, names: tuple[str, ...]) -> bool:
        """Whether a step could use these adapters without waiting on a copy: stacked slots hold them (an adapter
        `preload` does not take, with more than LoRA factors, once in memory: the step fills its slot); on the CPU
        (a slot is a pointer) their weights are in memory."""
        with self._lock:
            if not self._slots.stacked:
                return all(name in self._cpu for name in names)
            return all(self._holds_current(name) or
                       (name in self._cpu and not preloadable(self._cpu[name])) for name in names)

    def needs_slot(self, name: str) -> bool:
        """Whether `name` holds no slot with its current weights (what the prefetcher is asked to fill)."""
        with self._lock:
            return name in self._adapters and not self._holds_current(name)

    def _holds_current(self, name: str) -> bool:
        held, info = self._slot_of.get(name), self._adapters.get(name)
        return held is not None and info is not None and held[1] == info.content_hash and held[0] not in self._loading

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
            name = evictable.pop(0)
            weights = self._cpu.get(name)
            self._drop(name)
            if self.spill is not None and weights is not None:
                self.spill.keep(weights)  # written by its own thread: comes back in one read

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
        """Give every named adapter a slot for this step (the engine thread). Those the prefetcher filled (or
        earlier steps left) are used as they are, all marked the step's at once, so `preload` takes none of them;
        any other takes the least recently used slot that holds none of them, filled here: the step waits on that
        (`num_step_loads`), as it waits for a fill `preload` has under way for one of them. On the CPU a slot points
        at the adapter's weights in the cache (no copy); stacked slots copy them to the device. The scheduler admits
        at most `max_loras` distinct adapters at once."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"{len(names)} adapters in flight, max_loras={self.max_loras}")
        with self._lock:
            wanted = {n: self._adapters[n] for n in sorted(names)}  # sorted: deterministic slots
            if self._loading:
                self._loaded.wait_for(lambda: not any(self._slot_of.get(n, (None,))[0] in self._loading
                                                      for n in wanted))
            current = [n for n in wanted if self._holds_current(n)]
            self._busy = {self._slot_of[n][0] for n in current}
            if len(current) == len(wanted):  # every one in its slot (a decode step's usual case): one lock, one pass
                return {n: self._use(n) for n in current}
        out = {}
        for name, info in wanted.items():
            with self._lock:
                if self._holds_current(name):
                    out[name] = self._use(name)
                    continue
            out[name] = self._fill_for_step(name, info, names)
        return out

    def _use(self, name: str) -> int:
        slot = self._slot_of[name][0]
        self._slot_lru.move_to_end(slot)
        self._busy.add(slot)
        return slot

    def _fill_for_step(self, name: str, info: AdapterInfo, names: set[str]) -> int:
        with self._lock:
            in_memory = name in self._cpu
        weights = self._weights(info)  # pinned adapters are in memory: no disk read here
        self.num_step_reads += not in_memory
        with self._lock:
            while True:  # a fill of `preload` may end (for this adapter too) while the step waits for a slot
                if self._holds_current(name):
                    return self._use(name)
                own = self._slot_of.get(name, (None,))[0]
                free = [s for s, holder in self._slot_lru.items() if s not in self._loading and s not in self._busy
                        and (holder not in names or holder == name)]
                if own not in self._loading and free:
                    break
                self._loaded.wait()  # a slot is under way (this adapter's, or every free one): it ends
            slot = own if own in free else free[0]  # its own stale copy first (a replaced adapter)
            if own is not None and own != slot:
                self._vacate(own)
            self._vacate(slot)
            self._slots.load(slot, weights)
            self._slot_of[name], self._slot_lru[slot] = (slot, info.content_hash), name
            self.num_slot_loads += 1
            self.num_step_loads += 1
            return self._use(name)

    def preload(self, name: str, keep: set[str]) -> bool:
        """Bring `name` into a slot ahead of the step that needs it (the prefetcher's thread): into a slot the last
        step did not use and no adapter in `keep` holds (empty first, else least recently used); its weights read
        into memory first if the cache dropped them. Only adapters of LoRA factors alone (`preloadable`): the
        fill writes their tables outside the lock, beside the running step. False where no such slot is free
        now, or it is not loaded."""
        with self._lock:
            info = self._adapters.get(name)
            if info is None or self._pins[name] == 0 or self._slots.listeners:
                return False  # unloaded, its requests gone, or slots mirrored to other ranks by the engine thread
            if self._holds_current(name) or self._slot_of.get(name, (None,))[0] in self._loading:
                return True
        weights = self._weights(info)
        if not preloadable(weights):
            return False
        with self._lock:
            if info is not self._adapters.get(name) or name in self._slot_of:
                return self._holds_current(name)
            free = [s for s, holder in self._slot_lru.items()
                    if s not in self._busy and s not in self._loading and holder not in keep]
            if not free:
                return False
            slot = next((s for s in free if self._slot_lru[s] is None), free[0])
            self._vacate(slot)
            self._loading.add(slot)
            self._slot_of[name], self._slot_lru[slot] = (slot, info.content_hash), name
        filled = False
        try:
            self._slots.load_projections(slot, weights)  # outside the lock: a stacked slot is a device copy
            filled = True
        finally:
            with self._lock:
                try:
                    self._loading.discard(slot)
                    self.num_preloads += filled
                    if not filled or self._adapters.get(name) is not info or self._slot_lru[slot] != name:
                        self._vacate(slot)  # failed, or unloaded or replaced while it was copied
                finally:
                    self._loaded.notify_all()  # a step may be waiting on this slot, whatever happened
        return True

    def _vacate(self, slot: int) -> None:
        """Empty a slot (never one `preload` is filling: that one is emptied when its fill ends, if it must)."""
        holder = self._slot_lru[slot]
        if holder is not None and self._slot_of.get(holder, (None,))[0] == slot:
            del self._slot_of[holder]
        self._slot_lru[slot] = None
        if slot not in self._loading:
            self._slots.clear(slot)

    def _weights(self, info: AdapterInfo) -> LoRAWeights:
        """The adapter's weights: from the CPU cache (a hit), else its prepared file, else its folder (a miss)."""
        with self._lock:
            weights = self._cpu.get(info.name)
            counters = self._counters.setdefault(info.name, Counters()) if info.name in self._adapters else Counters()
            if weights is not None and weights.content_hash == info.content_hash:
                self._cpu.move_to_end(info.name)
                counters.hits += 1
                self.totals.hits += 1
                return weights
        weights = self.spill.read(info.name, info.content_hash, self.dtype) if self.spill is not None else None
        if weights is None:
            weights = self._read(info.name, info.path, info.confined)
            if weights.content_hash != info.content_hash:
                raise AdapterError(f"adapter {info.name!r} changed on disk since it was loaded ({info.path})")
        with self._lock:
            counters.misses += 1
            counters.bytes_read += weights.nbytes
            self.totals.misses += 1
            self.totals.bytes_read += weights.nbytes
            if info.name in self._adapters:  # not unloaded meanwhile
                self._cache(weights)
        return weights
