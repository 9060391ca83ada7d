"""Server and cluster settings: frozen dataclasses whose fields carry their default, help and
command-line spelling, as `EngineConfig`'s do. `loraplex serve` generates its flags from them
(`api/flags.py`), so each default is written once, here."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.api.cluster.placement import LOAD_EPSILON
from loraplex.api.sources.s3_source import parse_url
from loraplex.grammar.tooling.reasoning import PARSERS as REASONING_PARSERS
from loraplex.grammar.tooling.tools import PARSERS as TOOL_CALL_PARSERS

# adapter: placement by load and bounded-load routing (api/cluster/placement.py); affinity: Ray's model multiplexing
# alone; round-robin: Ray's RoundRobinRouter, adapter-blind (the last two: baselines)
ROUTINGS = ("adapter", "affinity", "round-robin")


def setting(default, help: str, **cli):
    """A setting: its default, and what `loraplex serve --help` says of it. `cli` may name the
    flag, its `dest`, `choices`, a `size` parser, a `metavar`, an `env` variable read when the
    flag is not given, `invert` (a `--disable-x` flag for a setting on by default), or
    `flag=None` (no flag: set in code only)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class ServerConfig:
    """One OpenAI-compatible server (also each Ray replica's app)."""

    served_model_name: str = setting("", "the base model's id (default: its folder's name)")
    model_path: str = setting("", "the base model's folder, shown as its card's root", flag=None)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    api_key: str | None = setting(None, "key for /v1/*, /tokenize, /detokenize (or LORAPLEX_API_KEY)",
                                  env="LORAPLEX_API_KEY")
    admin_api_key: str | None = setting(None, "the only key that opens the adapter admin endpoints and sees "
                                              "folder paths (or LORAPLEX_ADMIN_API_KEY); with --api-key and "
                                              "none, the admin endpoints are off", env="LORAPLEX_ADMIN_API_KEY")
    tenants_file: str | None = setting(None, "JSON (or .toml) file of tenants: API keys scoped to adapters, limits, "
                                             "weights (docs/tenants.md); SIGHUP or POST /v1/reload_tenants re-reads it",
                                       flag="--tenants", metavar="FILE")
    metrics_api_key: str | None = setting(None, "key that opens /metrics beside the admin key (or "
                                                "LORAPLEX_METRICS_API_KEY); /metrics is closed to others when "
                                                "either this or --tenants is set", env="LORAPLEX_METRICS_API_KEY")
    audit_log: str | None = setting(None, "append a JSON line per admin action and per refused caller (401, 403, "
                                          "429) to this file", metavar="FILE")
    tenant_limit_share: float = setting(1.0, "the part of each tenant's limits this server enforces (a Ray "
                                             "replica's: 1 / replicas)", flag=None)
    adapter_roots: tuple[str, ...] = setting((), "folder the admin endpoint may load adapters from (repeatable; "
                                                 "none: runtime loading off)", flag="--adapter-root", metavar="DIR")
    enable_lora_resolver: bool = setting(False, "serve an unregistered adapter name by loading the PEFT folder of "
                                                "that name from an --adapter-root on its first request")
    adapter_sources: tuple[str, ...] = setting((), "S3-compatible object storage holding adapters: an unknown "
                                                   "adapter name N is fetched from <prefix>/N/ on its first request "
                                                   "(repeatable, looked up in order; credentials from the AWS "
                                                   "environment/config chain)", flag="--adapter-source",
                                               metavar="s3://BUCKET/PREFIX")
    s3_endpoint_url: str | None = setting(None, "endpoint of an S3-compatible store (MinIO, R2, GCS's S3 API, ...); "
                                                "none: AWS S3", metavar="URL")
    adapter_cache_dir: str | None = setting(None, "where adapters fetched from object storage are kept (verified "
                                                  "again at start; default: adapter-cache in $LORAPLEX_CACHE or "
                                                  "~/.cache/loraplex)", metavar="DIR")
    adapter_cache_size: int = setting(20 * 2**30, "bytes of fetched adapters kept on disk (least recently used out "
                                                  "first; e.g. 50GiB)", size=True)
    adapter_source_ttl: float = setting(300.0, "seconds before a loaded adapter's objects are listed again (a "
                                               "changed ETag: the new version is loaded)")
    adapter_fetch_timeout: float = setting(30.0, "seconds the object store may take to connect or answer, per attempt")
    adapter_fetch_attempts: int = setting(3, "attempts per object-store request (exponential backoff between)")
    usage_db: str | None = setting(None, "SQLite file the usage ledger is kept in (every answered request's tokens "
                                         "per tenant and adapter, kept across restarts; default: usage-PORT.db in "
                                         "$LORAPLEX_CACHE or ~/.cache/loraplex; 'memory': not kept)", metavar="PATH")
    otlp_traces_endpoint: str | None = setting(None, "export OpenTelemetry spans of each request (queue, prefill, "
                                                     "decode, grammar compile, adapter load) over OTLP/HTTP to this "
                                                     "URL, e.g. http://127.0.0.1:4318/v1/traces (vLLM's flag); none: "
                                                     "nothing traced", metavar="URL")
    batch_dir: str | None = setting(None, "folder the Files and Batch APIs keep uploaded files, batches and their "
                                          "results in (kept across restarts: unfinished batches resume at start; "
                                          "default: batches-PORT in $LORAPLEX_CACHE or ~/.cache/loraplex; off under "
                                          "--ray, where each replica would keep its own)", metavar="DIR")
    max_file_bytes: int = setting(200 << 20, "largest file POST /v1/files takes (beyond this, 413; the request "
                                             "body limit does not apply to uploads)", size=True)
    max_batch_lines: int = setting(50000, "most request lines one batch's input file may hold")
    batch_concurrency: int = setting(8, "batch lines running at once, over all batches (each its own request, at "
                                        "the lowest priority): however many batches, interactive requests keep the "
                                        "queue")
    max_waiting_requests: int | None = setting(1024, "beyond this, 429 with Retry-After")
    max_request_body_bytes: int = setting(4 << 20, "beyond this, 413", size=True)
    request_timeout_s: float | None = setting(None, "seconds; beyond this, 504", flag="--request-timeout")
    shutdown_timeout_s: float = setting(30.0, "on SIGTERM, seconds in-flight requests get to finish",
                                        flag="--shutdown-timeout")
    # slow and stalled clients (api/serve.py's connection guard)
    read_timeout_s: float = setting(30.0, "seconds a client gets to send a request's headers and body; a slower "
                                          "connection is closed (slowloris)", flag="--read-timeout")
    keep_alive_timeout_s: float = setting(5.0, "seconds an idle keep-alive connection stays open",
                                          flag="--keep-alive-timeout")
    max_idle_connections: int = setting(256, "idle keep-alive connections kept open; beyond this the longest "
                                             "idle one is closed")
    stream_buffer_bytes: int = setting(128 << 10, "per connection, bytes of a response the server holds for a "
                                                  "client that has not read them; past this, writing waits",
                                       size=True)
    stall_timeout_s: float = setting(10.0, "seconds a client whose buffer is full may take no bytes; then its "
                                           "connection is dropped and its requests aborted (KV freed)",
                                     flag="--stall-timeout")
    responses_store_max_count: int = setting(10000, "stored responses (POST /v1/responses with store: true) kept "
                                                    "in memory; beyond this the oldest go")
    responses_store_max_bytes: int = setting(256 << 20, "bytes of stored responses kept; beyond this the oldest go",
                                             size=True)
    enable_ui: bool = setting(True, "no web console at /ui", flag="--disable-ui", invert=True)
    tool_call_parser: str = setting("auto", "the format tool calls are written and read in (vLLM's names); auto: "
                                            "from the markers in the chat template (hermes without any)",
                                    choices=[*TOOL_CALL_PARSERS, "auto"])
    reasoning_parser: str | None = setting(None, "the model thinks in <think>...</think> first: split into "
                                                 "reasoning_content and content, response_format and tool calls "
                                                 "apply after it, max_reasoning_tokens bounds it (vLLM's names)",
                                           choices=list(REASONING_PARSERS))

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (*TOOL_CALL_PARSERS, "auto"):
            raise ValueError(f"tool_call_parser must be one of {[*TOOL_CALL_PARSERS, 'auto']}, "
                             f"got {self.tool_call_parser!r}")
        if min(self.read_timeout_s, self.keep_alive_timeout_s, self.stall_timeout_s) <= 0:
            raise ValueError("read_timeout_s, keep_alive_timeout_s and stall_timeout_s must be > 0")
        if self.max_idle_connections < 0 or self.stream_buffer_bytes < 4096:
            raise ValueError("max_idle_connections must be >= 0 and stream_buffer_bytes >= 4096")
        for url in self.adapter_sources:
            parse_url(url)
        if self.adapter_fetch_timeout <= 0 or self.adapter_fetch_attempts < 1 or self.adapter_cache_size < 1 \
                or self.adapter_source_ttl < 0:
            raise ValueError("adapter_fetch_timeout and adapter_cache_size must be > 0, adapter_fetch_attempts >= 1, "
                             "adapter_source_ttl >= 0")
        if min(self.max_file_bytes, self.max_batch_lines, self.batch_concurrency) < 1:
            raise ValueError("max_file_bytes, max_batch_lines and batch_concurrency must be >= 1")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class ClusterConfig:
    """`loraplex serve --ray`: replicas, routing and the Ray instance."""

    replicas: int = setting(2, "engine replicas (the minimum when autoscaling)")
    max_replicas: int | None = setting(None, "autoscale up to this many replicas")
    target_ongoing_requests: int = setting(16, "per replica, what the autoscaler aims at")
    max_adapters_per_replica: int = setting(16, "adapters a replica keeps (LRU); Ray routes each adapter to "
                                                "replicas holding it")
    routing: str = setting("adapter", "adapter: placement by load and bounded-load routing to the replicas holding "
                                      "an adapter (api/cluster/placement.py); affinity: Ray's model multiplexing alone; "
                                      "round-robin: adapter-blind (the last two: baselines)", flag="--ray-routing",
                           dest="ray_routing", choices=list(ROUTINGS))
    load_epsilon: float = setting(LOAD_EPSILON, "adapter routing: a holder with more than ceil((1 + epsilon) x the mean) "
                                       "running requests sends the request to the least-loaded replica, which "
                                       "reads the adapter")
    replica_cpus: float = setting(1.0, "Ray CPUs (and torch threads) per replica")
    # the engine batches: Ray should not queue in front of it
    max_ongoing_requests: int = setting(256, "requests Ray hands one replica at once")
    address: str | None = setting(None, "join a running cluster (e.g. auto after `ray start`); default: a local "
                                        "Ray on 127.0.0.1", flag="--ray-address", dest="ray_address")
    num_cpus: int | None = setting(None, "CPUs of the local Ray (default: all)", flag="--ray-num-cpus",
                                   dest="ray_num_cpus")

    def __post_init__(self) -> None:
        if self.replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.replicas):
            raise ValueError(f"need 1 <= replicas <= max_replicas, got {self.replicas}, {self.max_replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if not self.load_epsilon > 0:
            raise ValueError(f"load_epsilon must be > 0, got {self.load_epsilon}")
        if self.max_adapters_per_replica < 1 or self.replica_cpus < 0:
            raise ValueError("max_adapters_per_replica must be >= 1 and replica_cpus >= 0")
