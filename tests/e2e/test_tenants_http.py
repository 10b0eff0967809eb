"""Tenants on a daemon with ``[models]`` tables and a ``keys_file`` (issue 58, the third
security review): ordinary tenants alice and bob, and an operator (``admin = true``).

A stored response is its tenant's (another's GET, continuation and DELETE get the 404
of an unknown id); one tenant cannot evict another's stored responses; every limit of a
tenant's table holds on every route that costs a request, tested from one table of
routes that must list every such route of the app; only an operator loads and unloads
models or sees ``/stats`` in full; an unauthenticated ``/readyz`` names no model.

The docs, Security and limits: Tenants.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import Daemon, keyed_daemon, registry_config, wait_for

from helpers import make_config, slack
from modelpool.server import create_app
from modelpool.shared.config import ModelSpec, ServerConfig
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

pytestmark = pytest.mark.slow

KEYS = {
    "ops": "sk-ops-0123456789abcdef",
    "alice": "sk-alice-0123456789abcdef",
    "bob": "sk-bob-0123456789abcdef",
}
BOB_BUDGET = 1000
STORE_ENTRIES = 8
SECRET_PATH = "/srv/models/customer-globex-secret"
SECRET_ERROR = "weights.bin (token hf_XYZ)"
# Two workers each: bob's held run takes one, alice's request the other.
MODELS: dict[str, dict[str, Any]] = {
    "chat": {"model": SECRET_PATH, "preload": True, "workers": 2},
    "emb": {
        "model": "emb-weights",
        "preload": True,
        "workers": 2,
        "backend_options": {"task": "embed"},
    },
    "broken": {"model": "broken-weights", "backend_options": {"fail_load": SECRET_ERROR}},
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    workdir = tmp_path_factory.mktemp("tenants")
    keys = workdir / "keys.toml"
    keys.write_text(
        f'[tenants.ops]\nkey = "{KEYS["ops"]}"\nadmin = true\n'
        f'[tenants.alice]\nkey = "{KEYS["alice"]}"\n'
        f'[tenants.bob]\nkey = "{KEYS["bob"]}"\n'
        f"max_request_tokens = {BOB_BUDGET}\nclient_max_running = 1\nclient_max_queued = 0\n"
    )
    server = {
        "keys_file": str(keys),
        "responses_store_entries": STORE_ENTRIES,
        "load_backoff_s": 30.0,
    }
    config = registry_config(MODELS, workers=1, server=server)
    # The api_key_env key beside a keys file is the ordinary tenant "default".
    yield from keyed_daemon(workdir, config, "sk-default-0123456789abcdef")


def _as(daemon: Daemon, tenant: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return httpx.Client(base_url=daemon.url, timeout=slack(30), headers=headers)


@pytest.fixture()
def alice(daemon: Daemon) -> Iterator[httpx.Client]:
    with _as(daemon, "alice") as client:
        yield client


@pytest.fixture()
def bob(daemon: Daemon) -> Iterator[httpx.Client]:
    with _as(daemon, "bob") as client:
        yield client


@pytest.fixture()
def ops(daemon: Daemon) -> Iterator[httpx.Client]:
    with _as(daemon, "ops") as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    if isinstance(body["error"], str):
        # Ollama's shape (under /api/): the message as "error", the daemon's code beside it.
        return {**body, "message": body["error"]}
    error: dict[str, Any] = body["error"]
    return error


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


# ---- stored responses -----------------------------------------------------------------------


def _store(client: httpx.Client, text: str, **extra: Any) -> str:
    body = {"model": "chat", "input": f"echo:{text}", **extra}
    answer = _ok(client.post("/v1/responses", json=body))
    response_id: str = answer["id"]
    return response_id


def test_a_stored_response_is_its_tenants_alone(alice: httpx.Client, bob: httpx.Client) -> None:
    secret = _store(
        alice,
        "my password is hunter2",
        instructions="SYSTEM: the vault code is 7421",
        metadata={"customer": "acme-corp"},
    )
    unknown = "resp_" + "0" * 32

    def same(response: httpx.Response, unknown_response: httpx.Response) -> None:
        # Word for word the answer for an id never stored: bob learns nothing of alice's.
        assert response.status_code == unknown_response.status_code == 404, response.text
        assert response.text.replace(secret, unknown) == unknown_response.text

    same(bob.get(f"/v1/responses/{secret}"), bob.get(f"/v1/responses/{unknown}"))
    continued = {"model": "chat", "input": "echo:go on"}
    same(
        bob.post("/v1/responses", json={**continued, "previous_response_id": secret}),
        bob.post("/v1/responses", json={**continued, "previous_response_id": unknown}),
    )
    same(bob.delete(f"/v1/responses/{secret}"), bob.delete(f"/v1/responses/{unknown}"))
    # Alice still has all of it.
    kept = _ok(alice.get(f"/v1/responses/{secret}"))
    assert kept["instructions"] == "SYSTEM: the vault code is 7421"
    also = {**continued, "previous_response_id": secret, "store": False}
    _ok(alice.post("/v1/responses", json=also))
    assert _ok(alice.delete(f"/v1/responses/{secret}"))["deleted"] is True
    assert alice.get(f"/v1/responses/{secret}").status_code == 404


def test_one_tenant_filling_the_store_evicts_only_its_own(
    alice: httpx.Client, bob: httpx.Client, ops: httpx.Client
) -> None:
    mine = [_store(alice, f"alice {index}") for index in range(2)]
    flood = [_store(bob, f"bob {index}") for index in range(3 * STORE_ENTRIES)]
    for response_id in mine:
        _ok(alice.get(f"/v1/responses/{response_id}"))
    kept = [bob.get(f"/v1/responses/{response_id}").status_code for response_id in flood]
    assert kept == [404] * (len(flood) - STORE_ENTRIES + 2) + [200] * (STORE_ENTRIES - 2)
    assert _ok(ops.get("/stats"))["responses_store"]["entries"] == STORE_ENTRIES
    for response_id in mine:
        _ok(alice.delete(f"/v1/responses/{response_id}"))


# ---- every limit on every route -------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    path: str
    model: str

    def body(self, size: int) -> dict[str, Any]:
        """A body of about ``size`` units of this route's budget (characters or ids)."""
        text = "x" * size
        chat = {"model": self.model, "messages": [{"role": "user", "content": f"echo:{text}"}]}
        bodies: dict[str, dict[str, Any]] = {
            "/v1/completions": {"model": self.model, "prompt": f"echo:{text}", "max_tokens": 1},
            "/v1/chat/completions": {**chat, "max_tokens": 1},
            "/v1/responses": {
                "model": self.model,
                "input": f"echo:{text}",
                "max_output_tokens": 1,
                "store": False,
            },
            "/v1/messages": {**chat, "max_tokens": 1},
            "/v1/messages/count_tokens": chat,
            "/tokenize": {"model": self.model, "prompt": text},
            "/detokenize": {"model": self.model, "tokens": [1] * size},
            "/v1/embeddings": {"model": self.model, "input": text},
            "/embed": {"model": self.model, "inputs": text},
            "/v1/rerank": {"model": self.model, "query": "q", "documents": [text]},
            "/rerank": {"model": self.model, "query": "q", "texts": [text]},
            "/v2/rerank": {"model": self.model, "query": "q", "documents": [text]},
            "/score": {"model": self.model, "text_1": "q", "text_2": [text]},
            "/v1/score": {"model": self.model, "text_1": "q", "text_2": [text]},
            "/api/chat": {**chat, "stream": False, "options": {"num_predict": 1}},
            "/api/generate": {
                "model": self.model,
                "prompt": f"echo:{text}",
                "stream": False,
                "options": {"num_predict": 1},
            },
            "/api/embed": {"model": self.model, "input": text},
            "/api/embeddings": {"model": self.model, "prompt": text},
        }
        return bodies[self.path]


# Every route that costs a request (``test_the_route_table_lists_every_costed_route``
# fails when a route is added without a row here).
ROUTES = [
    Route("/v1/completions", "chat"),
    Route("/v1/chat/completions", "chat"),
    Route("/v1/responses", "chat"),
    Route("/v1/messages", "chat"),
    Route("/v1/messages/count_tokens", "chat"),
    Route("/tokenize", "chat"),
    Route("/detokenize", "chat"),
    Route("/v1/embeddings", "emb"),
    Route("/embed", "emb"),
    Route("/v1/rerank", "emb"),
    Route("/rerank", "emb"),
    Route("/v2/rerank", "emb"),
    Route("/score", "emb"),
    Route("/v1/score", "emb"),
    Route("/api/chat", "chat"),
    Route("/api/generate", "chat"),
    Route("/api/embed", "emb"),
    Route("/api/embeddings", "emb"),
]
# The POST routes that cost no model's work: operators' (see test_only_an_operator_...),
# Ollama's description of a model, and its model management (refused: 501).
ADMIN_ROUTES = {
    "/models/load",
    "/models/unload",
    "/models/pin",
    "/models/unpin",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
}
FREE_ROUTES = ADMIN_ROUTES | {
    "/api/show",
    "/api/pull",
    "/api/push",
    "/api/create",
    "/api/copy",
    "/api/blobs/{digest}",
}


def test_the_route_table_lists_every_costed_route() -> None:
    specs = (ModelSpec("chat", make_config(workers=1)),)
    app = create_app(ModelRegistry(RegistryConfig(models=specs)), ServerConfig())
    posted = {
        route.path
        for route in app.routes
        if "POST" in getattr(route, "methods", ()) and route.path not in FREE_ROUTES
    }
    assert posted == {route.path for route in ROUTES}


@pytest.mark.parametrize("route", ROUTES, ids=[route.path for route in ROUTES])
def test_a_tenants_request_budget_holds_on_every_route(
    route: Route, alice: httpx.Client, bob: httpx.Client
) -> None:
    over = route.body(2 * BOB_BUDGET)
    error = _error(bob.post(route.path, json=over), 400)
    assert error["code"] == "request_too_expensive", error
    assert str(BOB_BUDGET) in error["message"]
    # The same body is within alice's budget (the server's).
    assert alice.post(route.path, json=over).status_code == 200
    assert bob.post(route.path, json=route.body(10)).status_code == 200


def test_a_request_without_a_maximum_generates_no_more_than_its_tenants_budget(
    bob: httpx.Client,
) -> None:
    # Costed at 128 output tokens when it set none, it may generate up to the context:
    # not past what bob's own max_request_tokens pays for.
    body = {"model": "chat", "messages": [{"role": "user", "content": "tokens:5000"}]}
    answer = _ok(bob.post("/v1/chat/completions", json=body))
    assert 128 < answer["usage"]["completion_tokens"] < BOB_BUDGET
    assert answer["choices"][0]["finish_reason"] == "length"


@contextlib.contextmanager
def _bob_running(daemon: Daemon, model: str, tmp_path: Path) -> Iterator[None]:
    """Bob's one run in ``model``'s fair share (his ``client_max_running``), until the
    block ends."""
    ops = {"Authorization": f"Bearer {KEYS['ops']}"}
    bob = {"Authorization": f"Bearer {KEYS['bob']}"}
    release = tmp_path / "release"
    if model == "emb":
        body = {"model": model, "input": f"embed_wait:{release}"}
    else:
        # 15 s of tokens, within bob's budget.
        body = {"model": model, "prompt": "tokens:150:0.1", "max_tokens": 150}
    done = threading.Event()

    def hold() -> None:
        with httpx.Client(base_url=daemon.url, timeout=slack(60), headers=bob) as client:
            if model == "emb":
                client.post("/v1/embeddings", json=body)
            else:
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}):
                    done.wait(slack(60))  # leaving the stream cancels the run

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        wait_for(
            lambda: daemon.get("/stats", headers=ops).json()["fair_share_by_model"][model],
            lambda share: share["in_pool"] >= 1,
            slack(10),
            f"bob's run in {model}",
        )
        yield
    finally:
        release.touch()
        done.set()
        holder.join(slack(30))


@pytest.mark.parametrize("route", ROUTES, ids=[route.path for route in ROUTES])
def test_a_tenants_share_holds_on_every_route(
    route: Route, daemon: Daemon, alice: httpx.Client, bob: httpx.Client, tmp_path: Path
) -> None:
    small = route.body(10)
    with _bob_running(daemon, route.model, tmp_path):
        error = _error(bob.post(route.path, json=small), 429)
        assert error["code"] == "client_limit", error
        assert alice.post(route.path, json=small).status_code == 200


# ---- operators ------------------------------------------------------------------------------


def test_only_an_operator_loads_and_unloads_models(
    daemon: Daemon, alice: httpx.Client, ops: httpx.Client
) -> None:
    default = {"Authorization": "Bearer sk-default-0123456789abcdef"}
    for path in sorted(ADMIN_ROUTES):
        for refused in (
            alice.post(path, json={"model": "emb"}),
            httpx.post(daemon.url + path, json={"model": "emb"}, headers=default),
        ):
            error = _error(refused, 403)
            assert error["type"] == "permission_error" and error["code"] == "operator_only"
    assert _ok(ops.get("/v1/models/emb"))["status"] == "loaded"
    assert _ok(ops.post("/models/unload", json={"model": "emb"}))["id"] == "emb"
    # Loaded again once unloaded (a load while the unload is pending is the registry's
    # review finding 14, not this test's).
    wait_for(
        lambda: _ok(ops.get("/v1/models/emb"))["status"],
        lambda status: status == "unloaded",
        slack(10),
        "emb unloaded",
    )
    assert _ok(ops.post("/models/load", json={"model": "emb"}))["status"] == "loaded"


def test_tenants_see_states_and_a_short_reason_never_paths_or_load_errors(
    daemon: Daemon, alice: httpx.Client, ops: httpx.Client
) -> None:
    refused = alice.post("/v1/completions", json={"model": "broken", "prompt": "echo:x"})
    assert refused.status_code == 503, refused.text
    assert SECRET_ERROR not in refused.text and "its load failed" in refused.text
    again = ops.post("/v1/completions", json={"model": "broken", "prompt": "echo:x"})
    assert again.status_code == 503 and SECRET_ERROR in again.text
    for client, full in ((alice, False), (ops, True)):
        stats = client.get("/stats").text
        cards = _ok(client.get("/v1/models"))
        reasons = {card["id"]: card["reason"] for card in cards["data"]}
        assert (SECRET_PATH in stats) is full and (SECRET_ERROR in stats) is full
        assert (SECRET_ERROR in reasons["broken"]) is full
    assert reasons["broken"] and SECRET_ERROR in reasons["broken"]
    seen = _ok(alice.get("/stats"))["models"]
    assert seen["broken"]["state"] == "failed" and seen["broken"]["reason"] == "its load failed"
    assert seen["chat"]["state"] == "loaded" and "model" not in seen["chat"]
    assert _ok(alice.get("/v1/models/broken"))["reason"] == "its load failed"
    assert SECRET_ERROR in daemon.log(), "the operator's log has the raw error"


def test_an_unauthenticated_readyz_names_no_model(daemon: Daemon, alice: httpx.Client) -> None:
    probe = daemon.get("/readyz")
    assert probe.status_code == 200 and probe.json()["status"] == "ready"
    assert "models" not in probe.json() and "chat" not in probe.text
    assert _ok(alice.get("/readyz"))["models"]["chat"] == "loaded"
