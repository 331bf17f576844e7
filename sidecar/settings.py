"""Settings of the sidecar deployable (environment prefix ``SPECGATE_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sidecar.replicas import MAX_REPLICA_NAME, replica_name


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", extra="ignore")

    control_plane: str = Field(default="http://127.0.0.1:8080", description="control plane base URL")
    key: str = Field(default="", description="worker API key (sgk_...)")
    # The key in a file (mode 0600) rather than in the environment or on a command line; ``key`` wins.
    key_file: Path | None = Field(default=None, description="file holding the worker API key")
    worker_id: str = Field(default="", description="defaults to HOST:PORT of --listen")
    pool: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    # What this sidecar is: a worker beside its engines (they share its accelerator), or a gateway in front of
    # pools of replicas on other hosts (each replica with accelerators of its own); see ``batch_scope``.
    kind: Literal["worker", "gateway"] = "worker"
    # engine name -> the base URLs of its replicas, OpenAI-compatible servers; in the environment a URL, a list
    # of URLs or "URL1,URL2" per name
    engines: dict[str, list[str]] = Field(default_factory=dict)
    # A worker-local YAML of the engines this sidecar starts and restarts itself (sidecar/supervisor.py); their
    # URLs then come from it, one replica each.
    supervise: Path | None = None
    # Which requests a rule's batch size counts (sidecar/replicas.py): "worker", every request on this worker's
    # engines (they share one accelerator: the rule before replica pools); "replica", those on the least-loaded
    # healthy replica of the engine the rule names. "auto": "replica" for a gateway, else "worker".
    batch_scope: Literal["auto", "worker", "replica"] = "auto"
    # A replica that fails this many requests (or metric scrapes) in a row, by refusing connections, timing
    # out or answering 5xx, is ejected, then probed on /health after probe_initial_s, doubling up to probe_max_s.
    eject_after: int = Field(default=3, ge=1, le=1000)
    probe_initial_s: float = Field(default=1.0, gt=0, le=3600)
    probe_max_s: float = Field(default=30.0, gt=0, le=3600)
    # A replica whose estimated queue (requests waiting in the engine) exceeds this is full: a decision for a
    # speculative engine whose replicas are all full goes to the plain pool (fallback_reason pool_saturated).
    # None: no bound, the engine queues.
    max_queue: int | None = Field(default=None, ge=0, le=1_000_000)
    # X-Specgate-Affinity keeps a conversation on one replica unless that replica's batch exceeds the
    # least-loaded one's by more than this.
    affinity_slack: int = Field(default=4, ge=0, le=1_000_000)
    listen: str = "127.0.0.1:9000"
    # route table: request path or model name -> route, used when neither the
    # X-Specgate-Route header nor metadata.route names one
    routes: dict[str, str] = Field(default_factory=dict)
    public_keys: list[str] = Field(default_factory=list, description="trusted bundle keys (base64)")
    state_dir: Path = Field(default=Path(".specgate/sidecar"), description="last-known-good bundle, spool")
    long_poll_s: float = Field(default=30.0, gt=0, le=300)
    heartbeat_s: float = Field(default=5.0, gt=0)
    telemetry_batch_size: int = Field(default=200, ge=1, le=10_000)
    telemetry_flush_s: float = Field(default=1.0, gt=0)
    # Pre-aggregation (telemetry.raw_sample_rate below 1): how often the running rollup deltas are finished and
    # sent, with the raw sample held since. Longer: fewer, fuller deltas and batches; the rollups lag by as much.
    telemetry_rollup_flush_s: float = Field(default=60.0, gt=0, le=3600)
    spool_max_events: int = Field(default=1_000_000, ge=1000)
    upstream_connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_read_timeout_s: float = Field(default=600.0, gt=0)
    engine_metrics_s: float = Field(default=0.5, gt=0, description="how often to scrape vllm:num_requests_running")
    # What one client connection may hold of the sidecar's HTTP server (sidecar/server.py): bounded so that a
    # huge or slowly sent request costs it little, whatever the client does.
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, description="request line + headers, else 431")
    max_header_count: int = Field(default=128, ge=8, description="header lines per request, else 431")
    header_timeout_s: float = Field(default=10.0, gt=0, description="first byte to end of headers, else 408")
    body_timeout_s: float = Field(default=60.0, gt=0, description="end of headers to end of body, else 408")
    max_buffered_bytes: int = Field(default=1024 * 1024, ge=64 * 1024,
                                    description="read ahead of the request being answered before reading pauses")
    # What one request may make the request path hold or compute on the event loop (sidecar/proxy.py): the
    # labels are parsed and encoded per request, an output schema is compiled and kept for later requests.
    max_labels: int = Field(default=64, ge=1, description="X-Specgate-Labels pairs per request, else 400")
    max_labels_bytes: int = Field(default=4096, ge=64, description="X-Specgate-Labels bytes, else 400")
    max_schema_bytes: int = Field(default=64 * 1024, ge=1024,
                                  description="an output JSON schema, serialised compact, else 400")
    schema_cache_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024,
                                    description="compiled output schemas kept, by bytes of their schemas (LRU)")
    # Keep vLLM's per-request ``metrics`` object in answers (it is stripped by default, as if the engines ran
    # without the per-request metrics flags): for debugging and for tests that compare telemetry with the engine.
    expose_engine_metrics: bool = False
    # Shadow comparisons (policy ``quality``, sidecar/shadow.py): at most this many shadow requests on the plain
    # engine at once; a sampled request beyond it is not compared (the shadow is dropped, never queued: under
    # load the plain engine has real work to do).
    shadow_max_in_flight: int = Field(default=4, ge=1, le=1000)
    shadow_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # A worker's own check of the two answers, MODULE:FUNCTION on the worker's Python path (sidecar/shadow.py).
    quality_check: str | None = None
    quality_check_timeout_s: float = Field(default=5.0, gt=0, le=600)

    @field_validator("engines", mode="before")
    @classmethod
    def _engine_lists(cls, value: Any) -> Any:
        """A URL, "URL1,URL2" or a list of either per engine: one list of URLs."""
        if not isinstance(value, dict):
            return value
        out: dict[Any, Any] = {}
        for name, urls in value.items():
            items = [urls] if isinstance(urls, str) else urls
            if isinstance(items, list) and all(isinstance(item, str) for item in items):
                items = [url.strip() for item in items for url in item.split(",")]
            out[name] = items
        return out

    @field_validator("engines")
    @classmethod
    def _engine_urls(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, urls in value.items():
            if not name.strip():
                raise ValueError("an engine name must not be empty")
            if not urls:
                raise ValueError(f"engine {name!r}: no replica URL")
            seen: set[str] = set()
            for url in urls:
                parts = urlsplit(url)
                try:
                    parts.port  # noqa: B018 - raises on a port that is not a number in range
                except ValueError:
                    parts = parts._replace(scheme="")
                if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
                    raise ValueError(f"engine {name!r}: the URL must be http(s)://HOST[:PORT][/PREFIX], got {url!r}")
                # Replicas are told apart by their names (telemetry, heartbeats): http://H and http://h:80 are one.
                replica = replica_name(url)
                if replica in seen:
                    raise ValueError(f"engine {name!r}: replica {url!r} is listed twice (as {replica})")
                if len(replica) > MAX_REPLICA_NAME:
                    raise ValueError(f"engine {name!r}: replica {url!r} makes a name of {len(replica)} characters "
                                     f"(HOST:PORT/PREFIX), over the {MAX_REPLICA_NAME} telemetry holds")
                seen.add(replica)
        return value

    @model_validator(mode="after")
    def _supervised_engines(self) -> SidecarSettings:
        """With ``supervise`` (``--supervise``, ``SPECGATE_SUPERVISE``) the engines and their URLs come from that
        file, one replica each."""
        if self.supervise is None:
            return self
        if self.engines:
            raise ValueError("--supervise names the engines; leave out --engine (and SPECGATE_ENGINES)")
        from sidecar.supervisor import SuperviseError, load_supervise_file

        try:
            config = load_supervise_file(self.supervise)
        except SuperviseError as exc:
            raise ValueError(str(exc)) from None
        self.engines = {name: [config.url(name)] for name in config.engines}
        return self

    @model_validator(mode="after")
    def _probe_bounds(self) -> SidecarSettings:
        if self.probe_max_s < self.probe_initial_s:
            raise ValueError(f"probe_max_s ({self.probe_max_s}) must be at least probe_initial_s "
                             f"({self.probe_initial_s})")
        return self

    @property
    def replica_scope(self) -> bool:
        """Whether a rule's batch is the replica's (``batch_scope`` resolved)."""
        if self.batch_scope == "auto":
            return self.kind == "gateway"
        return self.batch_scope == "replica"

    @model_validator(mode="after")
    def _schema_fits_cache(self) -> SidecarSettings:
        # A schema larger than the whole cache would be compiled again for every request that carries it.
        if self.schema_cache_bytes < self.max_schema_bytes:
            raise ValueError(f"schema_cache_bytes ({self.schema_cache_bytes}) must be at least max_schema_bytes "
                             f"({self.max_schema_bytes})")
        return self

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("listen must be HOST:PORT, e.g. 127.0.0.1:9000")
        return value
