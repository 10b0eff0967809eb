"""The commands that talk to a running daemon: ``generate --url``, ``stats`` and ``ps``.

    modelpool generate "Name the capital of France." --url http://127.0.0.1:8000 [--model NAME]
    modelpool stats [--url URL] [--json]      # workers, counters, latency; per model
    modelpool ps [--url URL] [--json]         # the models: backend, state, memory, expiry

They need httpx (the ``server`` extra), imported when a command runs. A daemon with
``[models.NAME]`` tables answers ``/stats`` with a ``models`` table (each model's
registry entry, and its pool's stats while loaded); a daemon of one model answers with
that pool's stats at the top level. Both are read here.

The tables they print are :mod:`modelpool.cli.tables`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from modelpool.cli.errors import CliError
from modelpool.cli.tables import (
    print_ps_rows,
    print_stats,
    print_tables,
    ps_row,
    registry_tables,
    single_pool_entry,
    timing_line,
)

DEFAULT_URL = "http://127.0.0.1:8000"

DEFAULT_KEY_ENV = "MODELPOOL_API_KEY"


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
        print_tables(registry_tables(data))
    else:
        print_stats(data)
    return 0


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
                models = {name: single_pool_entry(data)}
        except httpx.HTTPError as exc:
            raise CliError(f"{args.url}: {exc}") from None
    print_ps_rows([ps_row(name, model) for name, model in models.items()], as_json=args.json)
    return 0
