"""Which adapters this server answers for, and changing that: `model` -> adapter (never a
silent fallback to the base model), first-use loads (a shared name, or the resolver's folder),
admin load and unload. The names come from the engine's registry, or from a `SharedAdapters`
set when the server is one of several replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Protocol

from loraplex.api.adapter_roots import AdapterRoots
from loraplex.api.errors import APIError
from loraplex.api.model_name import adapter_of
from loraplex.api.settings import ServerConfig
from loraplex.platform.engine_client import AdapterInfo, EngineClient, UnknownAdapterError

log = logging.getLogger(__name__)


class SharedAdapters(Protocol):
    """Adapter names shared by several servers (Ray Serve replicas, `api/ray_serve.py`): each
    server serves every name here, reading it on first use, and the admin endpoints change
    the shared set. Without one, a server's adapters are its own registry's."""

    async def get(self, name: str) -> AdapterInfo | None: ...

    async def list(self) -> list[AdapterInfo]: ...

    async def register(self, info: AdapterInfo) -> bool: ...  # False: the name is taken

    async def unregister(self, name: str) -> bool: ...  # False: no such name


class AdapterDirectory:
    def __init__(self, client: EngineClient, config: ServerConfig, shared: SharedAdapters | None = None) -> None:
        self.client, self.config, self.shared = client, config, shared
        self.roots = AdapterRoots(config.adapter_roots)
        self._loading: dict[str, asyncio.Future] = {}  # adapter name -> its one load in flight

    async def infos(self) -> list[AdapterInfo]:
        """The adapters this server answers for: the shared set's, else its own."""
        return await self.shared.list() if self.shared is not None else self.client.list_adapters()

    def _here(self, name: str) -> bool:
        return bool(name) and name in {a.name for a in self.client.list_adapters()}

    async def resolve(self, model: str) -> str | None:
        """The adapter `model` names, None for the base model; read first if it is not here yet
        (off the event loop and the engine thread; concurrent first requests share one load)."""
        name = adapter_of(model, self.config.served_model_name)
        if name is None:
            return None
        source = await self._source(name)
        if source is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        if source is not True:
            await self._load_once(name, *source)
        return name

    async def _source(self, name: str) -> tuple[Path, bool] | bool | None:
        """True: served here already; (folder, confined): to read first; None: unknown. The
        shared set decides, also for a copy still held here; else the registry, else (with the
        resolver on) a PEFT folder of that name directly inside an adapter root."""
        if self.shared is not None and name:
            shared = await self.shared.get(name)
            if shared is None:
                return None
            if self._here(name):
                return True
            return (self.roots.path(shared.path), True) if shared.confined else (Path(shared.path), False)
        if self._here(name):
            return True
        path = self.roots.find(name) if self.config.enable_lora_resolver and name else None
        return None if path is None else (path, True)

    async def _load_once(self, name: str, path: Path, confined: bool) -> None:
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
                raise APIError(400, f"adapter {name!r} could not be loaded: {exc}", "model") from None

    async def load(self, name: str, lora_path: str) -> None:
        """The admin load: a folder inside an adapter root, under a name not taken (here or, for
        a replica, anywhere in the shared set)."""
        taken = APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name in {a.name for a in await self.infos()}:
            raise taken
        path = self.roots.path(lora_path)
        try:
            info = await self.client.load_adapter(name, str(path), True)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        if self.shared is not None and not await self.shared.register(info):  # another replica won
            with contextlib.suppress(ValueError):
                self.client.unload_adapter(name)
            raise taken
        log.info("loaded adapter %r from %s", name, path)

    async def unload(self, name: str) -> None:
        """The admin unload; a replica's copy goes once its requests end (ray_serve.py)."""
        missing = APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        if self.shared is not None:
            if not await self.shared.unregister(name):
                raise missing
        else:
            try:
                self.client.unload_adapter(name)
            except UnknownAdapterError:
                raise missing from None
        log.info("unloaded adapter %r", name)
