"""What the commands print: a run's timing line, a daemon's ``/stats`` as tables (rich
where it is installed, else plain aligned text) and ``ps``'s rows, one per model."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


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


def registry_tables(data: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
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


PS_COLUMNS = ["NAME", "BACKEND", "STATE", "MEMORY", "WORKERS", "IDLE", "UNLOADS"]


def print_ps_rows(rows: Sequence[list[str]], *, as_json: bool) -> None:
    """``ps``'s rows as plain columns, so that a script can read them (``as_json``: the
    same rows as objects)."""
    if as_json:
        keys = [column.lower() for column in PS_COLUMNS]
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=2))
        return
    widths = [max(len(row[i]) for row in [PS_COLUMNS, *rows]) for i in range(len(PS_COLUMNS))]
    for row in [PS_COLUMNS, *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def single_pool_entry(pool: Mapping[str, Any]) -> dict[str, Any]:
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
