"""The prefix cache partitioned by tenant and ``cache_salt`` through the daemon's routes
(issue 40, review #4): the app in process over a real hf pool on the tiny model.

The docs, Tenants: each tenant's prefix cache is its own, and within it each
``cache_salt``'s; without keys and without a salt, requests share the default partition.
Placement by prefix fingerprints follows the same partitions (``prefixes``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from helpers import assert_oracle_blind, assert_oracle_leaks, cache_oracle
from modelpool import ModelPool, PoolConfig
from modelpool.server import create_app
from modelpool.shared.config import ServerConfig
from modelpool.shared.prefixes import partition_of, prompt_fingerprints
from modelpool.shared.protocol import Prompt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")
ALICE = "sk-alice-0123456789"
BOB = "sk-bob-0123456789ab"


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path) -> Iterator[ModelPool]:
    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        workers=1,
        max_batch_size=4,
        devices=["cpu"],
        deadline_s=120.0,
        backend_options={"dtype": "float32", "torch_threads": 1, "prefix_cache_bytes": "64MiB"},
    )
    with ModelPool(config) as started:
        yield started


Oracle = Callable[[dict[str, Any], dict[str, Any]], dict[str, int]]


def chat_oracle(client: TestClient) -> Oracle:
    """The review's attack through /v1/chat/completions: victim and attacker are each a
    key (``key``, or none) and a ``cache_salt`` (``salt``, or none)."""

    def cached_tokens(prompt: Prompt, params: dict[str, Any]) -> int:
        key = params.get("key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"messages": prompt, "max_tokens": 2, "temperature": 0}
        if "salt" in params:
            body["cache_salt"] = params["salt"]
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        count: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return count

    def run(victim: dict[str, Any], attacker: dict[str, Any]) -> dict[str, int]:
        return cache_oracle(cached_tokens, victim, attacker)

    return run


def test_another_tenant_or_salt_cannot_read_the_cache_through_cached_tokens(
    pool: ModelPool, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[tenants.alice]\nkey = "{ALICE}"\n[tenants.bob]\nkey = "{BOB}"\n')
    keyed = create_app(pool, ServerConfig(keys_file=str(keys)), "tiny")
    with TestClient(keyed, base_url="http://127.0.0.1") as client:
        oracle = chat_oracle(client)
        # Each attacker's partition is new to the cache: its first guess finds nothing.
        assert_oracle_blind(oracle({"key": ALICE}, {"key": BOB}))
        assert_oracle_blind(oracle({"key": ALICE}, {"key": ALICE, "salt": "x"}))
        # A tenant's own requests still share their prefixes.
        assert_oracle_leaks(oracle({"key": ALICE}, {"key": ALICE}))
    anonymous = create_app(pool, ServerConfig(api_key_env=None), "tiny")
    with TestClient(anonymous, base_url="http://127.0.0.1") as client:
        oracle = chat_oracle(client)
        assert_oracle_blind(oracle({}, {"salt": "b"}))
        # Without keys or salts, everyone's: the documented shared default partition.
        assert_oracle_leaks(oracle({"salt": "s"}, {"salt": "s"}))


def test_a_salt_is_a_bounded_string(pool: ModelPool) -> None:
    app = create_app(pool, ServerConfig(api_key_env=None), "tiny")
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for salt in ("", 7, "x" * 257):
            body = {"messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "cache_salt"


def test_placement_fingerprints_follow_the_partition() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    shared = prompt_fingerprints(messages)
    salted = prompt_fingerprints(messages, partition_of({"cache_salt": "a"}))
    other = prompt_fingerprints(messages, partition_of({"cache_salt": "b"}))
    assert partition_of({}) == 0 and shared == prompt_fingerprints(messages, 0)
    assert not set(shared) & set(salted) and not set(salted) & set(other)
