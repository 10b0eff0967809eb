"""Run the security review's attacks against a live daemon and measure what they cost others.

Run through ``scripts/abuse``. It starts ``modelpool serve`` (the testing backend,
2 workers, no API key: the default on loopback, where every attack is open) on a free
127.0.0.1 port, then for each attack in turn measures three phases, ``--phase`` seconds
each: before, during, after. Throughout, three ordinary clients (each from its own
loopback address, since the daemon tells clients apart by address) send short
completions one after another, and a prober asks ``/healthz`` every 0.2 s on a kept-alive
connection and samples the daemon's RSS (its own process, not the workers). It prints
per attack and phase the ordinary clients' p50 latency, the daemon's peak RSS and the
worst ``/healthz`` latency and event-loop lag, with ratios to the "before" phase (each
attack has a fresh daemon), and what the attacker got. Goals (issue 25): ``/healthz``
< 1 s, RSS < 2x idle, ordinary p50 < 1.5x baseline. Bounded: every attack stops after
its phase, and the script after all of them (about 4 x phase + 5 s per attack). Exits 1
if a goal was missed.

The second review's attacks that need a real model or keys (cache-oracle, role-markers,
prefill-kill, grammar-burst: :mod:`abuse_model`; pending-bodies-keyed) run on a daemon of
the embedded SmolLM2 (hf, one worker, three API keys); each prints its own figure and
whether it is within its bound, and a figure past its bound is a missed goal too. The
third review's attacks between tenants (store-cross, store-evict, route-budget,
operator-only: :mod:`abuse_tenants`) run on a daemon of the testing backend with
``[models]`` tables and a keys file, and report the same way. Its pooling attacks
(pooling-deadline, pooling-flood: :mod:`abuse_pooling`) run on a daemon of the testing
backend's embedding model, whose ordinary clients embed, and whose p50 goal is an
absolute bound (``abuse_pooling.P50_BOUND_S``). The first review's burst again
(burst-shared-key) runs on a testing daemon with the one key of ``api_key_env``, which
the attacker and the ordinary clients all hold.
Its attacks on priority, admission and tracing (urgent-priority, queue-full, tracer-leak,
hanging-collector: :mod:`abuse_fairness`) run on daemons of the testing backend with
tenants, or with two models traced to a collector that hangs.

    scripts/abuse [--phase 6] [--only noread,fairness] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import abuse_fairness
import abuse_model
import abuse_pooling
import abuse_tenants
import httpx
import psutil

CONFIG = """\
model = "none"
backend = "testing"
workers = 2
devices = ["cpu"]
deadline_s = 30.0

[generation_defaults]
max_new_tokens = 64

[server]
host = "127.0.0.1"
port = {port}
api_key_env = "{key_env}"
drain_timeout_s = 5.0
"""
# The one key of api_key_env that every client holds (burst-shared-key's daemon).
SHARED_KEY = "sk-abuse-shared-0123456789"
SHARED_HEADERS = {"Authorization": f"Bearer {SHARED_KEY}"}
ORDINARY_ADDRESSES = ("127.0.0.10", "127.0.0.11", "127.0.0.12")
ORDINARY_PROMPT = {"prompt": "tokens:5:0.01"}  # about 50 ms of worker time
# Between two requests of an ordinary client: three of them then use about a third of
# the two workers, so that the baseline is not a saturated pool already.
ORDINARY_THINK_S = 0.2
# An abusive client gives up (and so disconnects, which cancels its runs) after this.
ATTACKER_TIMEOUT_S = 5.0
ATTACKER = "127.0.0.2"
GOALS = {"healthz_s": 1.0, "rss_ratio": 2.0, "p50_ratio": 1.5}
# The daemons the attacks run on (start_daemon).
DaemonKind = Literal[
    "testing", "keyed", "model", "embedding", "tenants", "priority-tenants", "tracing"
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_daemon(
    workdir: Path, kind: DaemonKind = "testing"
) -> tuple[subprocess.Popen[bytes], str]:
    """``modelpool serve`` on a free port, of ``kind`` (``DAEMONS``): the testing backend
    (``keyed``: with one key, ``SHARED_KEY``), the embedded SmolLM2 with API keys
    (:mod:`abuse_model`), the testing backend's embedding model (:mod:`abuse_pooling`),
    its models and tenants (:mod:`abuse_tenants`), or those of :mod:`abuse_fairness`."""
    port = _free_port()
    config = workdir / "abuse.toml"
    config.write_text(DAEMONS[kind][0](port, workdir))
    log = open(workdir / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes it
    process = subprocess.Popen(
        [sys.executable, "-m", "modelpool", "serve", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "MODELPOOL_ABUSE_UNSET_KEY"}
        | {"MODELPOOL_ABUSE_SHARED_KEY": SHARED_KEY},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the daemon exited:\n{(workdir / 'daemon.log').read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return process, url
        time.sleep(0.05)
    process.kill()
    raise SystemExit("the daemon was not ready within 120 s")


# ---- measuring -----------------------------------------------------------------------------


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    healthz_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)


class Observer:
    """Ordinary clients and the prober, recording into the current phase's Samples."""

    def __init__(
        self,
        url: str,
        daemon_pid: int,
        prompt: dict[str, Any] = ORDINARY_PROMPT,
        headers: dict[str, str] | None = None,
        path: str = "/v1/completions",
    ) -> None:
        self.url = url
        self.prompt = prompt
        self.path = path
        self.headers = headers or {}
        self.daemon = psutil.Process(daemon_pid)
        self.current = Samples()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._ordinary, args=(address,), daemon=True)
            for address in ORDINARY_ADDRESSES
        ]
        self.threads.append(threading.Thread(target=self._probe, daemon=True))

    def __enter__(self) -> Observer:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def phase(self) -> Samples:
        """Start a new phase; the samples of the one that ended."""
        ended, self.current = self.current, Samples()
        return ended

    def _ordinary(self, address: str) -> None:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(
            base_url=self.url, transport=transport, timeout=60, headers=self.headers
        ) as client:
            while not self.stop.is_set():
                samples = self.current
                started = time.perf_counter()
                try:
                    response = client.post(self.path, json=self.prompt)
                    outcome = "ok" if response.status_code == 200 else str(response.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                if outcome == "ok":
                    samples.latencies.append(time.perf_counter() - started)
                else:
                    samples.errors[outcome] = samples.errors.get(outcome, 0) + 1
                self.stop.wait(ORDINARY_THINK_S)

    def _probe(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.wait(0.2):
                samples = self.current
                with contextlib.suppress(psutil.Error):
                    samples.rss_mb.append(self.daemon.memory_info().rss / 2**20)
                started = time.perf_counter()
                try:
                    response = client.get("/healthz")
                    samples.lag_s.append(float(response.json().get("event_loop_lag_s", 0.0)))
                except (httpx.HTTPError, ValueError):
                    samples.lag_s.append(float("nan"))
                samples.healthz_s.append(time.perf_counter() - started)


def summary(samples: Samples, baseline: dict[str, float]) -> dict[str, Any]:
    p50 = statistics.median(samples.latencies) if samples.latencies else float("nan")
    rss = max(samples.rss_mb, default=float("nan"))
    return {
        "p50_ms": p50 * 1000,
        "p50_ratio": p50 / baseline["p50"] if baseline else 1.0,
        "rss_mb": rss,
        "rss_ratio": rss / baseline["rss"] if baseline else 1.0,
        "healthz_s": max(samples.healthz_s, default=float("nan")),
        "lag_s": max(samples.lag_s, default=float("nan")),
        "ordinary_ok": len(samples.latencies),
        "ordinary_errors": dict(samples.errors),
    }


# ---- attacks -------------------------------------------------------------------------------
# Each runs until ``stop`` is set (the end of its "during" phase) and returns what it got.

Attack = Callable[[str, threading.Event], dict[str, Any]]


def _sock(url: str, rcvbuf: int | None = None) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((ATTACKER, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _post_head(body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n"
    )


def _status(sock: socket.socket) -> str:
    sock.settimeout(5)
    try:
        head = sock.recv(64)
    except OSError as exc:
        return type(exc).__name__
    return head[9:12].decode() if head.startswith(b"HTTP/1.1 ") else ("closed" if not head else "?")


def _count(statuses: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return counts


def attack_noread(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 1: streams of 250,000 tokens whose client never reads (4 KB receive
    buffer), held open for the phase. n=4 as in the review is over the budget now."""
    refused = httpx.post(
        url + "/v1/completions",
        json={"prompt": "tokens:250000:0", "max_tokens": 250000, "n": 4, "stream": True},
        timeout=30,
    ).status_code
    body = b'{"prompt":"tokens:250000:0","max_tokens":250000,"stream":true}'
    socks = []
    for _ in range(4):
        sock = _sock(url, rcvbuf=4096)
        sock.sendall(_post_head(body) + body)
        socks.append(sock)
    stop.wait()
    for sock in socks:
        sock.close()
    return {"n=4 request": refused, "streams held": len(socks)}


def attack_big_answer(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2: the 8 KB body answered with 82 MB (n=32, echo, logprobs=20), then the
    largest answer the budget allows, sent again and again by two clients."""
    review = {"prompt": "x" * 8000, "n": 32, "echo": True, "logprobs": 20, "max_tokens": 1}
    first = httpx.post(url + "/v1/completions", json=review, timeout=60).status_code
    allowed = {"prompt": "x" * 20000, "n": 2, "echo": True, "logprobs": 5, "max_tokens": 1}
    statuses: list[str] = []
    sizes: list[int] = []

    def loop() -> None:
        transport = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(base_url=url, transport=transport, timeout=60) as client:
            while not stop.is_set():
                response = client.post("/v1/completions", json=allowed)
                statuses.append(str(response.status_code))
                sizes.append(len(response.content))

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "review's request": first,
        "budget-sized answers": _count(statuses),
        "MB each": round(max(sizes, default=0) / 2**20, 1),
    }


def attack_fairness(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3: n=128 with its own timeout of 40 s, sent again and again by two clients
    of one address: one address against three ordinary ones."""
    burst = {"prompt": "tokens:20:0.05", "n": 128, "timeout": 40}
    statuses: list[str] = []

    def loop() -> None:
        transport = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(base_url=url, transport=transport, timeout=ATTACKER_TIMEOUT_S) as client:
            while not stop.is_set():
                try:
                    statuses.append(str(client.post("/v1/completions", json=burst).status_code))
                except httpx.TimeoutException:
                    statuses.append("gave up")  # and disconnected: its runs are cancelled
                if statuses[-1] == "429":
                    stop.wait(1.0)  # Retry-After

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"bursts": _count(statuses)}


def attack_burst_shared_key(url: str, stop: threading.Event) -> dict[str, Any]:
    """Issue 58, item 9: the first review's burst (n=64 of 40 tokens at 50 ms, its own 5 s
    deadline) on two connections of one address, on a daemon with one key that every
    client holds: counted as one client, it took every other's turn."""
    burst = {"prompt": "tokens:40:0.05", "n": 64, "timeout": 5}
    statuses: list[str] = []

    def loop() -> None:
        transport = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(
            base_url=url, transport=transport, timeout=30, headers=SHARED_HEADERS
        ) as client:
            while not stop.is_set():
                statuses.append(str(client.post("/v1/completions", json=burst).status_code))
                if statuses[-1] == "429":
                    stop.wait(1.0)  # Retry-After

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"bursts": _count(statuses)}


def _hold(url: str, stop: threading.Event, count: int, first: bytes, drip: bytes) -> dict[str, Any]:
    socks: list[socket.socket] = []
    failed = 0
    for _ in range(count):
        try:
            sock = _sock(url)
            if first:
                sock.sendall(first)
            socks.append(sock)
        except OSError:
            failed += 1
    while not stop.wait(1.0):
        for sock in socks:
            with contextlib.suppress(OSError):
                if drip:
                    sock.send(drip)
    # Still open at the end of the phase: the server did not close them; the others were
    # answered (408, 503) or closed.
    open_count = 0
    answered: list[str] = []
    for sock in socks:
        sock.setblocking(False)
        try:
            head = sock.recv(64)
            answered.append(head[9:12].decode() if head.startswith(b"HTTP/1.1 ") else "closed")
        except BlockingIOError:
            open_count += 1
        except OSError as exc:
            answered.append(type(exc).__name__)
        sock.close()
    return {
        "connections": count,
        "refused at connect": failed,
        "still open at end": open_count,
        "answered": _count(answered),
    }


def attack_idle(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 4: 1,100 plain TCP connections that send nothing."""
    return _hold(url, stop, 1100, b"", b"")


def attack_slow_headers(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 4: 500 connections sending a header a byte a second."""
    return _hold(url, stop, 500, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ", b"x")


def attack_slow_body(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 4: 300 bodies declared 1 MB, 64 KB sent, then a byte a second."""
    head = _post_head(b"", content_length=1_000_000) + b'{"prompt":"' + b"x" * 65536
    return _hold(url, stop, 300, head, b"x")


def attack_big_headers(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 5: 8 parallel requests with a 64 MB header, again and again."""
    statuses: list[str] = []
    chunk = b"x" * 2**20

    def loop() -> None:
        while not stop.is_set():
            try:
                sock = _sock(url)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
                for _ in range(64):
                    sock.sendall(chunk)
                sock.sendall(b"\r\n\r\n")
                statuses.append(_status(sock))
            except OSError as exc:
                statuses.append(type(exc).__name__)  # closed under us: refused early
            finally:
                sock.close()

    threads = [threading.Thread(target=loop) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"big heads": _count(statuses)}


def attack_ignored_fields(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 9: 4 clients sending a near-1 MB metadata array of small ints."""
    body = json.dumps({"prompt": "echo:x", "metadata": {"k": [1] * 300_000}}).encode()
    statuses: list[str] = []

    def loop() -> None:
        transport = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(base_url=url, transport=transport, timeout=60) as client:
            while not stop.is_set():
                response = client.post(
                    "/v1/completions", content=body, headers={"Content-Type": "application/json"}
                )
                statuses.append(str(response.status_code))

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"requests": _count(statuses)}


def attack_browser(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 6: what a web page (CSRF) and DNS rebinding send, again and again."""
    body = b'{"prompt":"echo:pwned","max_tokens":4}'
    port = url.rsplit(":", 1)[1]
    seen: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.wait(0.1):
            seen["text/plain"] = str(
                client.post(
                    "/v1/completions",
                    content=body,
                    headers={"Content-Type": "text/plain;charset=UTF-8"},
                ).status_code
            )
            seen["rebound Host"] = str(
                client.get(
                    "/stats", headers={"Host": f"rebind.attacker.example:{port}"}
                ).status_code
            )
            seen["foreign Origin"] = str(
                client.post(
                    "/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json", "Origin": "http://evil.example"},
                ).status_code
            )
    return seen


# ---- the second review (issue 40) -----------------------------------------------------------


def _looping(
    url: str,
    stop: threading.Event,
    clients: int,
    send: Callable[[httpx.Client], Any],
    address: str = ATTACKER,
) -> dict[str, Any]:
    """``clients`` threads of ``address``, each calling ``send`` until the phase ends;
    what they got, counted by status (or "gave up")."""
    statuses: list[str] = []
    seconds: list[float] = []

    def loop() -> None:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(base_url=url, transport=transport, timeout=ATTACKER_TIMEOUT_S) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    statuses.append(str(send(client).status_code))
                except httpx.TimeoutException:
                    statuses.append("gave up")
                seconds.append(time.monotonic() - started)
                if statuses[-1] == "429":
                    stop.wait(1.0)  # Retry-After

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"answers": _count(statuses), "max s": round(max(seconds, default=0), 2)}


def _allof_tools(count: int, branches: int) -> list[dict[str, Any]]:
    """Tools whose parameter is an allOf of ``branches`` anyOf string patterns, which the
    grammar engine would intersect in every combination (2 ** branches)."""

    def alternatives(i: int, j: int) -> dict[str, Any]:
        return {"anyOf": [{"pattern": f"a{j}_{i}.*"}, {"pattern": f".*b{j}"}]}

    def parameter(i: int) -> dict[str, Any]:
        return {"type": "string", "allOf": [alternatives(i, j) for j in range(branches)]}

    return [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "parameters": {"type": "object", "properties": {"x": parameter(i)}},
            },
        }
        for i in range(count)
    ]


def attack_schema_loop(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #1: 44 tools, each parameter an allOf of 14 anyOf patterns (65 KB)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": _allof_tools(44, 14)}
    return _looping(url, stop, 1, lambda c: c.post("/v1/chat/completions", json=body))


def attack_choice_lists(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #2: six guided_choice lists of 50,000 items at once, again and again."""

    def send(client: httpx.Client) -> httpx.Response:
        # Distinct lists (no cache helps), each about 400 KB: under max_body_bytes.
        items = [str(time.monotonic_ns()), *(f"c{i}" for i in range(49_999))]
        body = {"messages": [{"role": "user", "content": "hi"}], "guided_choice": items}
        return client.post("/v1/chat/completions", json=body)

    return _looping(url, stop, 6, send)


def attack_forwarded(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #5: n=128 requests, each naming another address in X-Forwarded-For,
    from 127.0.0.1 (the address uvicorn believes by default)."""
    counter = iter(range(10**9))
    burst = {"prompt": "tokens:20:0.05", "n": 128, "timeout": 40}

    def send(client: httpx.Client) -> httpx.Response:
        forwarded = {"X-Forwarded-For": f"10.9.{next(counter) % 250}.{next(counter) % 250}"}
        return client.post("/v1/completions", json=burst, headers=forwarded)

    return _looping(url, stop, 8, send, address="127.0.0.1")


def attack_pending_bodies(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #6: 8 sockets of one client, each 1,040,000 bytes of a declared 1 MiB
    body, then a byte every 10 s; meanwhile another client's 200 KB bodies."""
    head = _post_head(b"", content_length=1_048_576) + b'{"prompt":"' + b"x" * 1_040_000
    legit: list[str] = []

    def legit_bodies() -> None:
        transport = httpx.HTTPTransport(local_address="127.0.0.13")
        body = {"prompt": "echo:" + "y" * 200_000, "max_tokens": 1}
        with httpx.Client(base_url=url, transport=transport, timeout=10) as client:
            while not stop.wait(0.5):
                with contextlib.suppress(httpx.TransportError):
                    legit.append(str(client.post("/v1/completions", json=body).status_code))

    thread = threading.Thread(target=legit_bodies)
    thread.start()
    held = _hold(url, stop, 8, head, b"")
    thread.join()
    return {**held, "other client's 200 KB bodies": _count(legit)}


def attack_pending_bodies_keyed(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #6 with a key set: the same 8 held bodies without a key must be answered
    401 on their head and closed, so that they hold nothing; meanwhile a client with a
    key sends 200 KB bodies (on the model daemon, which has keys)."""
    head = _post_head(b"", content_length=1_048_576) + b'{"prompt":"' + b"x" * 1_040_000
    legit: list[str] = []

    def legit_bodies() -> None:
        body = {"prompt": "y " * 100_000, "max_tokens": 1}
        with httpx.Client(base_url=url, timeout=30, headers=abuse_model.ORDINARY_HEADERS) as client:
            while not stop.wait(0.5):
                with contextlib.suppress(httpx.TransportError):
                    response = client.post("/v1/completions", json=body)
                    # Past the model's context: a 400 that says the body was read whole.
                    code = response.json().get("error", {}).get("code")
                    legit.append(f"{response.status_code} {code}" if code else "200")

    thread = threading.Thread(target=legit_bodies)
    thread.start()
    held = _hold(url, stop, 8, head, b"")
    thread.join()
    answered = held["answered"]
    passed = held["still open at end"] == 0 and set(answered) <= {"401", "closed"}
    return {
        **held,
        "keyed client's 200 KB bodies": _count(legit),
        "figure": f"{held['still open at end']} of 8 unauthenticated bodies still open, "
        f"answered {answered}",
        "bound": "all answered 401 or closed, none held",
        "passed": passed,
    }


def attack_tokenize(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #11: 4 clients looping /tokenize with a 1 MB string."""
    body = {"prompt": "x" * 1_000_000}
    return _looping(url, stop, 4, lambda c: c.post("/tokenize", json=body))


def attack_empty_messages(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #12: 30,001 messages (30,000 empty) with n=128."""
    messages = [{"role": "user", "content": ""}] * 30_000 + [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "n": 128}
    return _looping(url, stop, 1, lambda c: c.post("/v1/chat/completions", json=body))


def attack_logprobs(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 2, #15: n=2 x 6,000 tokens x top_logprobs 20, 4 clients looping."""
    body = {
        "messages": [{"role": "user", "content": "tokens:6000"}],
        "n": 2,
        "max_tokens": 6000,
        "logprobs": True,
        "top_logprobs": 20,
    }
    return _looping(url, stop, 4, lambda c: c.post("/v1/chat/completions", json=body))


ATTACKS: dict[str, Attack] = {
    "noread": attack_noread,
    "big-answer": attack_big_answer,
    "fairness": attack_fairness,
    "idle-conns": attack_idle,
    "slow-headers": attack_slow_headers,
    "slow-body": attack_slow_body,
    "big-headers": attack_big_headers,
    "ignored-fields": attack_ignored_fields,
    "browser": attack_browser,
    "schema-loop": attack_schema_loop,
    "choice-lists": attack_choice_lists,
    "forwarded": attack_forwarded,
    "pending-bodies": attack_pending_bodies,
    "tokenize": attack_tokenize,
    "empty-messages": attack_empty_messages,
    "logprobs": attack_logprobs,
    "pending-bodies-keyed": attack_pending_bodies_keyed,
    "cache-oracle": abuse_model.attack_cache_oracle,
    "role-markers": abuse_model.attack_role_markers,
    "prefill-kill": abuse_model.attack_prefill_kill,
    "grammar-burst": abuse_model.attack_grammar_burst,
    **abuse_tenants.ATTACKS,
    "pooling-deadline": abuse_pooling.attack_deadline,
    "pooling-flood": abuse_pooling.attack_flood,
    "burst-shared-key": attack_burst_shared_key,
    "urgent-priority": abuse_fairness.attack_urgent_priority,
    "queue-full": abuse_fairness.attack_queue_full,
    "tracer-leak": abuse_fairness.attack_tracer_leak,
    "hanging-collector": abuse_fairness.attack_hanging_collector,
}
# Those that run on the testing backend's embedding model (abuse_pooling).
POOLING_ATTACKS = frozenset({"pooling-deadline", "pooling-flood"})
# The daemon each attack runs on, when not the testing backend's.
KINDS: dict[str, DaemonKind] = {
    **dict.fromkeys(
        ("pending-bodies-keyed", "cache-oracle", "role-markers", "prefill-kill", "grammar-burst"),
        "model",
    ),
    **dict.fromkeys(abuse_tenants.ATTACKS, "tenants"),
    **dict.fromkeys(POOLING_ATTACKS, "embedding"),
    "burst-shared-key": "keyed",
    "urgent-priority": "priority-tenants",
    "queue-full": "priority-tenants",
    "tracer-leak": "tracing",
    "hanging-collector": "tracing",
}
COMPLETIONS = "/v1/completions"
# Per kind of daemon: its config (given the port and a work directory), the ordinary
# clients' request, headers and route.
DAEMONS: dict[
    DaemonKind,
    tuple[Callable[[int, Path], str], dict[str, Any], dict[str, str] | None, str],
] = {
    "testing": (
        lambda port, _: CONFIG.format(port=port, key_env="MODELPOOL_ABUSE_UNSET_KEY"),
        ORDINARY_PROMPT,
        None,
        COMPLETIONS,
    ),
    "keyed": (
        lambda port, _: CONFIG.format(port=port, key_env="MODELPOOL_ABUSE_SHARED_KEY"),
        ORDINARY_PROMPT,
        SHARED_HEADERS,
        COMPLETIONS,
    ),
    "model": (
        abuse_model.config,
        abuse_model.ORDINARY_PROMPT,
        abuse_model.ORDINARY_HEADERS,
        COMPLETIONS,
    ),
    "tenants": (
        abuse_tenants.config,
        abuse_tenants.ORDINARY_PROMPT,
        abuse_tenants.ORDINARY_HEADERS,
        COMPLETIONS,
    ),
    "embedding": (
        lambda port, _: abuse_pooling.CONFIG.format(port=port),
        abuse_pooling.ORDINARY_BODY,
        None,
        abuse_pooling.ORDINARY_PATH,
    ),
    "priority-tenants": (
        abuse_fairness.tenants_config,
        abuse_fairness.TENANTS_PROMPT,
        abuse_fairness.TENANTS_HEADERS,
        COMPLETIONS,
    ),
    "tracing": (abuse_fairness.tracing_config, abuse_fairness.TRACING_PROMPT, None, COMPLETIONS),
}


@contextlib.contextmanager
def running(attack: Attack, url: str) -> Iterator[Callable[[], dict[str, Any]]]:
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome.update(attack(url, stop))
        except Exception as exc:  # the attack's own failure is reported, not fatal
            outcome["attack failed"] = repr(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield lambda: outcome
    finally:
        stop.set()
        thread.join(120)


def run(phase_s: float, only: list[str]) -> list[dict[str, Any]]:
    """Each attack on a fresh daemon, so that none inherits another's memory; the ratios
    are to that daemon's own "before" phase (its idle RSS, its ordinary p50)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    rows: list[dict[str, Any]] = []
    for name in only:
        with tempfile.TemporaryDirectory(prefix="modelpool-abuse-") as tmp:
            kind = KINDS.get(name, "testing")
            process, url = start_daemon(Path(tmp), kind)
            ordinary = DAEMONS[kind][1:]
            try:
                with Observer(url, process.pid, *ordinary) as observer:
                    time.sleep(phase_s)  # warm up: imports, connections, first dispatches
                    warm_until = time.monotonic() + 60
                    while len(observer.current.latencies) < 3 and time.monotonic() < warm_until:
                        time.sleep(0.2)  # a model's first forward passes take longer
                    observer.phase()
                    time.sleep(phase_s)
                    before = observer.phase()
                    if not before.latencies:
                        raise SystemExit(f"{name}: no ordinary answer before: {before.errors}")
                    baseline = {
                        "p50": statistics.median(before.latencies),
                        "rss": max(before.rss_mb),
                    }
                    with running(ATTACKS[name], url) as outcome:
                        time.sleep(phase_s)
                        during = observer.phase()
                    observer.phase()  # the attack's teardown belongs to no phase
                    time.sleep(phase_s)
                    after = observer.phase()
            finally:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
        for label, samples in (("before", before), ("during", during), ("after", after)):
            rows.append({"attack": name, "phase": label, **summary(samples, baseline)})
        got = outcome()
        rows[-2]["attacker got"] = got
        if "figure" in got:
            verdict = "pass" if got.get("passed") else "FAIL"
            print(f"{name}: {got['figure']} ({verdict}: {got['bound']})", flush=True)
        print(f"{name}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| attack | phase | ordinary p50 ms (x base) | daemon RSS MB (x idle) "
        "| /healthz worst s | loop lag worst s | ordinary ok / errors | attacker got |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        errors = ", ".join(f"{k} {v}" for k, v in row["ordinary_errors"].items()) or "0"
        got = row.get("attacker got")
        lines.append(
            f"| {row['attack']} | {row['phase']} "
            f"| {row['p50_ms']:.0f} ({row['p50_ratio']:.2f}) "
            f"| {row['rss_mb']:.0f} ({row['rss_ratio']:.2f}) "
            f"| {row['healthz_s']:.3f} | {row['lag_s']:.3f} "
            f"| {row['ordinary_ok']} / {errors} "
            f"| {json.dumps(got, separators=(', ', ': ')) if got else ''} |"
        )
    return "\n".join(lines)


def missed_goals(rows: list[dict[str, Any]]) -> list[str]:
    missed = []
    for row in rows:
        where = f"{row['attack']} {row['phase']}"
        got = row.get("attacker got") or {}
        if not row["healthz_s"] < GOALS["healthz_s"]:
            missed.append(f"{where}: /healthz {row['healthz_s']:.2f} s")
        if not row["rss_ratio"] < GOALS["rss_ratio"]:
            missed.append(f"{where}: RSS {row['rss_ratio']:.2f}x idle")
        # The pooling attacks' goal is an absolute p50; an attack that takes the ordinary
        # clients' share by design says its own bound on the ratio.
        p50_bound = got.get("ordinary p50 bound", GOALS["p50_ratio"])
        if row["attack"] in POOLING_ATTACKS:
            if not row["p50_ms"] < abuse_pooling.P50_BOUND_S * 1000:
                missed.append(f"{where}: ordinary p50 {row['p50_ms']:.0f} ms")
        elif not row["p50_ratio"] < p50_bound:
            missed.append(f"{where}: ordinary p50 {row['p50_ratio']:.2f}x baseline")
        if "passed" in got and not got["passed"]:
            missed.append(f"{where}: {got['figure']} (bound: {got['bound']})")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/abuse", description=__doc__.split("\n")[0])
    parser.add_argument("--phase", type=float, default=6.0, help="seconds per phase (6)")
    parser.add_argument("--only", default=",".join(ATTACKS), help="attacks to run, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attack {unknown[0]!r} (known: {', '.join(ATTACKS)})")
    rows = run(args.phase, only)
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    missed = missed_goals(rows)
    for line in missed:
        print(f"goal missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
