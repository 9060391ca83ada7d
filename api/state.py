"""What every route of one server shares: the engine client, the settings, the adapter
directory and the metrics; stored on the app, read by routes through `state_of`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from fastapi import Request

from loraplex.api.adapter_directory import AdapterDirectory, SharedAdapters
from loraplex.api.audit import AuditLog
from loraplex.api.metrics import ServerMetrics
from loraplex.api.quotas import TenantLimits
from loraplex.api.settings import ServerConfig
from loraplex.api.tenants import TenantRegistry
from loraplex.platform.engine_client import EngineClient


@dataclass
class ServerState:
    client: EngineClient
    config: ServerConfig
    adapters: AdapterDirectory
    metrics: ServerMetrics
    tenants: TenantRegistry = field(default_factory=lambda: TenantRegistry(None))
    limits: TenantLimits = field(default_factory=TenantLimits)
    audit: AuditLog = field(default_factory=lambda: AuditLog(None))
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(cls, client: EngineClient, config: ServerConfig, shared: SharedAdapters | None = None):
        """The state of a server for `config`; a tenants file that cannot be used is a TenantsError."""
        tenants = TenantRegistry(config.tenants_file, (config.admin_api_key, config.metrics_api_key, config.api_key))
        return cls(client, config, AdapterDirectory(client, config, shared), ServerMetrics(client.stats), tenants,
                   TenantLimits(share=config.tenant_limit_share), AuditLog(config.audit_log))

    def redacted(self, text: str) -> str:
        """`text` with the server's folders (the model's, the adapter roots, each adapter's, as
        given and as resolved) replaced by placeholders, longest first: a message may name a
        file inside one."""
        for folder, placeholder in sorted(self._folders(), key=lambda f: -len(f[0])):
            text = text.replace(folder, placeholder)
        return text

    def _folders(self) -> set[tuple[str, str]]:
        named = [(self.config.model_path, "<model folder>"),
                 *((root, "<adapter root>") for root in self.config.adapter_roots),
                 *((a.path, "<adapter folder>") for a in self.client.list_adapters())]
        folders = set()
        for folder, placeholder in named:
            for path in {folder, os.path.realpath(folder)} if folder else ():
                path = path.rstrip(os.sep)
                if os.path.isabs(path) and path:  # a relative name could match ordinary words
                    folders.add((path, placeholder))
        return folders


def state_of(request: Request) -> ServerState:
    """The route dependency: this app's state."""
    return request.app.state.loraplex
