"""The daemon's event loop under an image flood (issue 55): ten clients sending large
images (8-15 MB PNGs as data URLs) while a probe measures ``/healthz`` and other clients
send short text requests, against the same probe and text clients without the flood.

One daemon on 127.0.0.1 with two models of the testing backend: ``eyes``
(``vision = true``: its worker decodes every image, as a vision model's would) takes the
flood, ``text`` the text clients, so that what the flood can slow down for them is the
daemon's own work (reading 20 MB bodies, parsing them, decoding their base64), not a
shared worker. Each client is its own address (``X-Forwarded-For``, believed from
127.0.0.1), as separate machines would be: one address would share one check thread.
The flood runs in a process of its own (its clients on one event loop, each body encoded
once before the phase), so that this process's probe is not slowed by its own clients.
Prints, side by side, the probe's worst and p99 latency, the text requests' p50 and p90,
the flood's image rate and where the machine's CPU went (cores used, on average, by the
daemon's process, its workers, the flood's clients and this process); targets:
``/healthz`` worst < 0.2 s, text p50 < 1.5x without the flood::

    python -m benchmarks.images_flood                    # 20 s per phase
    python -m benchmarks.images_flood --seconds 40 --flood-clients 10
    python -m benchmarks.images_flood --images-per-s 5   # two daemons at the same load

Unbounded, the flood is a closed loop: a daemon that spends less on each image is sent
more of them, and its workers decode more. ``--images-per-s`` holds the load still.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# Sides of the flood's PNGs (random pixels: a PNG about as large as its pixels, 3 bytes
# each): 8.6, 11.5 and 14.5 MB.
SIDES = ((1700, 1700), (1960, 1960), (2200, 2200))
PROBE_INTERVAL_S = 0.02
TEXT_CLIENTS = 2


def _image_body(side: tuple[int, int]) -> bytes:
    sys.path.insert(0, str(ROOT / "tests"))
    from image_files import png  # type: ignore[import-not-found]

    data = png(*side, noise=True)
    url = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    body = {
        "model": "eyes",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "echo:seen"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    return json.dumps(body).encode()


def _flood(
    url: str,
    bodies: list[bytes],
    clients: int,
    rate: float | None,
    stop_at: float,
    counts: Any,
    cpu: Any,
) -> None:
    """The flooding clients (one process, one event loop, each client its own connection
    and address): each sends its image, again and again, until ``stop_at``; with
    ``rate``, the clients together start at most ``rate`` requests a second (each its
    share, on a schedule). The bodies were encoded once, before the phase: the clients
    only send bytes, so that the flood's own CPU is the kernel's copies, not ten
    interpreters re-encoding JSON."""
    import asyncio

    async def client(number: int) -> None:
        body = bodies[number % len(bodies)]
        headers = {"Content-Type": "application/json", "X-Forwarded-For": f"10.0.1.{number + 1}"}
        interval = clients / rate if rate else 0.0
        next_at = time.time() + interval * number / clients
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as session:
            while time.time() < stop_at:
                if interval:
                    await asyncio.sleep(max(0.0, next_at - time.time()))
                    next_at += interval
                    if time.time() >= stop_at:
                        break
                answer = await session.post("/v1/chat/completions", content=body, headers=headers)
                if answer.status_code != 200:
                    print(
                        f"flood {number}: {answer.status_code} {answer.text[:300]}", file=sys.stderr
                    )
                with counts.get_lock():
                    counts.value += 1 if answer.status_code == 200 else 1_000_000

    async def flood() -> None:
        await asyncio.gather(*(client(number) for number in range(clients)))

    asyncio.run(flood())
    times = os.times()
    cpu.value = times.user + times.system


def _probe(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz").raise_for_status()
            latencies.append(time.perf_counter() - started)
            stop.wait(PROBE_INTERVAL_S)


def _text(url: str, address: str, stop: threading.Event, latencies: list[float]) -> None:
    body = {"model": "text", "max_tokens": 8, "messages": [{"role": "user", "content": "echo:hi"}]}
    headers = {"X-Forwarded-For": address}
    with httpx.Client(base_url=url, timeout=60.0) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()
            latencies.append(time.perf_counter() - started)


def _cpu_seconds(daemon_pid: int) -> dict[str, float]:
    """CPU seconds (user and system) so far of the daemon's own process, of its workers
    (its descendants, together) and of this process (the probe and the text clients)."""
    import psutil

    def used(process: psutil.Process) -> float:
        try:
            times = process.cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)

    daemon = psutil.Process(daemon_pid)
    return {
        "daemon": used(daemon),
        "workers": sum(used(child) for child in daemon.children(recursive=True)),
        "probe_and_text_clients": used(psutil.Process()),
    }


def phase(
    url: str,
    seconds: float,
    bodies: list[bytes],
    flood_clients: int,
    daemon_pid: int,
    rate: float | None = None,
) -> dict[str, Any]:
    """The probe and the text clients for ``seconds``, with ``flood_clients`` flooding."""
    stop = threading.Event()
    probe: list[float] = []
    text: list[float] = []
    counts = multiprocessing.Value("i", 0)
    flood_cpu = multiprocessing.Value("d", 0.0)
    stop_at = time.time() + seconds
    floods = [
        multiprocessing.Process(
            target=_flood, args=(url, bodies, flood_clients, rate, stop_at, counts, flood_cpu)
        )
        for _ in range(1 if flood_clients else 0)
    ]
    cpu_before = _cpu_seconds(daemon_pid)
    for process in floods:
        process.start()
    threads = [threading.Thread(target=_probe, args=(url, stop, probe))]
    threads += [
        threading.Thread(target=_text, args=(url, f"10.0.2.{n + 1}", stop, text))
        for n in range(TEXT_CLIENTS)
    ]
    for thread in threads:
        thread.start()
    time.sleep(seconds)  # the phase's length: the clients run meanwhile
    stop.set()
    for thread in threads:
        thread.join()
    for process in floods:
        process.join()
    cpu_after = _cpu_seconds(daemon_pid)
    cpu = {name: (cpu_after[name] - cpu_before[name]) / seconds for name in cpu_before}
    cpu["flood_clients"] = flood_cpu.value / seconds
    flooded = counts.value
    assert flooded < 1_000_000, "a flood request failed"
    probe.sort()
    text.sort()
    return {
        "healthz_worst": probe[-1],
        "healthz_p99": probe[int(len(probe) * 0.99)],
        "text_p50": statistics.median(text),
        "text_p90": text[int(len(text) * 0.9)],
        "text_runs": len(text),
        "images_per_s": flooded / seconds,
        **{f"cpu_{name}": share for name, share in cpu.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--flood-clients", type=int, default=10)
    parser.add_argument("--eyes-workers", type=int, default=2)
    parser.add_argument(
        "--images-per-s",
        type=float,
        help="the flood's rate cap (default: none, each client sends as fast as answered); "
        "the same cap compares two daemons at the same load",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    sys.path.insert(0, str(ROOT / "tests"))
    from e2e_support import registry_config, start_daemon  # type: ignore[import-not-found]

    models = {
        "eyes": {
            "model": "eyes",
            "preload": True,
            "workers": args.eyes_workers,
            "backend_options": {"vision": True},
            "deadline_s": 120.0,
        },
        "text": {"model": "text", "preload": True, "workers": 1},
    }
    server = {
        "max_body_bytes": 24_000_000,
        "max_pending_body_bytes": 400_000_000,
        "client_max_pending_body_bytes": 400_000_000,
        "forwarded_allow_ips": ["127.0.0.1"],
        "max_request_timeout_s": 120.0,
    }
    config = registry_config(models, workers=1, server=server)
    bodies = [_image_body(side) for side in SIDES]
    sizes = ", ".join(f"{len(body) / 1e6:.1f}" for body in bodies)
    with tempfile.TemporaryDirectory(prefix="modelpool-images-flood-") as scratch:
        daemon = start_daemon(Path(scratch), config, ready_timeout=600.0)
        try:
            pid = daemon.process.pid
            phase(daemon.url, 2.0, bodies, 1, pid)  # warm-up: every model loaded, every path taken
            quiet = phase(daemon.url, args.seconds, bodies, 0, pid)
            flooded = phase(
                daemon.url, args.seconds, bodies, args.flood_clients, pid, args.images_per_s
            )
        finally:
            daemon.stop()
    capped = f" (at most {args.images_per_s:g} images/s)" if args.images_per_s else ""
    print(
        f"{args.seconds:g} s per phase; {args.flood_clients} flood clients{capped}, "
        f"bodies of {sizes} MB "
        f"(PNG data URLs), 'eyes' on {args.eyes_workers} testing worker(s) with vision; "
        f"{TEXT_CLIENTS} text clients on 'text'; /healthz every {PROBE_INTERVAL_S * 1000:g} ms"
    )
    print(f"{'':<22}{'no flood':>12}{'flood':>12}{'ratio':>10}")
    for key, unit in (
        ("healthz_worst", "s"),
        ("healthz_p99", "s"),
        ("text_p50", "s"),
        ("text_p90", "s"),
        ("text_runs", ""),
        ("images_per_s", ""),
        ("cpu_daemon", "cores"),
        ("cpu_workers", "cores"),
        ("cpu_flood_clients", "cores"),
        ("cpu_probe_and_text_clients", "cores"),
    ):
        before, during = quiet[key], flooded[key]
        ratio = f"{during / before:>9.2f}x" if before else f"{'':>10}"
        print(
            f"{key + (' (' + unit + ')' if unit else ''):<22}{before:>12.4g}{during:>12.4g}{ratio}"
        )
    worst_ok = flooded["healthz_worst"] < 0.2
    p50_ok = flooded["text_p50"] < 1.5 * quiet["text_p50"]
    print(
        f"targets: /healthz worst < 0.2 s: {'met' if worst_ok else 'NOT met'}; "
        f"text p50 < 1.5x: {'met' if p50_ok else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
