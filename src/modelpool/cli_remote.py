"""The commands that talk to a running daemon: ``generate --url``, ``stats`` and ``ps``.

    modelpool generate "Name the capital of France." --url http://127.0.0.1:8000 [--model NAME]
    modelpool stats [--url URL] [--json]      # workers, counters, latency; per model
    modelpool ps [--url URL] [--json]         # the models: backend, state, memory, expiry

They need httpx (the ``server`` extra), imported when a command runs. A daemon with
``[models.NAME]`` tables answers ``/stats`` with a ``models`` table (each model's
registry entry, and its pool's stats while loaded); a daemon of one model answers with
that pool's stats at the top level. Both are read here.

:class:`CliError` (a failure said in one line) is defined here, where the remote
commands raise it, and :mod:`modelpool.cli` raises it too.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_KEY_ENV = "MODELPOOL_API_KEY"


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1 (2 for usage)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def timing_line(timing: Mapping[str, Any]) -> str:
    parts = []
    for key, label in (("startup_s", "startup"), ("latency_s", "latency"), ("queue_s", "queue")):
        if timing.get(key) is not None:
            parts.append(f"{label} {timing[key] * 1000:.1f} ms")
    for key, label in (
        ("attempts", "attempts"),
        ("worker_pid", "worker pid"),
        ("finish_reason", "finish"),
        ("completion_tokens", "tokens"),
    ):
        if timing.get(key) is not None:
            parts.append(f"{label} {timing[key]}")
    return " | ".join(parts)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise CliError("talking to a daemon needs httpx: pip install 'modelpool[server]'") from None
    return httpx


def http_client(args: argparse.Namespace, timeout: float) -> Any:
    httpx = _httpx()
    headers = {}
    key = os.environ.get(args.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout)


def generate_remote(args: argparse.Namespace) -> int:
    httpx = _httpx()
    body: dict[str, Any] = {}
    if args.raw:
        path, body["prompt"] = "/v1/completions", args.prompt
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": args.prompt}]
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.timeout is not None:
        body["timeout"] = args.timeout
    started = time.monotonic()
    with http_client(args, timeout=(args.timeout or 600.0) + 30.0) as client:
        try:
            body["model"] = args.model or _only_model(client, args)
            if args.stream:
                body["stream"] = True
                return _stream_remote(client, path, body, args, started)
            response = client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise CliError(f"{args.url}: {exc}") from None
    data = json_or_error(response, args.api_key_env)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    choice = data["choices"][0]
    print(choice["text"] if args.raw else choice["message"]["content"])
    usage = data.get("usage") or {}
    print(
        timing_line(
            {
                "latency_s": time.monotonic() - started,
                "finish_reason": choice.get("finish_reason"),
                "completion_tokens": usage.get("completion_tokens"),
            }
        )
        + f" | request {response.headers.get('x-request-id', '-')}"
    )
    return 0


def _only_model(client: Any, args: argparse.Namespace) -> str:
    """The one model the daemon serves (``/v1/models``); with several, naming them, the
    caller must choose one with --model."""
    listed = json_or_error(client.get("/v1/models"), args.api_key_env).get("data") or []
    names = [str(card.get("id")) for card in listed if isinstance(card, dict)]
    if len(names) != 1:
        raise CliError(
            f"{args.url} serves {len(names)} models ({', '.join(names)}): "
            "name one with --model NAME",
            status=2,
        )
    return names[0]


def _stream_remote(
    client: Any, path: str, body: dict[str, Any], args: argparse.Namespace, started: float
) -> int:
    events = []
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            json_or_error(response, args.api_key_env)
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise CliError(f"error while streaming: {event['error'].get('message')}")
            events.append(event)
            choice = event["choices"][0]
            text = choice.get("text") if args.raw else choice["delta"].get("content")
            if text and not args.json:
                print(text, end="", flush=True)
    if args.json:
        print(json.dumps(events, indent=2))
    else:
        print()
        print(timing_line({"latency_s": time.monotonic() - started}))
    return 0


def json_or_error(response: Any, key_env: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = response.json()
    except ValueError:
        raise CliError(f"HTTP {response.status_code}: {response.text[:200]}") from None
    if response.status_code != 200:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        message = f"HTTP {response.status_code}: {error.get('message', data)}"
        if response.status_code == 401:
            sent = "the key in" if os.environ.get(key_env) else "no key: it is read from"
            message += (
                f" (this sent {sent} ${key_env}: set it to the daemon's key, "
                "or name another variable with --api-key-env)"
            )
        raise CliError(message)
    return data


# --------------------------------------------------------------------------------------------
# stats


def stats_command(args: argparse.Namespace) -> int:
    httpx = _httpx()
    with http_client(args, timeout=10.0) as client:
        try:
            response = client.get("/stats")
        except httpx.HTTPError as exc:
            raise CliError(f"{args.url}: {exc}") from None
    data = json_or_error(response, args.api_key_env)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    elif isinstance(data.get("models"), dict):
        print_tables(_registry_tables(data))
    else:
        print_stats(data)
    return 0


def _registry_tables(data: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """A daemon of many models: one row per model, then each loaded model's own tables
    (titled with its name)."""
    rows = [
        [
            name,
            str(model.get("state")),
            _resolved_backend(model),
            _megabytes(model.get("rss_bytes")),
            _megabytes(model.get("need_bytes")),
            _fmt(model.get("loads")),
            _fmt(model.get("evictions")),
            _fmt(model.get("load_failures")),
            _fmt(model.get("in_use")),
            _fmt(model.get("waiting")),
        ]
        for name, model in data["models"].items()
    ]
    summary = [
        [
            "memory",
            f"{_megabytes(data.get('rss_bytes'))} (peak {_megabytes(data.get('peak_rss_bytes'))})",
        ],
        ["memory budget", _megabytes(data.get("memory_budget_bytes"))],
        ["swaps", _fmt(data.get("swaps"))],
        ["waiting for a load", _fmt(data.get("waiting"))],
    ]
    tables = [
        ("models", ["", ""], summary),
        (
            "per model",
            [
                "model",
                "state",
                "backend",
                "memory",
                "need",
                "loads",
                "evictions",
                "failures",
                "in use",
                "waiting",
            ],
            rows,
        ),
    ]
    for name, model in data["models"].items():
        pool = model.get("pool")
        if isinstance(pool, dict):
            tables += [
                (f"{name}: {title}", columns, body) for title, columns, body in stats_tables(pool)
            ]
    return tables


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}{unit}"
    return f"{value}{unit}"


def stats_tables(stats: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) for the workers and the counters: shared by rich and plain."""
    latency = stats.get("latency_s", {})
    gpu = stats.get("gpu", {})
    releases = gpu.get("releases", {})
    summary = [
        ["state", str(stats.get("state"))],
        ["queue depth", _fmt(stats.get("queue_depth"))],
        ["uptime", _fmt(stats.get("uptime_s"), " s")],
        ["context length", _fmt(stats.get("max_model_len"), " tokens")],
        [
            "latency p50/p95/p99",
            " / ".join(
                "-" if latency.get(p) is None else f"{latency[p] * 1000:.1f} ms"
                for p in ("p50", "p95", "p99")
            ),
        ],
        ["gpu", "available" if gpu.get("available") else f"unavailable ({gpu.get('reason')})"],
        [
            "memory releases ok/failed",
            f"{releases.get('ok', 0)} / {releases.get('failed', 0)}"
            + ("" if releases.get("last_ms") is None else f" (last {releases['last_ms']:.0f} ms)"),
        ],
    ]
    if stats.get("kill_reasons"):
        summary.append(
            [
                "kills by reason",
                ", ".join(
                    f"{reason} {count}" for reason, count in sorted(stats["kill_reasons"].items())
                ),
            ]
        )
    workers = [
        [
            _fmt(w.get("id")),
            _fmt(w.get("pid")),
            str(w.get("state")),
            str(w.get("role", "-")),
            str(w.get("device")),
            _fmt(w.get("requests")),
            _fmt(w.get("uptime_s"), " s"),
            _fmt(w.get("rss_mb"), " MB"),
            _fmt(w.get("gpu_mb"), " MB"),
        ]
        for w in stats.get("workers", [])
    ]
    counters = [[name, str(value)] for name, value in stats.get("counters", {}).items()]
    return [
        ("pool", ["", ""], summary),
        (
            "workers",
            ["id", "pid", "state", "role", "device", "requests", "uptime", "rss", "gpu"],
            workers,
        ),
        ("counters", ["counter", "value"], counters),
    ]


def print_stats(stats: Mapping[str, Any]) -> None:
    print_tables(stats_tables(stats))


def print_tables(tables: Sequence[tuple[str, list[str], list[list[str]]]]) -> None:
    """Rich tables where rich is installed, else plain aligned text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, columns, rows in tables:
            print(_plain_table(title, columns, rows))
        return
    console = Console()
    for title, columns, rows in tables:
        table = Table(title=title, title_justify="left", show_header=any(columns))
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)


def _plain_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    shown = [list(columns)] if any(columns) else []
    shown += [list(row) for row in rows]
    widths = [max((len(row[i]) for row in shown), default=0) for i in range(len(columns))]
    lines = [title]
    lines += [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in shown
    ]
    return "\n".join(line.rstrip() for line in lines)


# --------------------------------------------------------------------------------------------
# ps

PS_COLUMNS = ["NAME", "BACKEND", "STATE", "MEMORY", "WORKERS", "IDLE", "UNLOADS"]


def ps_command(args: argparse.Namespace) -> int:
    """``modelpool ps``: one line per model, as ``ollama ps`` shows (plain columns, so that
    a script can read them; --json: the same rows as objects)."""
    httpx = _httpx()
    with http_client(args, timeout=10.0) as client:
        try:
            data = json_or_error(client.get("/stats"), args.api_key_env)
            if isinstance(data.get("models"), dict):
                models: Mapping[str, Any] = data["models"]
            else:
                # One model: the daemon's pool, named as /v1/models names it.
                listed = json_or_error(client.get("/v1/models"), args.api_key_env)
                name = str((listed.get("data") or [{}])[0].get("id", "-"))
                models = {name: _single_pool_entry(data)}
        except httpx.HTTPError as exc:
            raise CliError(f"{args.url}: {exc}") from None
    rows = [ps_row(name, model) for name, model in models.items()]
    if args.json:
        keys = [column.lower() for column in PS_COLUMNS]
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=2))
    else:
        widths = [max(len(row[i]) for row in [PS_COLUMNS, *rows]) for i in range(len(PS_COLUMNS))]
        for row in [PS_COLUMNS, *rows]:
            print(
                "  ".join(
                    cell.ljust(width) for cell, width in zip(row, widths, strict=True)
                ).rstrip()
            )
    return 0


def _single_pool_entry(pool: Mapping[str, Any]) -> dict[str, Any]:
    """A one-model daemon's pool stats in the shape of a registry's model entry: loaded
    while it serves, never unloaded."""
    rss = [w.get("rss_mb") for w in pool.get("workers", []) if w.get("rss_mb") is not None]
    return {
        "state": "loaded" if pool.get("state") == "ready" else pool.get("state"),
        "backend": pool.get("backend"),
        "rss_bytes": int(sum(rss) * 2**20) if rss else None,
        "pinned": True,
        "pool": pool,
    }


def ps_row(name: str, model: Mapping[str, Any]) -> list[str]:
    """NAME, BACKEND (as resolved), STATE, MEMORY, WORKERS, IDLE, UNLOADS (when an idle
    model unloads: "in 4m 10s", "5m after use", "never")."""
    pool = model.get("pool") if isinstance(model.get("pool"), dict) else None
    state = str(model.get("state"))
    workers = "-"
    if pool is not None:
        serving = [w for w in pool.get("workers", []) if w.get("role", "serving") != "spare"]
        ready = [w for w in serving if w.get("pid") is not None]
        workers = f"{len(ready)}/{len(serving)}"
    idle = model.get("idle_s")
    return [
        name,
        _resolved_backend(model),
        state if not model.get("reason") else f"{state} ({model['reason']})"[:60],
        _megabytes(model.get("rss_bytes")),
        workers,
        "-" if idle is None else _duration(float(idle)),
        _expiry(model) if state == "loaded" else "-",
    ]


def _expiry(model: Mapping[str, Any]) -> str:
    limit = model.get("keep_alive_s")
    if model.get("pinned") or limit is None:
        return "never"
    idle = model.get("idle_s")
    if idle is None:  # in use, or waited for: the idle clock starts when it is not
        return f"{_duration(float(limit))} after use"
    return f"in {_duration(max(0.0, float(limit) - float(idle)))}"


def _resolved_backend(model: Mapping[str, Any]) -> str:
    """The backend the model runs on: its pool's once loaded (``auto`` resolved), else
    the one its table was resolved to at start."""
    pool = model.get("pool")
    if isinstance(pool, dict) and pool.get("backend"):
        return str(pool["backend"])
    return str(model.get("backend") or "-")


def _megabytes(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MB"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs}s" if secs else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes}m" if minutes else f"{hours}h"
