"""The third review's attacks between tenants (issue 58), for ``scripts/abuse``.

They run on a daemon of the testing backend with ``[models]`` tables and a keys file:
alice (the victim), bob (the attacker, his table's ``max_request_tokens`` 1,000), the
ordinary clients' tenant, and an operator (``admin = true``). A model's path and a load
error's text are secrets a tenant must not see. Each attack returns its figure, its
bound and whether it held (``abuse.run`` prints them).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ALICE_KEY = "sk-abuse-alice-0123456789"
BOB_KEY = "sk-abuse-bob-0123456789ab"
ORDINARY_KEY = "sk-abuse-ordinary-0123456789"
OPERATOR_KEY = "sk-abuse-operator-0123456789"
BOB_BUDGET = 1000
SECRET_PATH = "/srv/models/customer-globex-secret"
SECRET_ERROR = "weights.bin (token hf_XYZ)"
KEYS = f"""\
[tenants.alice]
key = "{ALICE_KEY}"
[tenants.bob]
key = "{BOB_KEY}"
max_request_tokens = {BOB_BUDGET}
[tenants.ordinary]
key = "{ORDINARY_KEY}"
[tenants.ops]
key = "{OPERATOR_KEY}"
admin = true
"""
CONFIG = """\
backend = "testing"
workers = 2
devices = ["cpu"]
deadline_s = 30.0

[generation_defaults]
max_new_tokens = 64

[server]
host = "127.0.0.1"
port = {port}
keys_file = "{keys}"
drain_timeout_s = 5.0
load_backoff_s = 30.0

[models.chat]
model = "{secret_path}"
preload = true
pin = true

[models.emb]
model = "emb-weights"
preload = true
backend_options = {{ task = "embed" }}

[models.broken]
model = "broken-weights"
workers = 1
backend_options = {{ fail_load = "{secret_error}" }}
"""
ORDINARY_PROMPT = {"model": "chat", "prompt": "tokens:5:0.01"}
ORDINARY_HEADERS = {"Authorization": f"Bearer {ORDINARY_KEY}"}
STORE_FLOOD = 1030  # the review's: past the store's default 1,024 entries
# Bob's requests of 50 times his budget, on the routes the review found unchecked.
OVER = "x" * (50 * BOB_BUDGET)
UNCHECKED_ROUTES: dict[str, dict[str, Any]] = {
    "/tokenize": {"model": "chat", "prompt": OVER},
    "/detokenize": {"model": "chat", "tokens": [1] * (50 * BOB_BUDGET)},
    "/v1/messages/count_tokens": {
        "model": "chat",
        "messages": [{"role": "user", "content": OVER}],
    },
    "/v1/embeddings": {"model": "emb", "input": OVER},
    "/v1/rerank": {"model": "emb", "query": "q", "documents": [OVER]},
    "/score": {"model": "emb", "text_1": "q", "text_2": [OVER]},
}


def config(port: int, workdir: Path) -> str:
    keys = workdir / "keys.toml"
    keys.write_text(KEYS)
    return CONFIG.format(port=port, keys=keys, secret_path=SECRET_PATH, secret_error=SECRET_ERROR)


def _client(url: str, key: str | None, timeout: float = 30) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=timeout)


def _store(client: httpx.Client, text: str, **extra: Any) -> str:
    body = {"model": "chat", "input": f"echo:{text}", "max_output_tokens": 4, **extra}
    response = client.post("/v1/responses", json=body)
    response.raise_for_status()
    response_id: str = response.json()["id"]
    return response_id


def attack_store_cross(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #5: bob reads, continues and deletes alice's stored response by its id."""
    with _client(url, ALICE_KEY) as alice, _client(url, BOB_KEY) as bob:
        secret = _store(
            alice, "my password is hunter2", instructions="SYSTEM: the vault code is 7421"
        )
        continued = {"model": "chat", "input": "echo:go on", "previous_response_id": secret}
        got = {
            "GET": bob.get(f"/v1/responses/{secret}").status_code,
            "previous_response_id": bob.post("/v1/responses", json=continued).status_code,
            "DELETE": bob.delete(f"/v1/responses/{secret}").status_code,
        }
        kept = alice.get(f"/v1/responses/{secret}").status_code
        stop.wait()
    return {
        "bob got": got,
        "figure": f"bob's GET, continuation, DELETE: {sorted(set(got.values()))}; "
        f"alice's GET after: {kept}",
        "bound": "bob 404 (as an unknown id) on each; alice's response kept",
        "passed": set(got.values()) == {404} and kept == 200,
    }


def attack_store_evict(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #6: bob stores 1,030 tiny responses, 16 at a time, to evict alice's."""
    with _client(url, ALICE_KEY) as alice, _client(url, BOB_KEY) as bob:
        mine = _store(alice, "my conversation")
        started = time.monotonic()
        with ThreadPoolExecutor(16) as flood:
            list(flood.map(lambda index: _store(bob, f"{index}"), range(STORE_FLOOD)))
        flood_s = time.monotonic() - started
        got = alice.get(f"/v1/responses/{mine}").status_code
        continued = {"model": "chat", "input": "echo:next", "previous_response_id": mine}
        next_turn = alice.post("/v1/responses", json=continued).status_code
        stop.wait()
    return {
        "figure": f"{STORE_FLOOD} of bob's in {flood_s:.1f} s; alice's GET {got}, "
        f"previous_response_id {next_turn}",
        "bound": "alice's response kept (200, 200)",
        "passed": got == 200 and next_turn == 200,
    }


def attack_route_budget(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #12: bob's 50,000-unit requests past his own 1,000 on six routes."""
    got: dict[str, str] = {}
    with _client(url, BOB_KEY, timeout=60) as bob:
        for path, body in UNCHECKED_ROUTES.items():
            response = bob.post(path, json=body)
            code = response.json().get("error", {}).get("code") if response.is_error else None
            got[path] = f"{response.status_code} {code or ''}".strip()
        stop.wait()
    refused = sum(answer == "400 request_too_expensive" for answer in got.values())
    return {
        "bob got": got,
        "figure": f"{refused} of {len(got)} routes 400 request_too_expensive",
        "bound": f"all {len(got)}",
        "passed": refused == len(got),
    }


def attack_operator_only(url: str, stop: threading.Event) -> dict[str, Any]:
    """Review 3, #2 (its routes) and #16: bob steers a pinned model; what others see."""
    with _client(url, BOB_KEY) as bob, _client(url, None) as anonymous:
        unload = bob.post("/models/unload", json={"model": "chat"}).status_code
        load = bob.post("/models/load", json={"model": "emb"}).status_code
        bob.post("/v1/completions", json={"model": "broken", "prompt": "echo:x"})
        readyz = anonymous.get("/readyz").json()
        seen = bob.get("/stats").text + bob.get("/v1/models").text
        stop.wait()
    leaked = [secret for secret in (SECRET_PATH, SECRET_ERROR) if secret in seen]
    return {
        "figure": f"bob's unload of a pinned model {unload}, load {load}; unauthenticated "
        f"/readyz lists models: {'models' in readyz}; secrets in bob's /stats and "
        f"/v1/models: {len(leaked)}",
        "bound": "403, 403, no model list, 0 secrets",
        "passed": unload == 403 and load == 403 and "models" not in readyz and not leaked,
    }


ATTACKS = {
    "store-cross": attack_store_cross,
    "store-evict": attack_store_evict,
    "route-budget": attack_route_budget,
    "operator-only": attack_operator_only,
}
