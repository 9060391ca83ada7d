"""What every route of one server shares: the engine client, the settings, the adapter
directory and the metrics; stored on the app, read by routes through `state_of`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from loraplex.api.adapter_directory import AdapterDirectory, SharedAdapters
from loraplex.api.metrics import ServerMetrics
from loraplex.api.settings import ServerConfig
from loraplex.platform.engine_client import EngineClient


@dataclass
class ServerState:
    client: EngineClient
    config: ServerConfig
    adapters: AdapterDirectory
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(cls, client: EngineClient, config: ServerConfig, shared: SharedAdapters | None = None):
        return cls(client, config, AdapterDirectory(client, config, shared), ServerMetrics(client.stats))


def state_of(request: Request) -> ServerState:
    """The route dependency: this app's state."""
    return request.app.state.loraplex
