"""What every route of one server shares: the engine client, the settings, the adapter
directory and the metrics; stored on the app, read by routes through `state_of`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from loraplex.api.batch.service import BatchService
from loraplex.api.sources.adapter_directory import AdapterDirectory, SharedAdapters
from loraplex.api.sources.adapter_roots import relative_to, spellings
from loraplex.api.admin.audit import AuditLog
from loraplex.api.admin.ledger import RemoteLedger, UsageLedger
from loraplex.api.tenancy.callers import OPEN, Caller
from loraplex.api.admin.metrics import ServerMetrics
from loraplex.api.openai.response_store import ResponseStore
from loraplex.api.tenancy.quotas import TenantLimits
from loraplex.api.settings import ServerConfig
from loraplex.api.tenancy.tenants import TenantRegistry
from loraplex.api.tracing import NoTracing, Tracing, tracing_for
from loraplex.platform.engine.engine_client import EngineClient


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
    tracing: Tracing = field(default_factory=NoTracing)  # OpenTelemetry spans (--otlp-traces-endpoint)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0, 0))  # stored /v1/responses
    batches: BatchService | None = None  # the Files and Batch APIs (api/batch/); None: no batch_dir, they are off

    @classmethod
    def create(cls, client: EngineClient, config: ServerConfig, shared: SharedAdapters | None = None,
               ledger: RemoteLedger | None = None):
        """The state of a server for `config`; a tenants file that cannot be used is a TenantsError.
        `ledger`: where usage is billed when not in `config.usage_db` (a Ray replica: the cluster's)."""
        tenants = TenantRegistry(config.tenants_file, (config.admin_api_key, config.metrics_api_key, config.api_key))
        metrics = ServerMetrics(client.stats, ledger or UsageLedger(config.usage_db))
        metrics.residency.status = lambda: client.adapter_status()  # read at scrape time: building asks nothing
        adapters = AdapterDirectory(client, config, shared, lambda store: setattr(metrics.adapter_store, "store", store))
        return cls(client, config, adapters, metrics, tenants, TenantLimits(share=config.tenant_limit_share),
                   AuditLog(config.audit_log), tracing=tracing_for(config),
                   responses=ResponseStore(config.responses_store_max_count, config.responses_store_max_bytes),
                   batches=BatchService(config, tenants) if config.batch_dir else None)

    @property
    def ledger(self) -> UsageLedger | RemoteLedger:
        return self.metrics.ledger

    def redacted(self, text: str, caller: Caller = OPEN) -> str:
        """`text` with the server's folders (the model's, the adapter roots, each adapter's, as
        given and as resolved) replaced by placeholders, longest first: a message may name a
        file inside one. A tenant's own adapter root goes first, leaving paths relative to it: it
        knows its own folders by those names, and the server's layout stays hidden."""
        root = caller.tenant.adapter_root if caller.tenant is not None else None
        if root:
            text = relative_to(text, root)
        for folder, placeholder in sorted(self._folders(), key=lambda f: -len(f[0])):
            text = text.replace(folder, placeholder)
        return text

    def _folders(self) -> set[tuple[str, str]]:
        named = [(self.config.model_path, "<model folder>"),
                 *((root, "<adapter root>") for root in self.config.adapter_roots),
                 *((a.path, "<adapter folder>") for a in self.client.list_adapters())]
        return {(path, placeholder) for folder, placeholder in named for path in spellings(folder)}


def state_of(request: Request) -> ServerState:
    """The route dependency: this app's state."""
    return request.app.state.loraplex
