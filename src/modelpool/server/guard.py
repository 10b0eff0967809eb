"""What the daemon checks before a request reaches a route: the HTTP limits of a server
that faces untrusted clients, and the browser-safety checks of one on loopback.

:class:`Gate` (the daemon's ASGI middleware: key, body size, access log) asks
:class:`BrowserGuard` about each request's ``Host`` and ``Origin``; ``cli.py`` runs
uvicorn with :func:`guarded_protocol`, which bounds what one connection may hold
before the app sees it::

    guard = BrowserGuard(ServerConfig())          # loopback names, no CORS
    guard.refusal(headers)                        # None, or an ApiError (403)
    uvicorn.Config(app, http=guarded_protocol(ServerConfig()), ...)

Why in the protocol and not in the app: uvicorn hands the app a request only once its
headers are complete, so a header that never ends, a connection that never sends one,
or a body that stops half-way would otherwise hold memory and a file descriptor for as
long as the client likes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar

import httptools
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from modelpool.server.errors import error_body, error_response
from modelpool.server.http import ApiError, invalid
from modelpool.server.metrics import PoolMetrics
from modelpool.server.tenants import Keys
from modelpool.shared.config import ServerConfig

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("modelpool.access")

GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/api/chat",
        "/api/generate",
    }
)

# Headers a browser may send on a cross-origin call, and answer headers it may read.
CORS_ALLOWED_HEADERS = (
    b"authorization, content-type, x-request-timeout, x-api-key, anthropic-version, anthropic-beta"
)
CORS_EXPOSED_HEADERS = b"x-request-id, x-should-retry, retry-after"
CORS_MAX_AGE_S = 600
# Characters left as they are in a logged path (uvicorn's own access log quotes the same
# way): everything else, control characters above all, is percent-encoded.
_LOG_PATH_SAFE = "/:@!$&'()*+,;=-._~"
# How long a connection past max_connections may take to send its head (seconds).
OVER_CAPACITY_HEAD_S = 1.0
# File descriptors the daemon needs besides its connections: workers' pipes, logs,
# the model files a worker inherits while it starts.
_SPARE_FILES = 256


# --------------------------------------------------------------------------------------------
# Host, Origin, CORS, content type


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def is_loopback_name(name: str) -> bool:
    """localhost, a name under .localhost (RFC 6761), or a loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class BrowserGuard:
    """Refuses what only a browser fooled by a web page would send.

    A page the user opens can POST to ``http://127.0.0.1:8000`` (a "simple" request needs
    no preflight), and through DNS rebinding read the answer under its own host name.
    So, when the daemon listens on loopback, a Host that is not a loopback name is
    refused (403 ``host_not_allowed``): a rebound name is not one. An ``Origin`` header,
    which browsers send on every cross-origin call and no other client sends, is refused
    (403 ``origin_not_allowed``) unless it is in ``cors_allowed_origins``; for those the
    daemon answers the preflight and adds the CORS headers.
    """

    def __init__(self, config: ServerConfig) -> None:
        if config.allowed_hosts is not None:
            names = {host_name(name) for name in config.allowed_hosts}
            self.any_host = "*" in names
            self.hosts = frozenset(names - {"*"})
            self.loopback_hosts = False
        else:
            # Bound elsewhere, the daemon is meant to be reached under names it cannot
            # know (a pod address, a load balancer's); the API key protects it there.
            self.any_host = not is_loopback_name(config.host.strip("[]").lower())
            self.hosts = frozenset()
            self.loopback_hosts = not self.any_host
        self.origins = frozenset(
            origin.rstrip("/").lower() for origin in config.cors_allowed_origins
        )

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        if self.any_host or name in self.hosts:
            return True
        return self.loopback_hosts and is_loopback_name(name)

    def refusal(self, headers: Mapping[bytes, bytes]) -> ApiError | None:
        host = headers.get(b"host")
        # HTTP/1.0 clients may send no Host; every browser sends one.
        if host is not None and not self.host_allowed(host.decode("latin-1")):
            return ApiError(
                403,
                f"Host {host.decode('latin-1')[:100]!r} is not served here "
                "([server] allowed_hosts)",
                type="permission_error",
                code="host_not_allowed",
            )
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_allowed(origin):
            return ApiError(
                403,
                f"cross-origin requests from {origin.decode('latin-1')[:100]!r} are not "
                "allowed ([server] cors_allowed_origins)",
                type="permission_error",
                code="origin_not_allowed",
            )
        return None

    def origin_allowed(self, origin: bytes) -> bool:
        return origin.decode("latin-1").rstrip("/").lower() in self.origins

    # What a preflight (OPTIONS) of an allowed origin is answered, besides cors_headers.
    PREFLIGHT_HEADERS = [
        (b"access-control-allow-methods", b"GET, POST"),
        (b"access-control-allow-headers", CORS_ALLOWED_HEADERS),
        (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
    ]

    @staticmethod
    def cors_headers(origin: bytes) -> list[tuple[bytes, bytes]]:
        """Added to every answer to an allowed origin."""
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-expose-headers", CORS_EXPOSED_HEADERS),
            (b"vary", b"Origin"),
        ]


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared JSON: a browser may send ``text/plain`` or a form
    cross-site without a preflight, never ``application/json``."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    raise ApiError(
        415,
        f"Content-Type must be application/json, got {content_type or 'none'!r}",
        code="unsupported_media_type",
    )


def log_path(path: str) -> str:
    """``path`` as the access log writes it: percent-encoded, so that a decoded ``%0a`` or
    an escape sequence in a URL cannot forge a log line or drive a terminal."""
    return urllib.parse.quote(path, safe=_LOG_PATH_SAFE)


# --------------------------------------------------------------------------------------------
# Middleware: Host, Origin, auth, body size, access log, request-duration histogram


class Gate:
    """Pure ASGI middleware (not ``BaseHTTPMiddleware``, which buffers streams and breaks
    disconnect detection). Checks Host and Origin (:class:`BrowserGuard`), answers
    an allowed origin's CORS preflight, checks the key and the declared body size before
    routing, and writes one access-log line per request when the response is done."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Keys,
        max_body_bytes: int,
        metrics: PoolMetrics,
        guard: BrowserGuard,
    ) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state: dict[str, Any] = scope.setdefault("state", {})
        sent_status: list[int] = []
        headers = dict(scope["headers"])  # ASGI header names are lower-case already
        origin = headers.get(b"origin")
        cors = origin is not None and self.guard.origin_allowed(origin)

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent_status.append(message["status"])
                if cors:
                    assert origin is not None
                    cors_headers = self.guard.cors_headers(origin)
                    message = {**message, "headers": [*message["headers"], *cors_headers]}
            await send(message)

        try:
            refusal = self.guard.refusal(headers)
            if refusal is None and cors and scope["method"] == "OPTIONS":
                # A preflight carries no key: answered before the key is checked.
                preflight = BrowserGuard.PREFLIGHT_HEADERS
                await send_and_note(
                    {"type": "http.response.start", "status": 204, "headers": preflight}
                )
                await send({"type": "http.response.body", "body": b""})
                return
            refusal = refusal or self._refusal(headers, scope["path"])
            if refusal is not None:
                await error_response(refusal, scope["path"])(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - started
            status = state.get("status") or (sent_status[0] if sent_status else 500)
            path = scope["path"]
            if path in GENERATION_PATHS:
                self.metrics.observe_request(seconds, state.get("model"), state.get("lora"))
            access_logger.info(
                "%s %s %s request_id=%s attempts=%s worker_pid=%s seconds=%.4f",
                scope["method"],
                log_path(path),
                status,
                state.get("request_id") or "-",
                state.get("attempts") or "-",
                state.get("worker_pid") or "-",
                seconds,
            )

    def _refusal(self, headers: Mapping[bytes, bytes], path: str) -> ApiError | None:
        refusal = self.keys.refusal(headers, path)
        if refusal is not None:
            return refusal
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return invalid("Content-Length is not a number", code="invalid_header")
            if declared > self.max_body_bytes:
                return ApiError(
                    413,
                    f"request body is larger than {self.max_body_bytes} bytes",
                    code="request_too_large",
                )
        return None


# --------------------------------------------------------------------------------------------
# Connections


def raw_response(error: ApiError, path: str) -> bytes:
    """A complete HTTP response for an error met before any app could answer, in the
    shape of the route's API (``errors.error_body``)."""
    body = json.dumps(error_body(error, path), separators=(",", ":")).encode()
    lines = [
        STATUS_LINE[error.status],
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n",
    ]
    lines += [
        f"{name}: {value}\r\n".encode("latin-1")
        for name, value in error.headers.items()
        if name.lower() != "connection"
    ]
    return b"".join([*lines, b"\r\n", body])


def url_path(url: bytes) -> str:
    """The decoded path of a request target ("" for one that does not parse, or a head
    refused before its target was read)."""
    try:
        path = httptools.parse_url(url).path
    except httptools.HttpParserInvalidURLError:
        return ""
    return "" if path is None else urllib.parse.unquote(path.decode("latin-1"))


def head_refusal(
    guard: BrowserGuard, keys: Keys, headers: Mapping[bytes, bytes], method: bytes, path: str
) -> ApiError | None:
    """What :class:`Gate` would refuse for the request head alone, in its order (Host and
    Origin, then the key; an allowed origin's preflight carries no key)."""
    refusal = guard.refusal(headers)
    if refusal is not None:
        return refusal
    origin = headers.get(b"origin")
    if method == b"OPTIONS" and origin is not None and guard.origin_allowed(origin):
        return None
    return keys.refusal(headers, path)


def uvicorn_options(config: ServerConfig, keys: Keys | None = None) -> dict[str, Any]:
    """What ``uvicorn.Config`` takes from ``config``: the guarded protocol (refusing a
    request without one of ``keys`` before its body is read), and proxy headers believed
    only from ``forwarded_allow_ips``. uvicorn's own default believes
    ``X-Forwarded-For`` from 127.0.0.1, so that any client on the machine could name
    itself a new address per request and take a new fair share each time."""
    trusted = list(config.forwarded_allow_ips)
    return {
        "http": guarded_protocol(config, keys),
        "proxy_headers": bool(trusted),
        # None would read FORWARDED_ALLOW_IPS from the environment, or 127.0.0.1.
        "forwarded_allow_ips": trusted or [],
    }


def guarded_protocol(config: ServerConfig, keys: Keys | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the limits of ``config``:

    - a request that :class:`Gate` would refuse for its head (Host, Origin, no key of
      ``keys``) is answered (403, 401) and closed as soon as the head is complete: its
      body is never read, so it is never pending and never costs anyone a thing;

    - ``header_timeout_s``: a connection has that long to send a complete request head,
      from its opening and from the first byte of each later request (408, closed);
    - ``body_timeout_s``: the longest gap between two reads of a body (408, closed);
      not counted while the app itself has not taken what was read;
    - ``max_header_bytes`` / ``max_headers``: the request line and headers together,
      and their count (431, closed), checked before more is parsed, since httptools
      builds a header value by concatenation (quadratic in its size);
    - ``max_connections``: a request on a connection past that many gets 503 with
      Retry-After and the connection is closed, so that file descriptors never run out;
    - ``max_pending_body_bytes``: the bytes of bodies still being received, all
      connections together, and ``client_max_pending_body_bytes`` those of one client
      address (:class:`PendingBodies`); the connection whose body takes either past its
      bound gets 503 with Retry-After and is closed, so that one client's slow bodies
      cannot fill the bound for the others;
    - ``send_timeout_s``: a connection whose client reads nothing of a pending answer
      for that long is aborted (a whole answer, not only a stream, would otherwise sit
      in the transport's buffer for as long as the client likes).
    """

    pending_bodies = PendingBodies(
        config.max_pending_body_bytes, config.client_pending_body_bytes()
    )
    guard = BrowserGuard(config)
    head_keys = keys or Keys.single(None)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        # Shared by every connection of the server this class is given to.
        pending_bodies: ClassVar[PendingBodies]

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.body_bytes = 0  # of the request body being received, counted as pending
            self.peer = self.client[0] if self.client else "-"
            self.head_bytes = 0
            self.header_count = 0
            # uvicorn sets it when a request begins; a connection refused before one (idle,
            # or over capacity) has no target yet.
            self.url = b""
            self.reading_head = True
            self.over_capacity = len(self.connections) > config.max_connections
            self.guard_timer: asyncio.TimerHandle | None = None
            self.write_timer: asyncio.TimerHandle | None = None
            # Past the cap, a connection holds its file descriptor only briefly.
            seconds = OVER_CAPACITY_HEAD_S if self.over_capacity else config.header_timeout_s
            self._arm(min(seconds, config.header_timeout_s), "sent no complete request head")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._disarm_write()
            self._body_received()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.write_timer is None:
                self.write_timer = self.loop.call_later(config.send_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            self._disarm_write()
            super().resume_writing()

        def _disarm_write(self) -> None:
            if self.write_timer is not None:
                self.write_timer.cancel()
                self.write_timer = None

        def _stalled(self) -> None:
            self.write_timer = None
            logger.info(
                "aborting a connection from %s: its client read nothing for %g s (send_timeout_s)",
                _peer(self.client),
                config.send_timeout_s,
            )
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            if self.reading_head:
                self.head_bytes += len(data)
            elif self.guard_timer is not None:
                self._arm(config.body_timeout_s, "stopped sending the request body")
            super().data_received(data)
            closing = self.transport.is_closing()
            if self.reading_head and not closing and self.head_bytes > config.max_header_bytes:
                self._refuse(431, f"request head is larger than {config.max_header_bytes} bytes")
            if self.header_count > config.max_headers and not self.transport.is_closing():
                # The head is still incomplete: refused before more of it is parsed.
                self._refuse(431, f"more than {config.max_headers} request headers")
            # Checked once what was read is parsed: a body that came whole is no longer
            # pending, so a small request is never refused for others' slow bodies.
            if self.body_bytes and not self.transport.is_closing():
                over = pending_bodies.over(self.peer)
                if over is not None:
                    self._refuse(503, over, code="too_many_pending_bodies", retry_after=1)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self.reading_head:
                # A later request on a kept-alive connection: its head is timed afresh.
                self.reading_head = True
                self.head_bytes = 0
                self.header_count = 0
                self._arm(config.header_timeout_s, "sent no complete request head")

        def on_header(self, name: bytes, value: bytes) -> None:
            self.header_count += 1
            if self.header_count <= config.max_headers:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self.header_count > config.max_headers:
                self._refuse(431, f"more than {config.max_headers} request headers")
                return
            self.reading_head = False
            self._disarm()
            refusal = head_refusal(
                guard,
                head_keys,
                dict(self.headers),
                self.parser.get_method(),
                url_path(self.url),
            )
            if refusal is not None:
                self._refuse_with(refusal)
                return
            if self.over_capacity:
                self._refuse(
                    503,
                    f"the server holds {config.max_connections} connections already "
                    "([server] max_connections)",
                    retry_after=1,
                )
                return
            super().on_headers_complete()
            self._arm(config.body_timeout_s, "stopped sending the request body")

        def on_body(self, body: bytes) -> None:
            if not self.transport.is_closing():  # not for a request refused here
                self.body_bytes += len(body)
                pending_bodies.add(self.peer, len(body))
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            self._body_received()
            if not self.transport.is_closing():
                super().on_message_complete()

        def _body_received(self) -> None:
            """The body is whole (the app's now, bounded by max_body_bytes) or gone."""
            pending_bodies.add(self.peer, -self.body_bytes)
            self.body_bytes = 0

        def _arm(self, seconds: float, why: str) -> None:
            self._disarm()
            self.guard_timer = self.loop.call_later(seconds, self._on_timeout, why)

        def _disarm(self) -> None:
            if self.guard_timer is not None:
                self.guard_timer.cancel()
                self.guard_timer = None

        def _on_timeout(self, why: str) -> None:
            self.guard_timer = None
            if self.transport.is_closing():
                return
            if not self.reading_head and self.flow.read_paused:
                # The app has not taken what was read: the client is not the slow one.
                self._arm(config.body_timeout_s, why)
                return
            self._refuse(408, f"the client {why} within the time allowed")

        def _refuse(
            self,
            status: int,
            message: str,
            *,
            code: str | None = None,
            retry_after: int | None = None,
        ) -> None:
            headers = {"Retry-After": str(retry_after)} if retry_after else None
            error = ApiError(status, message, code=code or _CODES[status], headers=headers)
            self._refuse_with(error)

        def _refuse_with(self, error: ApiError) -> None:
            self._disarm()
            self._body_received()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # The app has the request: it sees a disconnect; any answer it started
                # cannot be finished.
                cycle.disconnected = True
                cycle.message_event.set()
            if cycle is None or cycle.response_complete or not cycle.response_started:
                self.transport.write(raw_response(error, url_path(self.url)))
            # Debug, not info: an attacker opens these by the thousand, and a log line
            # each would amplify the attack onto the disk.
            logger.debug("closing a connection from %s: %s", _peer(self.client), error.message)
            self.transport.close()

    GuardedHttpToolsProtocol.pending_bodies = pending_bodies
    return GuardedHttpToolsProtocol


class PendingBodies:
    """The bytes of request bodies received but not yet complete, all connections of a
    server together and by client address. Each waits for the rest of its body
    (``body_timeout_s`` between two reads), so without a bound on the sum a few hundred
    slow bodies hold their bytes for as long as the timeout lets them: the daemon's
    memory, not the client's. The bound per address keeps one client from filling the
    whole bound, which would get every other client's large body refused."""

    def __init__(self, limit: int, client_limit: int) -> None:
        self.limit = limit
        self.client_limit = client_limit
        self.total = 0
        self.by_client: dict[str, int] = {}

    def add(self, client: str, count: int) -> None:
        self.total += count
        held = self.by_client.get(client, 0) + count
        if held > 0:
            self.by_client[client] = held
        else:
            self.by_client.pop(client, None)

    def over(self, client: str) -> str | None:
        """Why a body of ``client`` that grew is refused now, or None."""
        if self.by_client.get(client, 0) > self.client_limit:
            return (
                f"this client holds more than {self.client_limit} bytes of request bodies "
                "still being received ([server] client_max_pending_body_bytes)"
            )
        if self.total > self.limit:
            return (
                f"the server holds {self.limit} bytes of request bodies still being "
                "received ([server] max_pending_body_bytes)"
            )
        return None


_CODES = {
    408: "request_timeout",
    431: "request_header_fields_too_large",
    503: "too_many_connections",
}


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def raise_open_files_limit(max_connections: int) -> int:
    """Raise this process's soft limit on open files toward its hard limit, enough for
    ``max_connections`` and the daemon's own files; the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new_soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        soft = new_soft
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning(
            "the open-files limit is %d, under max_connections (%d) + %d: raise LimitNOFILE "
            "(systemd) or ulimit -n, or lower [server] max_connections",
            soft,
            max_connections,
            _SPARE_FILES,
        )
    return int(soft)
