"""Many daemons behind a real load balancer, on loopback: the Kubernetes stand-in.

Run through ``scripts/scale-out`` (which installs haproxy when it is missing). It
starts ``--daemons`` ``modelpool serve`` processes (the fault-injection echo backend)
on 127.0.0.1 ports, haproxy in front of them with active checks on ``/readyz`` (the
Service), and a small kubelet: it probes each daemon's ``/healthz`` and restarts a
daemon whose probe fails ``--failure-threshold`` times in a row, or whose process
died, with Kubernetes' sequence (endpoint removed, preStop pause, SIGTERM, grace,
SIGKILL). Then, in one run::

    throughput   the same client through haproxy with 1 daemon in rotation, then all
    steady load  streaming and non-streaming requests, a client that retries
                 502/503/504 and connection errors (as docs/deployment.md tells clients to),
                 running through the three faults below
    roll         every daemon restarted one by one           (target: 0 failed requests)
    SIGKILL      one daemon killed; the kubelet replaces it   (its workers must die with it)
    SIGSTOP      one daemon frozen: /healthz times out, haproxy takes it out of rotation,
                 the kubelet replaces it                      (time in rotation is measured)

At the end: no request failed for good; every failed attempt was on the killed or
the stopped daemon while it was dying; no process of the run is left. One summary
line (``--json`` for the figures), exit 1 on a violation. ``--short`` is the
variant the test suite runs (tests/e2e/test_scale_out.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

DAEMON_CONFIG = """\
model = "none"
backend = "testing"
workers = {workers}
devices = ["cpu"]
deadline_s = 10.0
cancel_grace_s = 0.2
term_grace_s = {term_grace_s}
startup_timeout_s = 30.0
heartbeat_timeout_s = {heartbeat_timeout_s}

[generation_defaults]
max_new_tokens = 32

[retry]
max_retries = 1

[server]
host = "127.0.0.1"
port = {port}
drain_timeout_s = {drain_timeout_s}
"""

HAPROXY_CONFIG = """\
global
    maxconn 1024
    stats socket {socket} mode 600 level admin

defaults
    mode http
    timeout connect 1s
    timeout client 30s
    # A request that gets no answer (a frozen daemon) fails after this; the client retries.
    timeout server {server_timeout_ms}ms
    timeout check {check_timeout_ms}ms
    # Connection refused (a daemon restarting): try another server; no request was sent.
    retries 3
    option redispatch 1

frontend modelpool
    bind 127.0.0.1:{port}
    default_backend daemons

backend daemons
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
    # Which daemon answered, also on haproxy's own 502/504 answers: failures are
    # attributed to a daemon, not guessed from timing.
    http-after-response set-header x-scaleout-server %s
    default-server inter {inter_ms}ms fall {fall} rise 1
{servers}
"""

PROMPT_WORDS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def modelpool_command() -> list[str]:
    script = Path(sys.executable).parent / "modelpool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "modelpool.cli"]


def pids_alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_pids_gone(pids: set[int], timeout: float) -> float | None:
    """Seconds until every pid is gone, or None if some outlived ``timeout``."""
    started = time.monotonic()
    pause = threading.Event()
    while pids_alive(pids):
        if time.monotonic() - started > timeout:
            return None
        pause.wait(0.01)
    return time.monotonic() - started


# --------------------------------------------------------------------------------------------
# haproxy


class Haproxy:
    """haproxy in front of the daemons, driven through its runtime API socket."""

    def __init__(self, workdir: Path, ports: list[int], args: argparse.Namespace) -> None:
        self.socket_path = workdir / "haproxy.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.names = [f"d{i}" for i in range(len(ports))]
        servers = "\n".join(
            f"    server {name} 127.0.0.1:{port} check"
            for name, port in zip(self.names, ports, strict=True)
        )
        self.inter_s = args.lb_inter_ms / 1000
        self.fall = args.lb_fall
        self.check_timeout_s = args.lb_check_timeout_ms / 1000
        config = workdir / "haproxy.cfg"
        config.write_text(
            HAPROXY_CONFIG.format(
                socket=self.socket_path,
                server_timeout_ms=int(args.lb_server_timeout_s * 1000),
                check_timeout_ms=args.lb_check_timeout_ms,
                port=self.port,
                inter_ms=args.lb_inter_ms,
                fall=args.lb_fall,
                servers=servers,
            )
        )
        self.log_path = workdir / "haproxy.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["haproxy", "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
            )

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2.0)
            sock.connect(str(self.socket_path))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def statuses(self) -> dict[str, str]:
        """Each daemon's status as haproxy sees it: UP, DOWN, MAINT, or "UP 1/2"..."""
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        name_at, status_at, proxy_at = header.index("svname"), header.index("status"), 0
        result = {}
        for line in lines[1:]:
            fields = line.split(",")
            if (
                len(fields) > status_at
                and fields[proxy_at] == "daemons"
                and fields[name_at] in self.names
            ):
                result[fields[name_at]] = fields[status_at]
        return result

    def set_state(self, name: str, state: str) -> None:
        """ "maint" takes a daemon out of rotation (what the endpoints controller does for a
        terminating pod); "ready" puts it back, subject to its health checks."""
        self.command(f"set server daemons/{name} state {state}")

    def wait_status(self, name: str, prefix: str | tuple[str, ...], timeout: float) -> float:
        started = time.monotonic()
        pause = threading.Event()
        while not self.statuses().get(name, "").startswith(prefix):
            if time.monotonic() - started > timeout:
                raise Violation(f"haproxy: {name} not {prefix} after {timeout:.0f}s")
            pause.wait(0.01)
        return time.monotonic() - started

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while True:
            if self.process.poll() is not None:
                raise Violation(f"haproxy exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                self.statuses()
                return
            if time.monotonic() > deadline:
                raise Violation("haproxy's runtime socket did not open")
            pause.wait(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


# --------------------------------------------------------------------------------------------
# The daemons and the kubelet stand-in


class Violation(Exception):
    """Something the run promises did not hold; ends the run with exit status 1."""


@dataclass
class DaemonSlot:
    """One "pod": a fixed port and name, and the daemon process currently running there."""

    index: int
    name: str
    port: int
    config_path: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    probe_failures: int = 0
    every_pid: set[int] = field(default_factory=set)


@dataclass
class Restart:
    name: str
    reason: str
    detected_at: float
    ready_at: float = 0.0
    workers_gone_s: float | None = None
    sigkilled: bool = False


class Kubelet:
    """Plays the kubelet for the daemons: liveness probes, restarts, the stop sequence.

    A probe thread GETs each daemon's /healthz every ``period_s`` (timeout ``timeout_s``);
    ``failure_threshold`` failures in a row, or a dead process, restart it. A restart
    mirrors a pod's termination: out of the load balancer (endpoint removal), preStop
    pause, SIGTERM, up to ``grace_s``, SIGKILL; then a new daemon on the same port,
    back into the load balancer once it answers /readyz.
    """

    def __init__(self, slots: list[DaemonSlot], haproxy: Haproxy, args: argparse.Namespace) -> None:
        self.slots = slots
        self.haproxy = haproxy
        self.args = args
        self.period_s = args.probe_period_s
        self.timeout_s = args.probe_timeout_s
        self.failure_threshold = args.failure_threshold
        self.restarts: list[Restart] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.busy: set[str] = set()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._probe_loop, name="kubelet", daemon=True)

    # ---- starting and stopping one daemon ----------------------------------------------------

    def start_daemon(self, slot: DaemonSlot) -> None:
        with open(slot.log_path, "ab") as log:
            slot.process = subprocess.Popen(
                [*modelpool_command(), "serve", "--config", str(slot.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        slot.every_pid.add(slot.process.pid)
        slot.probe_failures = 0

    def wait_started(self, slot: DaemonSlot, timeout: float = 60.0) -> None:
        """The startup probe: /healthz answers 200 (the port opens once the pool is ready)."""
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        url = f"http://127.0.0.1:{slot.port}/healthz"
        assert slot.process is not None
        while time.monotonic() < deadline:
            if slot.process.poll() is not None:
                raise Violation(f"{slot.name} exited while starting: {self._log_tail(slot)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    self._note_workers(slot)
                    return
            pause.wait(0.05)
        raise Violation(f"{slot.name} did not start in {timeout:.0f}s: {self._log_tail(slot)}")

    def _note_workers(self, slot: DaemonSlot) -> None:
        assert slot.process is not None
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(slot.process.pid).children(recursive=True):
                slot.every_pid.add(child.pid)

    def _log_tail(self, slot: DaemonSlot) -> str:
        return slot.log_path.read_text(errors="replace")[-2000:]

    def terminate(self, slot: DaemonSlot, *, pre_stop: bool) -> tuple[float | None, bool]:
        """Kubernetes' stop sequence. Returns (seconds until the workers were gone, SIGKILLed)."""
        process = slot.process
        assert process is not None
        workers: set[int] = set()
        with contextlib.suppress(psutil.NoSuchProcess):
            workers = {c.pid for c in psutil.Process(process.pid).children(recursive=True)}
        slot.every_pid |= workers
        sigkilled = False
        if process.poll() is None:
            if pre_stop:
                self.stopping.wait(self.args.pre_stop_s)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self.args.grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                sigkilled = True
                process.wait(10)
        exited_at = time.monotonic()
        gone = wait_pids_gone(workers, timeout=5.0)
        return (None if gone is None else time.monotonic() - exited_at), sigkilled

    def restart(self, slot: DaemonSlot, reason: str, detected_at: float) -> Restart:
        record = Restart(slot.name, reason, detected_at)
        with self.lock:
            self.busy.add(slot.name)
        try:
            self.haproxy.set_state(slot.name, "maint")
            died = slot.process is not None and slot.process.poll() is not None
            record.workers_gone_s, record.sigkilled = self.terminate(slot, pre_stop=not died)
            self.start_daemon(slot)
            self.wait_started(slot)
            self.haproxy.set_state(slot.name, "ready")
            self.haproxy.wait_status(slot.name, "UP", timeout=10)
            record.ready_at = time.monotonic()
        finally:
            with self.lock:
                self.busy.discard(slot.name)
                self.restarts.append(record)
        return record

    # ---- the probe loop ------------------------------------------------------------------

    def _probe_loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self.stopping.wait(self.period_s):
                for slot in self.slots:
                    with self.lock:
                        if slot.name in self.busy:
                            continue
                    reason = self._probe(client, slot)
                    if reason is not None:
                        detected = time.monotonic()
                        threading.Thread(
                            target=self._restart_quietly,
                            args=(slot, reason, detected),
                            name=f"kubelet-restart-{slot.name}",
                            daemon=True,
                        ).start()
                        with self.lock:
                            self.busy.add(slot.name)

    def _probe(self, client: httpx.Client, slot: DaemonSlot) -> str | None:
        process = slot.process
        if process is None:
            return None
        if process.poll() is not None:
            return f"exited with {process.returncode}"
        try:
            ok = client.get(f"http://127.0.0.1:{slot.port}/healthz").status_code == 200
        except httpx.HTTPError:
            ok = False
        slot.probe_failures = 0 if ok else slot.probe_failures + 1
        if slot.probe_failures >= self.failure_threshold:
            return f"liveness failed {slot.probe_failures} times"
        return None

    def _restart_quietly(self, slot: DaemonSlot, reason: str, detected: float) -> None:
        try:
            self.restart(slot, reason, detected)
        except Violation as exc:
            self.errors.append(str(exc))

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(10)

    def wait_restart(self, name: str, after: float, timeout: float) -> Restart:
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while time.monotonic() < deadline:
            if self.errors:
                raise Violation(self.errors[0])
            with self.lock:
                for record in self.restarts:
                    if record.name == name and record.detected_at >= after and record.ready_at:
                        return record
            pause.wait(0.02)
        raise Violation(f"the kubelet did not replace {name} within {timeout:.0f}s")


# --------------------------------------------------------------------------------------------
# The client


@dataclass
class Attempt:
    started: float
    ended: float
    ok: bool
    server: str | None
    error: str | None


@dataclass
class Outcome:
    ok: bool
    attempts: list[Attempt]


# (the daemon that answered, per haproxy; the error, None on success; worth a retry?)
Answer = tuple[str | None, str | None, bool]


class LoadClient:
    """Concurrent requests through haproxy; retries 429/502/503/504 and transport errors."""

    RETRY_STATUSES = frozenset({429, 502, 503, 504})

    def __init__(self, url: str, max_attempts: int = 4) -> None:
        self.url = url
        self.max_attempts = max_attempts
        self.outcomes: list[Outcome] = []
        self.counter = 0

    async def one(self, client: httpx.AsyncClient, stream: bool) -> Outcome:
        self.counter += 1
        word = f"w{self.counter}"
        attempts: list[Attempt] = []
        for attempt_number in range(self.max_attempts):
            started = time.monotonic()
            server, error, retryable = None, None, True
            try:
                if stream:
                    server, error, retryable = await self._stream(client, word)
                else:
                    server, error, retryable = await self._complete(client, word)
            except httpx.TransportError as exc:
                error = f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                error, retryable = f"{type(exc).__name__}: {exc}", False
            attempts.append(Attempt(started, time.monotonic(), error is None, server, error))
            if error is None or not retryable:
                break
            if attempt_number + 1 < self.max_attempts:
                await asyncio.sleep(0.05 * (attempt_number + 1))
        outcome = Outcome(attempts[-1].ok, attempts)
        self.outcomes.append(outcome)
        return outcome

    async def _complete(self, client: httpx.AsyncClient, word: str) -> Answer:
        response = await client.post(
            "/v1/completions", json={"prompt": f"echo:{word}", "max_tokens": 8}
        )
        server = response.headers.get("x-scaleout-server")
        if response.status_code != 200:
            status = response.status_code
            return server, f"HTTP {status}", status in self.RETRY_STATUSES
        text = response.json()["choices"][0]["text"]
        if text != word:
            return server, f"wrong text {text!r}", False
        return server, None, False

    async def _stream(self, client: httpx.AsyncClient, word: str) -> Answer:
        body = {
            "messages": [{"role": "user", "content": f"tokens:{PROMPT_WORDS}:0.005"}],
            "max_tokens": PROMPT_WORDS,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            server = response.headers.get("x-scaleout-server")
            if response.status_code != 200:
                await response.aread()
                status = response.status_code
                return server, f"HTTP {status}", status in self.RETRY_STATUSES
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
            # A stream cut short: its daemon died under it; asking again is the remedy.
            return server, None if done else "stream ended without [DONE]", True

    async def run(
        self, concurrency: int, *, requests: int | None = None, until: asyncio.Event | None = None
    ) -> tuple[int, float]:
        """Send until ``requests`` are done or ``until`` is set; (requests, seconds)."""
        sent = 0
        started = time.monotonic()
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=15.0, limits=limits) as client:

            async def lane() -> None:
                nonlocal sent
                while True:
                    if requests is not None and sent >= requests:
                        return
                    if until is not None and until.is_set():
                        return
                    sent += 1
                    await self.one(client, stream=(sent % 3 == 0))

            await asyncio.gather(*(lane() for _ in range(concurrency)))
        return sent, time.monotonic() - started


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Window:
    """A fault: failed attempts on ``server`` between ``start`` and ``end`` are expected."""

    name: str
    server: str
    start: float
    end: float = float("inf")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("haproxy") is None:
        raise Violation("haproxy is not installed (scripts/scale-out installs it)")
    workdir = Path(tempfile.mkdtemp(prefix="modelpool-scale-out-"))
    slots = []
    for index in range(args.daemons):
        port = free_port()
        config_path = workdir / f"d{index}.toml"
        config_path.write_text(
            DAEMON_CONFIG.format(
                workers=args.workers,
                port=port,
                term_grace_s=args.term_grace_s,
                heartbeat_timeout_s=args.heartbeat_timeout_s,
                drain_timeout_s=args.drain_timeout_s,
            )
        )
        slots.append(DaemonSlot(index, f"d{index}", port, config_path, workdir / f"d{index}.log"))
    haproxy = Haproxy(workdir, [slot.port for slot in slots], args)
    kubelet = Kubelet(slots, haproxy, args)
    figures: dict[str, Any] = {"daemons": args.daemons, "workdir": str(workdir)}
    violations: list[str] = []
    try:
        haproxy.wait_ready(10)
        for slot in slots:
            kubelet.start_daemon(slot)
        for slot in slots:
            kubelet.wait_started(slot)
        for slot in slots:
            haproxy.wait_status(slot.name, "UP", timeout=15)
        kubelet.start()
        asyncio.run(_scenario(args, haproxy, kubelet, slots, figures, violations))
    finally:
        kubelet.stop()
        leftover_workers: set[int] = set()
        for slot in slots:
            if slot.process is not None:
                gone, _ = kubelet.terminate(slot, pre_stop=False)
                if gone is None:
                    leftover_workers.add(slot.index)
        haproxy.stop()
        every_pid = set().union(*(slot.every_pid for slot in slots)) | {haproxy.process.pid}
        left = pids_alive(every_pid)
        figures["leftover_processes"] = len(left)
        if left or leftover_workers:
            violations.append(f"processes left after the run: {sorted(left)}")
    figures["violations"] = violations
    if not violations:
        shutil.rmtree(workdir, ignore_errors=True)
    return figures


async def _scenario(
    args: argparse.Namespace,
    haproxy: Haproxy,
    kubelet: Kubelet,
    slots: list[DaemonSlot],
    figures: dict[str, Any],
    violations: list[str],
) -> None:
    # ---- throughput: 1 daemon in rotation, then all; alternated, same client ----------------
    others = [slot.name for slot in slots[1:]]
    rates: dict[int, list[float]] = {1: [], len(slots): []}
    for _ in range(args.rounds):
        for in_rotation in (1, len(slots)):
            for name in others:
                haproxy.set_state(name, "maint" if in_rotation == 1 else "ready")
            if in_rotation > 1:
                for name in others:
                    haproxy.wait_status(name, "UP", timeout=10)
            client = LoadClient(haproxy.url, max_attempts=1)
            sent, seconds = await client.run(args.concurrency, requests=args.requests)
            failed = sum(not o.ok for o in client.outcomes)
            if failed:
                violations.append(f"throughput ({in_rotation} daemons): {failed} failed")
            rates[in_rotation].append(sent / seconds)
    figures["rps_1"] = round(statistics.median(rates[1]), 1)
    figures["rps_n"] = round(statistics.median(rates[len(slots)]), 1)

    # ---- steady load through the faults ----------------------------------------------------
    client = LoadClient(haproxy.url)
    stop_load = asyncio.Event()
    load = asyncio.create_task(client.run(args.concurrency, until=stop_load))
    windows: list[Window] = []
    await asyncio.sleep(args.settle_s)

    roll_started = time.monotonic()
    for slot in slots:
        await asyncio.to_thread(kubelet.restart, slot, "roll", time.monotonic())
    roll_ended = time.monotonic()
    figures["roll_s"] = round(roll_ended - roll_started, 2)
    await asyncio.sleep(args.settle_s)

    killed = slots[0]
    assert killed.process is not None
    killed_workers = {c.pid for c in psutil.Process(killed.process.pid).children(recursive=True)}
    killed_at = time.monotonic()
    window = Window("sigkill", killed.name, killed_at)
    windows.append(window)
    killed.process.kill()
    gone = await asyncio.to_thread(wait_pids_gone, killed_workers, 5.0)
    figures["sigkill_workers_gone_s"] = None if gone is None else round(gone, 3)
    if gone is None:
        violations.append("SIGKILL: the daemon's workers outlived it by 5 s")
    record = await asyncio.to_thread(kubelet.wait_restart, killed.name, killed_at, 60)
    window.end = record.ready_at
    figures["sigkill_back_s"] = round(record.ready_at - killed_at, 2)
    await asyncio.sleep(args.settle_s)

    stopped = slots[1 % len(slots)]
    assert stopped.process is not None
    stopped_at = time.monotonic()
    window = Window("sigstop", stopped.name, stopped_at)
    windows.append(window)
    stopped.process.send_signal(signal.SIGSTOP)
    in_rotation = await asyncio.to_thread(haproxy.wait_status, stopped.name, ("DOWN", "MAINT"), 30)
    record = await asyncio.to_thread(kubelet.wait_restart, stopped.name, stopped_at, 60)
    window.end = record.ready_at
    figures["sigstop_in_rotation_s"] = round(in_rotation, 2)
    rotation_bound = haproxy.fall * (haproxy.inter_s + haproxy.check_timeout_s) + haproxy.inter_s
    figures["sigstop_rotation_bound_s"] = round(rotation_bound, 2)
    if in_rotation > rotation_bound:
        violations.append(
            f"SIGSTOP: {in_rotation:.2f}s in rotation, over the {rotation_bound:.2f}s bound"
        )
    figures["sigstop_detected_s"] = round(record.detected_at - stopped_at, 2)
    liveness_bound = kubelet.period_s + kubelet.failure_threshold * (
        kubelet.period_s + kubelet.timeout_s
    )
    figures["sigstop_liveness_bound_s"] = round(liveness_bound, 2)
    if record.detected_at - stopped_at > liveness_bound:
        violations.append("SIGSTOP: the kubelet's liveness probe took longer than its bound")
    figures["sigstop_back_s"] = round(record.ready_at - stopped_at, 2)
    await asyncio.sleep(args.settle_s)

    stop_load.set()
    sent, _ = await load
    _account(client, windows, (roll_started, roll_ended), figures, violations)
    figures["requests_under_faults"] = sent
    if kubelet.errors:
        violations.extend(kubelet.errors)
    for record in kubelet.restarts:
        if record.workers_gone_s is None:
            violations.append(f"{record.name} ({record.reason}): its workers outlived it")
    unexpected = [r for r in kubelet.restarts if r.reason != "roll"]
    figures["kubelet_restarts"] = {r.name + ":" + r.reason: r.sigkilled for r in unexpected}
    if len(unexpected) != 2:
        violations.append(
            f"the kubelet restarted {len(unexpected)} daemons on its own, expected 2: "
            f"{[(r.name, r.reason) for r in unexpected]}"
        )


def _account(
    client: LoadClient,
    windows: list[Window],
    roll: tuple[float, float],
    figures: dict[str, Any],
    violations: list[str],
) -> None:
    failed_for_good = [o for o in client.outcomes if not o.ok]
    expected = {w.name: 0 for w in windows}
    roll_failures = 0
    unexplained: list[Attempt] = []
    for outcome in client.outcomes:
        for attempt in outcome.attempts:
            if attempt.ok:
                continue
            window = next(
                (
                    w
                    for w in windows
                    if w.start <= attempt.ended <= w.end and (attempt.server in (None, w.server))
                ),
                None,
            )
            if window is not None:
                expected[window.name] += 1
            elif roll[0] <= attempt.ended <= roll[1]:
                roll_failures += 1
            else:
                unexplained.append(attempt)
    figures["failed_attempts"] = expected
    figures["roll_requests"] = sum(
        1 for o in client.outcomes if roll[0] <= o.attempts[0].started <= roll[1]
    )
    figures["roll_failed"] = roll_failures
    figures["failed_for_good"] = len(failed_for_good)
    if roll_failures:
        violations.append(f"{roll_failures} requests failed during the rolling restart")
    if failed_for_good:
        violations.append(
            f"{len(failed_for_good)} requests failed after every retry: "
            f"{failed_for_good[0].attempts[-1].error}"
        )
    if unexplained:
        violations.append(
            f"{len(unexplained)} failed attempts outside the fault windows, e.g. "
            f"{unexplained[0].error} on {unexplained[0].server}"
        )


def summary(figures: dict[str, Any]) -> str:
    failed = figures.get("failed_attempts", {})
    n = figures["daemons"]
    ratio = figures["rps_n"] / figures["rps_1"] if figures.get("rps_1") else float("nan")
    verdict = (
        "OK" if not figures["violations"] else "VIOLATION: " + "; ".join(figures["violations"])
    )
    return (
        f"scale-out: {figures.get('rps_1')} req/s with 1 daemon, {figures.get('rps_n')} with {n}"
        f" ({ratio:.2f}x); roll: {figures.get('roll_failed')} failed of "
        f"{figures.get('roll_requests')} requests; SIGKILL: workers gone in "
        f"{figures.get('sigkill_workers_gone_s')} s, serving again in "
        f"{figures.get('sigkill_back_s')} s, {failed.get('sigkill')} attempts retried; "
        f"SIGSTOP: {figures.get('sigstop_in_rotation_s')} s in rotation (bound "
        f"{figures.get('sigstop_rotation_bound_s')} s), replaced after "
        f"{figures.get('sigstop_detected_s')} s, back in {figures.get('sigstop_back_s')} s, "
        f"{failed.get('sigstop')} attempts retried; {figures.get('failed_for_good')} failed "
        f"for good of {figures.get('requests_under_faults')}; "
        f"{figures.get('leftover_processes')} processes left: {verdict}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the test suite's variant")
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="workers per daemon")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=600, help="per throughput round")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds (alternated)")
    parser.add_argument("--settle-s", type=float, default=2.0, help="load between faults")
    parser.add_argument("--probe-period-s", type=float, default=1.0)
    parser.add_argument("--probe-timeout-s", type=float, default=1.0)
    parser.add_argument("--failure-threshold", type=int, default=3)
    parser.add_argument("--pre-stop-s", type=float, default=1.0)
    parser.add_argument("--drain-timeout-s", type=float, default=5.0)
    parser.add_argument("--term-grace-s", type=float, default=0.5)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=2.0)
    parser.add_argument("--lb-inter-ms", type=int, default=500)
    parser.add_argument("--lb-fall", type=int, default=2)
    parser.add_argument("--lb-check-timeout-ms", type=int, default=400)
    parser.add_argument("--lb-server-timeout-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    if args.short:
        args.requests, args.rounds, args.settle_s, args.concurrency = 150, 1, 0.5, 4
        args.drain_timeout_s = 2.0
    # The kubelet's grace: drain + pool close + term grace, as the manifests compute it.
    args.grace_s = args.drain_timeout_s + 5.0 + args.term_grace_s + 2.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        figures = run(args)
    except Violation as exc:
        print(f"scale-out: VIOLATION: {exc}")
        return 1
    if args.json:
        print(json.dumps(figures, indent=2, default=str))
    print(summary(figures))
    if figures["violations"]:
        print(f"scale-out: logs kept in {figures['workdir']}", file=sys.stderr)
    return 1 if figures["violations"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
