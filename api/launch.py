"""What `loraplex serve` starts from, read off its parsed flags: the model folder, the engine's settings and
the server's. Shared by both ways of serving, one server (`api/serve.py`) and Ray Serve replicas
(`api/cluster/ray_serve.py`), and by the command line that declares the flags (`api/cli.py`), which sits
above all three and only parses and dispatches."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from loraplex.api.flags import add_flags, values
from loraplex.api.settings import ServerConfig
from loraplex.api.tenancy.tenants import TenantRegistry
from loraplex.api.tracing import traces_url
from loraplex.platform.config import EngineConfig
from loraplex.platform import model_store
from loraplex.platform.model_store import materialize_default_model


def model_folder(model: str | None) -> str:
    """The model folder given, else the default model's (converted on first use)."""
    if model is not None:
        return str(Path(model).resolve())
    return str(materialize_default_model())


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field (but `model`)."""
    add_flags(parser, EngineConfig, skip=("model",))


def engine_args(args: argparse.Namespace) -> dict:
    """The parsed engine flags, as EngineConfig keyword arguments."""
    return values(EngineConfig, args, skip=("model",))


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig(model=model, **engine_args(args))


def server_config(args: argparse.Namespace, model: str) -> ServerConfig:
    """The server flags; the served name defaults to the model folder's name."""
    config = ServerConfig(**values(ServerConfig, args))
    for root in config.adapter_roots:
        if not Path(root).is_dir():
            raise ValueError(f"--adapter-root {root!r} is not a folder")
    if config.otlp_traces_endpoint:  # a bad URL fails here, before the model is loaded
        traces_url(config.otlp_traces_endpoint)
    if config.tenants_file:  # a broken file fails here, before the model is loaded
        TenantRegistry(config.tenants_file, (config.admin_api_key, config.metrics_api_key, config.api_key))
    return dataclasses.replace(config, served_model_name=config.served_model_name or Path(model).name,
                               model_path=model, usage_db=usage_db(config),
                               batch_dir=batch_dir(config, getattr(args, "ray", False)),
                               # under --ray each replica would keep its own: a stored id would be found by chance
                               responses_store_max_count=0 if getattr(args, "ray", False) else
                               config.responses_store_max_count)


def usage_db(config: ServerConfig) -> str | None:
    """The ledger's file: as given, `usage-PORT.db` in the cache by default, None for 'memory'."""
    if config.usage_db == "memory":
        return None
    if config.usage_db:
        path = Path(config.usage_db).resolve()
        if not path.parent.is_dir():
            raise ValueError(f"--usage-db {config.usage_db!r}: its folder does not exist")
        return str(path)
    folder = model_store.cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"usage-{config.port}.db")


def batch_dir(config: ServerConfig, ray: bool = False) -> str | None:
    """The Files and Batch APIs' folder: as given (made here if missing: one that cannot be fails
    before the model is loaded), `batches-PORT` in the cache by default (made when the server starts).
    None under `--ray`: the ingress sends each request to any replica, so a file uploaded to one would
    be missing on the next; the APIs answer that they are off instead."""
    if ray:
        return None
    if not config.batch_dir:
        return str(model_store.cache_dir() / f"batches-{config.port}")
    folder = Path(config.batch_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)
