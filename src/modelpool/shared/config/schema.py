"""The configuration's schemas and their validation: :class:`PoolConfig` (one pool),
:class:`ServerConfig` (the daemon's ``[server]`` table), :class:`ModelSpec` (one
``[models.NAME]`` table) and :class:`RetryPolicy`.

Every check names the offending key, so a typo in a TOML file reads as
``ValueError: unknown key 'wrokers' (known: ...)`` rather than a silent default::

    cfg = PoolConfig.from_toml("my.toml")
    cfg = PoolConfig(model="./tiny", backend="hf", workers=2, deadline_s=30)
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelpool.shared.config.devices import DeviceEntry, check_device_groups, check_devices
from modelpool.shared.images import ImageLimits
from modelpool.shared.reasoning.controls import DEFAULT_ANSWER_RESERVE, check_pool_settings
from modelpool.shared.tool_formats.detect import check_tool_parser
from modelpool.shared.validation import check_generation_params, is_number

RETRY_REASONS = ("timeout", "crash", "error", "cuda_error")
_BACKEND_PATTERN = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


_MAX_WORKER_POLL_S = 0.01


def _check_number(name: str, value: object, *, allow_zero: bool, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


DEFAULT_PREFIX_CACHE_DIR_BYTES = 8 * 2**30
"""The disk tier's bound when ``prefix_cache_dir`` is given without one."""


def _check_prefix_tiers(config: PoolConfig) -> None:
    _check_int("prefix_cache_host_bytes", config.prefix_cache_host_bytes, minimum=0)
    _check_int("prefix_cache_dir_bytes", config.prefix_cache_dir_bytes, minimum=0)
    for name in ("prefix_cache_host_dir", "prefix_cache_dir"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a directory path, got {value!r}")


def _reject_unknown(table: str, given: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        where = f" in [{table}]" if table else ""
        raise ValueError(f"unknown key {unknown[0]!r}{where} (known: {', '.join(sorted(known))})")


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed attempt is tried again on another worker.

    ``on`` lists the attempt outcomes that are retried: "timeout" (deadline or
    stall of one attempt), "crash" (the worker died), "error" (the backend raised;
    off by default because a deterministic exception would just repeat).

    A "timeout" retry needs time left after the attempt: set ``attempt_timeout_s``
    below ``deadline_s`` (or a ``stall_timeout_s``), else the first attempt's
    deadline is the request's and there is nothing left to retry in.

    A CUDA out-of-memory is retried on another worker ``oom_retries`` times (at
    most, and within ``max_retries``): a prompt too long for the device's memory
    fails everywhere. A sticky CUDA error ("cuda_error": the worker's CUDA context
    is unusable and the worker is replaced) is retried only when ``on`` names it,
    because an input that triggers a device-side assert triggers it everywhere.
    """

    max_retries: int = 2
    on: tuple[str, ...] = ("timeout", "crash")
    backoff_s: float = 0.0
    oom_retries: int = 1

    def __post_init__(self) -> None:
        _check_int("retry.max_retries", self.max_retries, minimum=0)
        _check_int("retry.oom_retries", self.oom_retries, minimum=0)
        _check_number("retry.backoff_s", self.backoff_s, allow_zero=True)
        if not isinstance(self.on, (list, tuple)) or not all(isinstance(r, str) for r in self.on):
            raise ValueError(f"retry.on must be a list of strings, got {self.on!r}")
        object.__setattr__(self, "on", tuple(self.on))
        for reason in self.on:
            if reason not in RETRY_REASONS:
                raise ValueError(f"retry.on: unknown reason {reason!r} (known: {RETRY_REASONS})")


def check_image_limits(value: object) -> ImageLimits:
    """An ``[image_limits]`` table (or an :class:`ImageLimits`), each bound checked."""
    if isinstance(value, Mapping):
        value = ImageLimits(**known_fields(value, ImageLimits, "image_limits"))
    if not isinstance(value, ImageLimits):
        raise ValueError(f"image_limits must be a table, got {value!r}")
    for name in ("max_bytes", "max_pixels", "max_frames"):
        _check_int(f"image_limits.{name}", getattr(value, name), minimum=1)
    # 0 images: this model takes none (each is a 400 too_many_images).
    _check_int("image_limits.max_images", value.max_images, minimum=0)
    return value


@dataclass(frozen=True)
class PoolConfig:
    """How a :class:`~modelpool.ModelPool` is built; docs/configuration.md says what each
    field does."""

    model: str
    # "auto": llama_cpp for a GGUF model on the CPU when llama-cpp-python is installed, else
    # hf (modelpool.supervisor.backend_choice); ModelPool.start() resolves it and stats() says why.
    backend: str = "auto"
    backend_options: dict[str, Any] = field(default_factory=dict)
    workers: int = 2
    max_batch_size: int = 1
    # A pooling model (an embedding model, a cross-encoder) batches the requests of
    # concurrent clients: with max_batch_size left at 1, its workers hold this many
    # (ModelPool.start() sets max_batch_size to it; 1 serves them one at a time).
    pooling_batch_size: int = 32
    # A one-call worker (max_batch_size 1) is sent its next request while it runs one, so
    # it never waits a round trip for work; recalled when another worker is idle or a
    # more urgent request is queued (modelpool.scheduling.prefetch).
    prefetch: bool = True
    # A one-call worker that has answered polls its channel this long before it sleeps,
    # so that the next request, when it comes at once, costs it no wake-up (0: off).
    worker_poll_s: float = 0.0003
    spares: int = 0
    devices: tuple[DeviceEntry, ...] = ("auto",)
    gpus_per_worker: int = 1
    deadline_s: float = 60.0
    attempt_timeout_s: float | None = None
    cancel_grace_s: float = 2.0
    term_grace_s: float = 2.0
    startup_timeout_s: float = 300.0
    stall_timeout_s: float | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_queue: int = 1024
    # Priority (lower runs first): a request that has waited this long goes ahead of every
    # younger one, of any priority (the starvation bound). Admission by predicted wait:
    # a request whose predicted time to first token passes this (or its deadline) is
    # refused at once with QueueFull (None: every request is queued).
    priority_aging_s: float = 10.0
    max_queue_time_s: float | None = None
    # A queued request finding every slot taken preempts the least urgent running one of
    # a less urgent priority: that one is cancelled and queued again, first of its
    # priority (only one whose rerun gives the same text, if its caller saw some).
    preempt_for_priority: bool = True
    max_requests_per_worker: int | None = None
    max_worker_rss_mb: float | None = None
    max_worker_gpu_mb: float | None = None
    gpu_release_timeout_s: float = 15.0
    gpu_sample_interval_s: float = 2.0
    startup_failures_before_giving_up: int = 3
    # Liveness: ModelPool.health() (and so /healthz) fails when the dispatcher thread has not
    # gone round its loop for this long. 10 s plus a Kubernetes liveness probe's default
    # period (10 s) keeps a wedge's first failed probe within 20 s, its restart within 40 s.
    heartbeat_timeout_s: float = 10.0
    # A structured-output request's grammar compiles within this, inside its deadline;
    # past it the request fails with GrammarCompileTimeout and the worker stays warm.
    grammar_compile_timeout_s: float = 5.0
    tool_parser: str = "auto"  # the call syntax, docs/tool-formats.md
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # Reasoning models (docs/reasoning.md): the parser ("auto": detected), the thinking
    # tokens of low/medium/high effort (1024/2048/8192), the answer's reserve of max_tokens.
    reasoning_parser: str = "auto"
    reasoning_budgets: dict[str, int] = field(default_factory=dict)
    reasoning_answer_reserve: int = DEFAULT_ANSWER_RESERVE
    # What one request's images may be (docs/images.md): an [image_limits] table.
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    # Prefix cache tiers (docs/prefix-tiers.md): cached prefixes outside the workers, so a
    # kill, a swap or a restart costs a restore. The host tier's bound (0: off) and
    # directory (None: one the pool makes in /dev/shm and removes at close, or under a
    # registry the model's own, kept while it is out); the disk tier's directory (None:
    # off) and bound.
    prefix_cache_host_bytes: int = 0
    prefix_cache_host_dir: str | None = None
    prefix_cache_dir: str | None = None
    prefix_cache_dir_bytes: int = DEFAULT_PREFIX_CACHE_DIR_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.backend, str) or not _BACKEND_PATTERN.match(self.backend):
            raise ValueError(
                f"backend must be 'auto', 'hf', 'llama_cpp', 'testing' or 'pkg.module:factory', "
                f"got {self.backend!r}"
            )
        if not isinstance(self.backend_options, Mapping):
            raise ValueError(f"backend_options must be a table, got {self.backend_options!r}")
        object.__setattr__(self, "backend_options", dict(self.backend_options))
        _check_int("workers", self.workers, minimum=1)
        _check_int("max_batch_size", self.max_batch_size, minimum=1)
        _check_int("pooling_batch_size", self.pooling_batch_size, minimum=1)
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be true or false, got {self.prefetch!r}")
        _check_number("worker_poll_s", self.worker_poll_s, allow_zero=True)
        if self.worker_poll_s > _MAX_WORKER_POLL_S:
            raise ValueError(
                f"worker_poll_s must be at most {_MAX_WORKER_POLL_S} (a worker polls without "
                f"sleeping that long after an answer), got {self.worker_poll_s!r}"
            )
        _check_int("spares", self.spares, minimum=0)
        _check_int("gpus_per_worker", self.gpus_per_worker, minimum=1)
        object.__setattr__(self, "devices", check_devices(self.devices))
        check_device_groups(self.devices, self.gpus_per_worker, self.workers + self.spares)
        _check_number("deadline_s", self.deadline_s, allow_zero=False)
        _check_number("attempt_timeout_s", self.attempt_timeout_s, allow_zero=False, optional=True)
        _check_number("cancel_grace_s", self.cancel_grace_s, allow_zero=True)
        _check_number("term_grace_s", self.term_grace_s, allow_zero=True)
        _check_number("startup_timeout_s", self.startup_timeout_s, allow_zero=False)
        _check_number("stall_timeout_s", self.stall_timeout_s, allow_zero=False, optional=True)
        if isinstance(self.retry, Mapping):
            object.__setattr__(
                self, "retry", RetryPolicy(**known_fields(self.retry, RetryPolicy, "retry"))
            )
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        _check_int("max_queue", self.max_queue, minimum=1)
        _check_number("priority_aging_s", self.priority_aging_s, allow_zero=False)
        _check_prefix_tiers(self)
        _check_number("max_queue_time_s", self.max_queue_time_s, allow_zero=False, optional=True)
        if not isinstance(self.preempt_for_priority, bool):
            raise ValueError(
                f"preempt_for_priority must be true or false, got {self.preempt_for_priority!r}"
            )
        _check_int(
            "max_requests_per_worker", self.max_requests_per_worker, minimum=1, optional=True
        )
        _check_number("max_worker_rss_mb", self.max_worker_rss_mb, allow_zero=False, optional=True)
        _check_number("max_worker_gpu_mb", self.max_worker_gpu_mb, allow_zero=False, optional=True)
        _check_number("gpu_release_timeout_s", self.gpu_release_timeout_s, allow_zero=True)
        _check_number("gpu_sample_interval_s", self.gpu_sample_interval_s, allow_zero=False)
        _check_int(
            "startup_failures_before_giving_up", self.startup_failures_before_giving_up, minimum=1
        )
        _check_number("heartbeat_timeout_s", self.heartbeat_timeout_s, allow_zero=False)
        _check_number("grammar_compile_timeout_s", self.grammar_compile_timeout_s, allow_zero=False)
        check_tool_parser(self.tool_parser)
        if not isinstance(self.generation_defaults, Mapping):
            raise ValueError(
                f"generation_defaults must be a table, got {self.generation_defaults!r}"
            )
        object.__setattr__(self, "generation_defaults", dict(self.generation_defaults))
        check_generation_params(self.generation_defaults, where="generation_defaults")
        check_pool_settings(self)
        object.__setattr__(self, "image_limits", check_image_limits(self.image_limits))

    @classmethod
    def from_toml(cls, path: str | Path) -> PoolConfig:
        """Read a pool configuration; the ``[server]`` table is left to :class:`ServerConfig`."""
        data = read_toml(path)
        data.pop("server", None)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolConfig:
        if "model" not in data:
            raise ValueError("missing key 'model'")
        return cls(**known_fields(data, cls, ""))

    def replace(self, **changes: Any) -> PoolConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ServerConfig:
    """The daemon's own settings, from the TOML ``[server]`` table."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The bearer key is read from this variable; unset or empty there = no key required.
    api_key_env: str | None = "MODELPOOL_API_KEY"
    # Several keys, one per tenant, each with its own share and budget (server.tenants);
    # with it, fair share is by tenant, not by address.
    keys_file: str | None = None
    # 32 MiB: an agent's request carries its screenshots (base64) with the conversation.
    max_body_bytes: int = 33_554_432
    drain_timeout_s: float = 30.0
    max_request_timeout_s: float | None = None
    model_name: str | None = None
    # /healthz fails when the server's own event loop runs a timer this late (seconds).
    max_event_loop_lag_s: float = 5.0
    # Browser safety (docs/security.md): the Host names served (None: loopback names when
    # bound to a loopback address, any name otherwise; "*" is any), and the web origins
    # that may call the daemon (CORS; empty: a request with an Origin header is refused).
    allowed_hosts: tuple[str, ...] | None = None
    cors_allowed_origins: tuple[str, ...] = ()
    # The most a request may ask of the pool: n x (prompt + max_tokens) x (1 + logprobs),
    # the prompt counted in characters (token ids: in ids). It bounds the answer's size.
    max_request_tokens: int = 262_144
    # Fair share between clients (by address): runs a client may have admitted to the
    # pool (None: the pool's capacity) and waiting behind them; past that, 429.
    client_max_running: int | None = None
    client_max_queued: int = 256
    # A connection whose client reads nothing of its answer for this long is aborted
    # (a stream's run is cancelled, as on a disconnect).
    send_timeout_s: float = 30.0
    # HTTP limits (nginx-like): a request head, the gap between two body reads, the
    # request line and headers together, the header count, and open connections.
    header_timeout_s: float = 20.0
    body_timeout_s: float = 20.0
    max_header_bytes: int = 32_768
    max_headers: int = 100
    max_connections: int = 1000
    # Bytes of request bodies still being received, all connections together: past it,
    # the connection whose body grew gets 503 (a body that arrives whole never counts).
    max_pending_body_bytes: int = 134_217_728
    # /metrics also under vLLM's names (vllm:..., labelled model_name), for its dashboards.
    vllm_metrics: bool = True
    # OpenTelemetry traces of each request, exported here (an OTLP/HTTP traces URL such as
    # http://collector:4318/v1/traces; the tracing extra). None: no tracing.
    otlp_traces_endpoint: str | None = None
    # The share of the requests that went well that are traced (a retried, killed or
    # failed one always is; a caller's traceparent decides for its own).
    otlp_traces_sample_ratio: float = 1.0
    # Responses kept for previous_response_id and GET /v1/responses/{id}: at most this
    # many, this many bytes of JSON all together, each for this many seconds.
    responses_store_entries: int = 1024
    responses_store_bytes: int = 67_108_864
    responses_store_ttl_s: float = 3600.0
    # Of those, the most one client address may hold (None: a quarter of the bound, at
    # least max_body_bytes), so that one client cannot fill the bound for the others.
    client_max_pending_body_bytes: int | None = None
    # Addresses (or networks, as uvicorn reads them) whose X-Forwarded-For and
    # X-Forwarded-Proto are believed: a client is the address they name. Empty: none, so
    # no client can name itself another address and so take another's fair share.
    forwarded_allow_ips: tuple[str, ...] = ()
    # Directories POST /v1/load_lora_adapter may read adapters from (shared.lora; empty:
    # loading adapters at run time is off); the bound of one adapter's check (a child).
    lora_dirs: tuple[str, ...] = ()
    lora_check_timeout_s: float = 30.0
    # Many models ([models.NAME] tables; modelpool.supervisor.registry): the budgets of host
    # RAM (RSS)
    # and of each GPU (NVML) for the models' workers (None: none); requests waiting for a
    # load (429 past it; a client a quarter of them); a failing model's load backoff; swap
    # rules (min_residency_s, swap_share: registry.swaps); state_dir: the measured needs
    # kept across restarts (None: $MODELPOOL_HOME/state; "": not kept).
    memory_budget_bytes: int | None = None
    gpu_memory_budget_bytes: int | None = None
    max_load_waiters: int = 256
    load_backoff_s: float = 1.0
    load_backoff_max_s: float = 60.0
    min_residency_s: float = 3.0
    swap_share: float = 0.2
    state_dir: str | None = None
    # Images (docs/images.md): one sent to a model that reads none is replaced by a short
    # note ("note", the answer's x-modelpool-images-omitted header counts them) or refused
    # ("refuse": 400 model_not_multimodal); the hosts whose http(s) image URLs the daemon
    # fetches (empty: none, a 400 remote_image_url), each within this many seconds.
    unsupported_images: str = "note"
    image_url_hosts: tuple[str, ...] = ()
    image_fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"server.host must be a non-empty string, got {self.host!r}")
        _check_int("server.port", self.port, minimum=0)
        if self.port > 65535:
            raise ValueError(f"server.port must be <= 65535, got {self.port!r}")
        if self.api_key_env is not None and not isinstance(self.api_key_env, str):
            raise ValueError(f"server.api_key_env must be a string, got {self.api_key_env!r}")
        keys_file = self.keys_file
        if keys_file is not None and (not isinstance(keys_file, str) or not keys_file):
            raise ValueError(f"server.keys_file must be a path, got {self.keys_file!r}")
        _check_int("server.max_body_bytes", self.max_body_bytes, minimum=1)
        _check_number("server.drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        _check_number(
            "server.max_request_timeout_s",
            self.max_request_timeout_s,
            allow_zero=False,
            optional=True,
        )
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise ValueError(f"server.model_name must be a string, got {self.model_name!r}")
        _check_number("server.max_event_loop_lag_s", self.max_event_loop_lag_s, allow_zero=False)
        object.__setattr__(
            self, "allowed_hosts", _optional_names("server.allowed_hosts", self.allowed_hosts)
        )
        object.__setattr__(
            self,
            "cors_allowed_origins",
            _optional_names("server.cors_allowed_origins", self.cors_allowed_origins) or (),
        )
        _check_int("server.max_request_tokens", self.max_request_tokens, minimum=1)
        _check_int("server.client_max_running", self.client_max_running, minimum=1, optional=True)
        _check_int("server.client_max_queued", self.client_max_queued, minimum=0)
        for name in ("send_timeout_s", "header_timeout_s", "body_timeout_s"):
            _check_number(f"server.{name}", getattr(self, name), allow_zero=False)
        _check_int("server.max_header_bytes", self.max_header_bytes, minimum=1024)
        _check_int("server.max_headers", self.max_headers, minimum=8)
        _check_int("server.max_connections", self.max_connections, minimum=1)
        _check_int("server.max_pending_body_bytes", self.max_pending_body_bytes, minimum=1)
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not (
            isinstance(endpoint, str) and endpoint.startswith(("http://", "https://"))
        ):
            raise ValueError(
                f"server.otlp_traces_endpoint must be an http(s) URL, got {endpoint!r}"
            )
        ratio = self.otlp_traces_sample_ratio
        if not is_number(ratio) or not 0 <= ratio <= 1:
            raise ValueError(
                f"server.otlp_traces_sample_ratio must be a number in [0, 1], got {ratio!r}"
            )
        if not isinstance(self.vllm_metrics, bool):
            raise ValueError(
                f"server.vllm_metrics must be true or false, got {self.vllm_metrics!r}"
            )
        _check_int("server.responses_store_entries", self.responses_store_entries, minimum=0)
        _check_int("server.responses_store_bytes", self.responses_store_bytes, minimum=0)
        _check_number("server.responses_store_ttl_s", self.responses_store_ttl_s, allow_zero=False)
        _check_int(
            "server.client_max_pending_body_bytes",
            self.client_max_pending_body_bytes,
            minimum=1,
            optional=True,
        )
        if self.client_pending_body_bytes() < self.max_body_bytes:
            raise ValueError(
                f"server.client_max_pending_body_bytes ({self.client_max_pending_body_bytes}) "
                f"must be at least server.max_body_bytes ({self.max_body_bytes}): one body "
                "alone would be refused"
            )
        object.__setattr__(
            self,
            "forwarded_allow_ips",
            _optional_names("server.forwarded_allow_ips", self.forwarded_allow_ips) or (),
        )
        object.__setattr__(
            self, "lora_dirs", _optional_names("server.lora_dirs", self.lora_dirs) or ()
        )
        _check_number("server.lora_check_timeout_s", self.lora_check_timeout_s, allow_zero=False)
        _check_int("server.memory_budget_bytes", self.memory_budget_bytes, minimum=1, optional=True)
        _check_int(
            "server.gpu_memory_budget_bytes", self.gpu_memory_budget_bytes, minimum=1, optional=True
        )
        _check_int("server.max_load_waiters", self.max_load_waiters, minimum=0)
        _check_number("server.load_backoff_s", self.load_backoff_s, allow_zero=True)
        _check_number("server.load_backoff_max_s", self.load_backoff_max_s, allow_zero=True)
        _check_number("server.min_residency_s", self.min_residency_s, allow_zero=True)
        _check_number("server.swap_share", self.swap_share, allow_zero=False)
        if self.swap_share > 1 or not isinstance(self.state_dir, str | None):
            raise ValueError("server.swap_share must be at most 1; server.state_dir a path")
        if self.unsupported_images not in ("note", "refuse"):
            raise ValueError(
                "server.unsupported_images must be 'note' or 'refuse', "
                f"got {self.unsupported_images!r}"
            )
        object.__setattr__(
            self,
            "image_url_hosts",
            _optional_names("server.image_url_hosts", self.image_url_hosts) or (),
        )
        _check_number("server.image_fetch_timeout_s", self.image_fetch_timeout_s, allow_zero=False)
        if self.max_pending_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"server.max_pending_body_bytes ({self.max_pending_body_bytes}) must be at "
                f"least server.max_body_bytes ({self.max_body_bytes}): one body alone would "
                "be refused"
            )

    def client_pending_body_bytes(self) -> int:
        """The bytes of bodies still being received that one client address may hold."""
        if self.client_max_pending_body_bytes is not None:
            return self.client_max_pending_body_bytes
        return max(self.max_body_bytes, self.max_pending_body_bytes // 4)

    @classmethod
    def from_toml(cls, path: str | Path) -> ServerConfig:
        table = read_toml(path).get("server", {})
        if not isinstance(table, Mapping):
            raise ValueError("[server] must be a table")
        return cls(**known_fields(table, cls, "server"))


# The keys of a [models.NAME] table that are the registry's, not the pool's.
MODEL_KEYS = ("ttl_s", "pin", "preload", "aliases", "load_timeout_s")


@dataclass(frozen=True)
class ModelSpec:
    """One model of a :class:`~modelpool.supervisor.registry.ModelRegistry`: its name, its pool's
    configuration, and the registry's rules for it (a ``[models.NAME]`` table)::

        ModelSpec("chat", PoolConfig(model="./chat"), ttl_s=300, aliases=("gpt-4o",))

    ``ttl_s``: idle seconds before it is unloaded (0: never, only evicted for room);
    ``pin``: never evicted nor unloaded when idle; ``preload``: loaded when the registry
    starts; ``aliases``: other names that reach it; ``load_timeout_s``: the deadline of
    one load, preflight to every worker ready (None: the pool's ``startup_timeout_s``
    plus 30 s, so that the pool's own start-up ladder gives up first).
    """

    name: str
    pool: PoolConfig
    ttl_s: float = 0.0
    pin: bool = False
    preload: bool = False
    aliases: tuple[str, ...] = ()
    load_timeout_s: float | None = None

    def __post_init__(self) -> None:
        where = f"models.{self.name}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a model's name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.pool, PoolConfig):
            raise ValueError(f"{where}: pool must be a PoolConfig, got {self.pool!r}")
        _check_number(f"{where}.ttl_s", self.ttl_s, allow_zero=True)
        for flag in ("pin", "preload"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{where}.{flag} must be true or false")
        aliases = _optional_names(f"{where}.aliases", self.aliases) or ()
        if self.name in aliases:
            raise ValueError(f"{where}.aliases: {self.name!r} is the model's own name")
        object.__setattr__(self, "aliases", aliases)
        _check_number(
            f"{where}.load_timeout_s", self.load_timeout_s, allow_zero=False, optional=True
        )

    @property
    def load_deadline_s(self) -> float:
        """The deadline of one load (``load_timeout_s``, or the pool's start-up bound + 30 s)."""
        if self.load_timeout_s is not None:
            return self.load_timeout_s
        return self.pool.startup_timeout_s + 30.0


def check_model_names(models: tuple[ModelSpec, ...]) -> None:
    """Every name and alias reaches one model only."""
    owner: dict[str, str] = {}
    for spec in models:
        for name in (spec.name, *spec.aliases):
            if name in owner:
                raise ValueError(
                    f"models: the name {name!r} is used by both {owner[name]!r} and {spec.name!r}"
                )
            owner[name] = spec.name


def _optional_names(name: str, value: object) -> tuple[str, ...] | None:
    """A list of non-empty strings as a tuple (TOML gives a list), or None."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name}: {item!r} is not a non-empty string")
    return tuple(value)


def known_fields(data: Mapping[str, Any], cls: type, table: str) -> dict[str, Any]:
    """``data`` as keyword arguments of ``cls``; ValueError naming a key it has no field for."""
    names = {f.name for f in dataclasses.fields(cls)}
    _reject_unknown(table, data, names)
    return dict(data)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; ValueError naming the file when it is not TOML."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from exc
