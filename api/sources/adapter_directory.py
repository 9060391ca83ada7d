"""Which adapters this server answers for, and changing that: `model` -> adapter (never a
silent fallback to the base model), first-use loads (a shared name, or the resolver's folder),
admin load and unload. The names come from the engine's registry, or from a `SharedAdapters`
set when the server is one of several replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

from loraplex.api.sources.adapter_roots import AdapterRoots, relative_to
from loraplex.api.tenancy.callers import OPEN, Caller
from loraplex.api.errors import APIError, bad_input, unknown_adapter
from loraplex.api.openai.model_name import adapter_of
from loraplex.api.sources.store_loader import StoreLoader
from loraplex.api.settings import ServerConfig
from loraplex.api.tracing import adapter_load
from loraplex.platform.engine.engine_client import (AdapterInfo, AdapterInUseError, AdapterMix, EngineClient,
                                             UnknownAdapterError, parse_mix)

log = logging.getLogger(__name__)


STORE = "store"  # `_source`: the name is to be looked up in object storage


class SharedAdapters(Protocol):
    """Adapter names shared by several servers (Ray Serve replicas, `api/cluster/ray_serve.py`): each
    server serves every name here, reading it on first use, and the admin endpoints change
    the shared set. Without one, a server's adapters are its own registry's."""

    async def get(self, name: str) -> AdapterInfo | None: ...

    async def list(self) -> list[AdapterInfo]: ...

    async def register(self, info: AdapterInfo) -> bool: ...  # False: the name is taken

    async def unregister(self, name: str) -> bool: ...  # False: no such name


class AdapterDirectory:
    def __init__(self, client: EngineClient, config: ServerConfig, shared: SharedAdapters | None = None,
                 on_store=None) -> None:
        """`on_store(store)`: told when the object-storage store is made (the metrics read its counts)."""
        self.client, self.config, self.shared = client, config, shared
        self.roots = AdapterRoots(config.adapter_roots)
        self._loading: dict[str, asyncio.Future] = {}  # adapter name -> its one load in flight
        self.objects = StoreLoader(client, config, self._loading, on_store)  # adapters from object storage

    async def infos(self, caller: Caller = OPEN) -> list[AdapterInfo]:
        """The adapters this server answers for (the shared set's, else its own) that `caller` may use."""
        infos = await self.shared.list() if self.shared is not None else self.client.list_adapters()
        return [info for info in infos if caller.may_use(info.name) and self.objects.usable(info, caller)]

    def _loaded(self, name: str) -> AdapterInfo | None:
        return next((a for a in self.client.list_adapters() if a.name == name), None) if name else None

    def _here(self, name: str, caller: Caller = OPEN) -> bool:
        info = self._loaded(name)
        return info is not None and self.objects.usable(info, caller)

    async def resolve(self, model: str, caller: Caller = OPEN) -> str | None:
        """The adapter `model` names, None for the base model; read first if it is not here yet
        (off the event loop and the engine thread; concurrent first requests share one load). What
        `caller` may not use is the same 404 as what does not exist."""
        name = adapter_of(model, self.config.served_model_name)
        missing = f"The model `{model}` does not exist."
        unknown_adapter.set(lambda gone: APIError(404, missing, "model"))
        if name is None:
            if not caller.may_use(None):
                raise APIError(404, missing, "model")
            return None
        await self._ensure(name, caller, missing, "model")
        return name

    def check_visible(self, model: str, caller: Caller = OPEN) -> None:
        """A 404 unless `model` is the base model or an adapter served here that `caller` may use (nothing is
        loaded: for requests that only read the tokenizer)."""
        name = adapter_of(model, self.config.served_model_name)
        if not caller.may_use(name) or (name is not None and caller.tenant is not None and not self._here(name, caller)):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def resolve_mix(self, model: str, weights: list[tuple[str, float]] | None,
                          caller: Caller = OPEN) -> str | AdapterMix | None:
        """What a generation request runs on: `model`'s adapter, or, given `adapters`, their mix on
        the base model (each adapter read first where needed). One adapter at weight 1 is that adapter."""
        if weights is None:
            return await self.resolve(model, caller)
        base = self.config.served_model_name
        if model != base:
            raise APIError(400, f"adapters: with a mix of adapters, model names the base model `{base}`, "
                                f"got `{model}`", "adapters")
        with bad_input("adapters"):
            mix = parse_mix(weights, self.client.max_adapters_per_request, "adapters")
        unknown_adapter.set(lambda gone: _missing_from_mix(mix, gone))
        for i, name in enumerate(mix.names):
            await self._ensure(name, caller, f"The adapter `{name}` does not exist.", f"adapters[{i}].name")
        return mix.plain or mix

    async def _ensure(self, name: str, caller: Caller, missing: str, param: str) -> None:
        """`name` served here, read first if needed; a 404 saying `missing` if it is unknown (or not
        `caller`'s to use)."""
        if not caller.may_use(name):
            raise APIError(404, missing, param)
        source = await self._source(name, caller)
        if source is None:
            raise APIError(404, missing, param)
        if source == STORE:
            with adapter_load(name):  # the call's `adapter_load` span (api/tracing.py)
                await self.objects.fetch_once(name, self.objects.sources_of(caller), missing, param)
            if not self._here(name, caller):  # the load it waited for was another caller's, from another source
                raise APIError(404, missing, param)
        elif source is True:
            await self.objects.refresh(name)
        else:
            with adapter_load(name):
                await self._load_once(name, *source, param)

    async def _source(self, name: str, caller: Caller = OPEN) -> tuple[Path, bool] | bool | str | None:
        """True: served here already; (folder, confined): to read first; STORE: to look up in object storage;
        None: unknown. The shared set decides, also for a copy still held here; else the registry, else (with
        the resolver on) a PEFT folder of that name directly inside an adapter root, else (with sources) the
        caller's object storage."""
        if self.shared is not None and name:
            shared = await self.shared.get(name)
            if shared is None:
                return None
            if self._here(name):
                return True
            return (self.roots.path(shared.path), True) if shared.confined else (Path(shared.path), False)
        loaded = self._loaded(name)
        if loaded is not None:
            return True if self.objects.usable(loaded, caller) else None
        path = self.roots.find(name) if self.config.enable_lora_resolver and name else None
        if path is not None:
            return path, True
        return STORE if name and self.objects.sources_of(caller) else None

    async def _load_once(self, name: str, path: Path, confined: bool, param: str) -> None:
        load = self._loading.get(name)
        if load is None:
            load = asyncio.ensure_future(self.client.load_adapter(name, str(path), confined))
            self._loading[name] = load
            load.add_done_callback(lambda _: self._loading.pop(name, None))
            log.info("loading adapter %r from %s on first use", name, path)
        try:
            await asyncio.shield(load)
        except ValueError as exc:
            if not self._here(name):  # not loaded by anyone meanwhile
                raise APIError(400, f"adapter {name!r} could not be loaded: {exc}", param) from None

    async def load(self, name: str, lora_path: str, caller: Caller = OPEN) -> None:
        """The admin load: a folder inside an adapter root, under a name not taken (here or, for
        a replica, anywhere in the shared set). A tenant loads from its own root, names within its
        patterns."""
        if caller.tenant is not None and not caller.may_use(name):
            raise APIError(403, f"tenant {caller.tenant.name!r} loads adapters under its own names "
                                f"({', '.join(caller.tenant.adapters) or 'none'})", "lora_name")
        taken = APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name in {a.name for a in await self.infos()}:
            raise taken
        roots = self.roots if caller.tenant is None else AdapterRoots((caller.tenant.adapter_root,))
        with _worded_for(caller):
            path = roots.path(lora_path)
            try:
                info = await self.client.load_adapter(name, str(path), True)
            except ValueError as exc:
                raise APIError(400, str(exc), "lora_path") from None
        if self.shared is not None and not await self.shared.register(info):  # another replica won
            with contextlib.suppress(ValueError):
                self.client.unload_adapter(name)
            raise taken
        log.info("loaded adapter %r from %s", name, path)

    async def unload(self, name: str, caller: Caller = OPEN) -> None:
        """The admin unload; a replica's copy goes once its requests end (ray_serve.py). A tenant
        unloads only what it loaded (a folder inside its own root): another's adapter, even one its
        patterns match, is the same 404 as a missing one."""
        missing = APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        if not caller.may_use(name) or (caller.tenant is not None and not await self._loaded_by(name, caller)):
            raise missing
        if self.shared is not None:
            if not await self.shared.unregister(name):
                raise missing
        else:
            try:
                self.client.unload_adapter(name)
            except UnknownAdapterError:
                raise missing from None
            except AdapterInUseError:
                if caller.tenant is None:
                    raise
                # how many requests hold it would count other tenants' requests on a shared adapter
                raise APIError(409, f"The lora adapter '{name}' is in use; unload it once its requests finish.",
                               "lora_name") from None
        log.info("unloaded adapter %r", name)


    async def _loaded_by(self, name: str, caller: Caller) -> bool:
        """Whether adapter `name` was loaded from the caller's own adapter root."""
        root = caller.tenant.adapter_root
        info = next((a for a in await self.infos() if a.name == name), None)
        if info is None or not root or not info.path:
            return False
        folder, root = os.path.realpath(info.path), os.path.realpath(root)
        return os.path.commonpath([folder, root]) == root


def _missing_from_mix(mix: AdapterMix, name: str) -> APIError:
    """The 404 of a mix naming `name`, as `resolve_mix` words it."""
    if name not in mix.names:
        return APIError(404, f"The adapter `{name}` does not exist.", "adapters")
    return APIError(404, f"The adapter `{name}` does not exist.", f"adapters[{mix.names.index(name)}].name")


@contextlib.contextmanager
def _worded_for(caller: Caller):
    """An APIError raised inside as `caller` reads it: a tenant's own adapter root left out of the paths
    (its folders named relative to it; the server's folders are placeholders for it later, api/tenancy/auth.py)."""
    root = caller.tenant.adapter_root if caller.tenant is not None else None
    try:
        yield
    except APIError as exc:
        if not root:
            raise
        raise APIError(exc.status, relative_to(exc.message, root), exc.param, exc.retry_after) from None
