"""The third review's attacks on priority, admission and tracing (issue 58), for
``scripts/abuse``.

They need daemons of their own, which :mod:`abuse` starts by the attack's kind: "tenants"
(the testing backend, 2 workers, API keys: the ordinary clients' tenant and the
attacker's, whose ``most_urgent_priority`` is 0; the ordinary clients send
``max_queue_time_s = 2``) and "tracing" (models a and b of the testing backend, one
worker each, traced to a collector on 127.0.0.1 that accepts connections and never
answers, which :func:`tracing_config` starts in this process). Each attack returns what
the attacker got, its figure and whether the figure is within its bound (``passed``);
:mod:`abuse` measures the ordinary clients around it as for every attack.

=================  ========================================================================
urgent-priority    the attacker's tenant keeps 4 requests of 1 s going at the most urgent
                   priority: every one is clamped to its bound (``X-Priority-Clamped``)
queue-full         the attacker's tenant keeps 12 requests of 4 s going: under 10 % of
                   another tenant's short requests (bounded at 2 s, sent one after
                   another) are 429 ``queue_full``
tracer-leak        models a and b loaded and unloaded in turn (``/models/load``,
                   ``/models/unload``): the daemon's threads grow by at most 2
hanging-collector  8 clients at full speed while the collector hangs: the exporter's queue
                   stays within its bound, the records past it dropped and counted
=================  ========================================================================
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from modelpool.supervisor.trace_export import MAX_QUEUED_RECORDS

ATTACKER = "127.0.0.2"
ATTACKER_TIMEOUT_S = 30.0
ORDINARY_KEY = "sk-abuse-ordinary-0123456789"
ATTACKER_KEY = "sk-abuse-attacker-0123456789"
KEYS = f"""\
[tenants.ordinary]
key = "{ORDINARY_KEY}"
[tenants.attacker]
key = "{ATTACKER_KEY}"
most_urgent_priority = 0
"""
TENANTS_CONFIG = """\
model = "none"
backend = "testing"
workers = 2
devices = ["cpu"]
deadline_s = 60.0

[generation_defaults]
max_new_tokens = 64

[server]
host = "127.0.0.1"
port = {port}
keys_file = "{keys}"
drain_timeout_s = 5.0
"""
TENANTS_PROMPT = {"prompt": "tokens:5:0.01", "max_queue_time_s": 2.0}
TENANTS_HEADERS = {"Authorization": f"Bearer {ORDINARY_KEY}"}
TRACING_CONFIG = """\
backend = "testing"
workers = 1
devices = ["cpu"]
deadline_s = 30.0

[server]
host = "127.0.0.1"
port = {port}
otlp_traces_endpoint = "{endpoint}"
drain_timeout_s = 5.0

[models.a]
model = "a"

[models.b]
model = "b"
"""
TRACING_PROMPT = {"model": "a", "prompt": "echo:x"}
# A collector that hangs: connections accepted, the exports read and never answered.
_silent: list[socket.socket] = []


def tenants_config(port: int, workdir: Path) -> str:
    keys = workdir / "keys.toml"
    keys.write_text(KEYS)
    return TENANTS_CONFIG.format(port=port, keys=keys)


def tracing_config(port: int, workdir: Path) -> str:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_hold_connections, args=(listener,), daemon=True).start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"
    return TRACING_CONFIG.format(port=port, endpoint=endpoint)


def _hold_connections(listener: socket.socket) -> None:
    while True:
        connection, _ = listener.accept()
        _silent.append(connection)


def _keep_going(
    url: str, stop: threading.Event, clients: int, body: dict[str, Any]
) -> list[httpx.Response | str]:
    """``clients`` loops of the attacker's tenant sending ``body`` until the phase ends."""
    answers: list[httpx.Response | str] = []

    def loop() -> None:
        headers = {"Authorization": f"Bearer {ATTACKER_KEY}"}
        transport = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(
            base_url=url, transport=transport, timeout=ATTACKER_TIMEOUT_S, headers=headers
        ) as client:
            while not stop.is_set():
                try:
                    answers.append(client.post("/v1/completions", json=body))
                except httpx.TimeoutException:
                    answers.append("gave up")

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def _statuses(answers: list[httpx.Response | str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for answer in answers:
        status = answer if isinstance(answer, str) else str(answer.status_code)
        counts[status] = counts.get(status, 0) + 1
    return counts


def attack_urgent_priority(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #11: 4 requests of 1 s at priority -(2^31 - 1), kept going."""
    body = {"prompt": "tokens:20:0.05", "max_tokens": 20, "priority": -(2**31 - 1)}
    answers = _keep_going(url, stop, 4, body)
    served = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
    clamped = sum(a.headers.get("x-priority-clamped") == "0" for a in served)
    return {
        "answers": _statuses(answers),
        "figure": f"{clamped} of {len(served)} answers clamped to priority 0",
        "bound": "every answer clamped",
        "passed": bool(served) and clamped == len(served),
    }


def attack_queue_full(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #13: 12 requests of 4 s kept going, while a client of another tenant
    sends short requests bounded at 2 s one after another (as the ordinary ones do)."""
    body = {"prompt": "tokens:80:0.05", "max_tokens": 80}
    probe: list[int] = []

    def probing() -> None:
        with httpx.Client(base_url=url, timeout=ATTACKER_TIMEOUT_S, headers=TENANTS_HEADERS) as c:
            while not stop.is_set():
                probe.append(c.post("/v1/completions", json=TENANTS_PROMPT).status_code)

    prober = threading.Thread(target=probing)
    prober.start()
    answers = _keep_going(url, stop, 12, body)
    prober.join()
    refused = probe.count(429)
    return {
        "answers": _statuses(answers),
        "figure": f"{refused} of the other tenant's {len(probe)} requests refused",
        "bound": "under 10 %",
        "passed": bool(probe) and refused < 0.1 * len(probe),
        # Its fair share: the attacker's 4 s runs hold one of the two workers.
        "ordinary p50 bound": 3.0,
    }


def attack_tracer_leak(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #9: model b loaded and unloaded again and again; the daemon's threads."""
    daemon = _daemon(url)
    before = daemon.num_threads()
    cycles = 0
    with httpx.Client(base_url=url, timeout=ATTACKER_TIMEOUT_S) as client:
        while not stop.is_set():
            client.post("/models/load", json={"model": "b"}).raise_for_status()
            client.post("/models/unload", json={"model": "b"}).raise_for_status()
            while _status(client, "b") != "unloaded":
                time.sleep(0.05)
            cycles += 1
    grown = daemon.num_threads() - before
    return {
        "loads": cycles,
        "figure": f"threads {before} -> {before + grown} after {cycles} loads",
        "bound": "at most 2 more",
        "passed": grown <= 2,
    }


def attack_hanging_collector(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #10: 8 clients at full speed while the collector never answers."""

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=ATTACKER_TIMEOUT_S) as client:
            while not stop.is_set():
                client.post("/v1/completions", json=TRACING_PROMPT)

    threads = [threading.Thread(target=loop) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tracing = httpx.get(f"{url}/stats", timeout=10).json()["tracing"]
    return {
        "figure": f"{tracing['queued']} records queued, {tracing['dropped']} dropped",
        "bound": f"at most {MAX_QUEUED_RECORDS} queued",
        "passed": tracing["queued"] <= MAX_QUEUED_RECORDS,
        # Eight clients at full speed on model a's one worker: the memory is the figure.
        "ordinary p50 bound": 3.0,
    }


def _status(client: httpx.Client, name: str) -> str:
    cards = client.get("/v1/models").json()["data"]
    status: str = next(card["status"] for card in cards if card["id"] == name)
    return status


def _daemon(url: str) -> psutil.Process:
    """The daemon process listening on ``url``'s port."""
    port = int(url.rsplit(":", 1)[1])
    for connection in psutil.net_connections("tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN":
            return psutil.Process(connection.pid)
    raise LookupError(f"no process listens on {port}")
