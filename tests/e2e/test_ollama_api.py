"""Ollama's API (``/api/...``) through the clients that speak it, against a real keyed
daemon with a registry (testing backend, whose "model" writes what the prompt says): the
``ollama`` Python client (chat, streamed chat, generate, embed, list, ps, show, tools,
keep_alive loads and unloads), LangChain's ``ChatOllama`` and ``OllamaEmbeddings``, the
``ollama`` npm client; errors in Ollama's shape with its status codes, and the daemon's
protections (key, Origin, deadline, cancel on disconnect) on these routes as on the
others. Structured ``format`` runs on a tiny random hf model, whose free text is
gibberish: a schema-valid answer is the grammar's doing.

The docs, The Ollama API.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from e2e_support import Daemon, daemon_config, keyed_daemon, registry_config, start_daemon

from helpers import slack, wait_until

KEY = "test-ollama-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 4096
MODELS: dict[str, dict[str, Any]] = {
    "chat": {
        "model": "chat-weights",
        "preload": True,
        "backend_options": {"max_model_len": CONTEXT},
    },
    "emb": {"model": "emb-weights", "preload": True, "backend_options": {"task": "embed"}},
    # Loaded only when asked: the keep_alive tests load and unload it.
    "lazy": {"model": "lazy-weights", "ttl_s": 600},
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 1}}</tool_call>'
OLLAMA_JS = "ollama@0.6.4"


def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city.

    Args:
      city: The city
      days: How many days ahead
    """
    return "sunny"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = registry_config(MODELS, workers=1, server={"max_body_bytes": 65536})
    yield from keyed_daemon(tmp_path_factory.mktemp("ollama"), config, KEY)


@pytest.fixture()
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url, headers=AUTH, timeout=slack(30.0))


def post(daemon: Daemon, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(daemon.url + path, json=body, headers={**AUTH, **headers}, timeout=30)


def error_of(response: httpx.Response, status: int) -> str:
    """The ``error`` string of Ollama's error shape, the status checked."""
    assert response.status_code == status, response.text
    body = response.json()
    assert isinstance(body["error"], str), body
    return str(body["error"])


def test_chat_answers_with_measured_durations(client: ollama.Client, daemon: Daemon) -> None:
    messages = [{"role": "user", "content": "tokens:3:0.02"}]
    answer = client.chat(model="chat", messages=messages)
    assert answer.message.role == "assistant"
    assert answer.message.content == "t0 t1 t2 "
    assert answer.done is True and answer.done_reason == "stop"
    assert answer.model == "chat"
    assert answer.eval_count == 3
    # The worker's own count, as the chat route reports it for the same conversation.
    usage = post(daemon, "/v1/chat/completions", {"model": "chat", "messages": messages})
    assert answer.prompt_eval_count == usage.json()["usage"]["prompt_tokens"] > 0
    assert answer.total_duration and answer.eval_duration and answer.prompt_eval_duration
    # Two tokens at least 20 ms apart after the first: the generation's own time.
    assert answer.eval_duration >= 30_000_000
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration
    assert answer.load_duration is not None and answer.load_duration >= 0


def test_chat_streamed(client: ollama.Client) -> None:
    parts = list(
        client.chat(model="chat", messages=[{"role": "user", "content": "tokens:4"}], stream=True)
    )
    assert len(parts) >= 2
    assert all(part.done is False for part in parts[:-1])
    last = parts[-1]
    assert last.done is True and last.done_reason == "stop" and last.eval_count == 4
    assert "".join(part.message.content or "" for part in parts) == "t0 t1 t2 t3 "


def test_stream_is_ndjson_by_default(daemon: Daemon) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "tokens:2"}]}
    with httpx.stream("POST", daemon.url + "/api/chat", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True
    datetime.datetime.fromisoformat(lines[0]["created_at"])


def test_options_reach_the_sampler(client: ollama.Client) -> None:
    answer = client.chat(
        model="chat",
        messages=[{"role": "user", "content": "tokens:9"}],
        options={
            "num_predict": 2,
            "temperature": 0.5,
            "top_k": 5,
            "top_p": 0.9,
            "seed": 3,
            "num_thread": 4,  # Ollama's runtime: accepted, without effect
            "num_ctx": 2048,
        },
    )
    assert answer.message.content == "t0 t1 "
    assert answer.done_reason == "length" and answer.eval_count == 2
    stopped = client.chat(
        model="chat",
        messages=[{"role": "user", "content": "tokens:9"}],
        options={"stop": ["t3"]},
    )
    assert stopped.message.content == "t0 t1 t2 "


def test_generate(client: ollama.Client) -> None:
    answer = client.generate(model="chat", prompt="tokens:2", system="Be brief")
    assert answer.response == "t0 t1 "
    assert answer.done is True and answer.eval_count == 2
    raw = client.generate(model="chat", prompt="echo:raw text", raw=True)
    assert raw.response == "raw text"
    streamed = list(client.generate(model="chat", prompt="tokens:3", stream=True))
    assert "".join(part.response for part in streamed) == "t0 t1 t2 "
    assert streamed[-1].done is True


def test_tools_loop(client: ollama.Client) -> None:
    question = {"role": "user", "content": "echo:" + CALL}
    first = client.chat(model="chat", messages=[question], tools=[get_weather])
    calls = first.message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert dict(calls[0].function.arguments) == {"city": "Lima", "days": 1}
    result = {"role": "tool", "content": "echo:sunny", "tool_name": "get_weather"}
    second = client.chat(
        model="chat", messages=[question, first.message, result], tools=[get_weather]
    )
    assert second.message.content == "sunny" and not second.message.tool_calls


def test_tools_streamed(client: ollama.Client) -> None:
    parts = list(
        client.chat(
            model="chat",
            messages=[{"role": "user", "content": "echo:" + CALL}],
            tools=[get_weather],
            stream=True,
        )
    )
    calls = [call for part in parts for call in part.message.tool_calls or []]
    assert [call.function.name for call in calls] == ["get_weather"]
    assert parts[-1].done is True


def test_embed(client: ollama.Client) -> None:
    answer = client.embed(model="emb", input=["hello world", "another text"])
    assert len(answer.embeddings) == 2
    for vector in answer.embeddings:
        assert math.isclose(math.sqrt(sum(v * v for v in vector)), 1.0, rel_tol=1e-6)
    assert answer.prompt_eval_count and answer.total_duration
    legacy = client.embeddings(model="emb", prompt="hello world")
    norm = math.sqrt(sum(v * v for v in legacy.embedding))
    assert [v / norm for v in legacy.embedding] == pytest.approx(list(answer.embeddings[0]))


def test_embed_refuses_a_chat_model(daemon: Daemon) -> None:
    error = error_of(post(daemon, "/api/embed", {"model": "chat", "input": "x"}), 400)
    assert "needs an embedding model" in error


def test_list_show_and_version(client: ollama.Client, daemon: Daemon) -> None:
    names = {model.model for model in client.list().models}
    assert names == set(MODELS)
    chat = client.show("chat")
    assert chat.capabilities is not None and "completion" in chat.capabilities
    assert "tools" in chat.capabilities
    assert chat.modelinfo is not None and chat.modelinfo["testing.context_length"] == CONTEXT
    emb = client.show("emb")
    assert emb.capabilities == ["embedding"]
    assert httpx.head(daemon.url + "/", headers=AUTH, timeout=10).status_code == 200  # heartbeat
    version = httpx.get(daemon.url + "/api/version", headers=AUTH, timeout=10).json()
    assert version["version"].count(".") == 2 and version["modelpool_version"]


def test_ps_lists_loaded_models_with_their_expiry(client: ollama.Client) -> None:
    client.chat(model="chat", messages=[{"role": "user", "content": "tokens:1"}])
    loaded = {model.model: model for model in client.ps().models}
    assert {"chat", "emb"} <= set(loaded)
    now = datetime.datetime.now(datetime.UTC)
    chat = loaded["chat"]
    assert chat.size is not None and chat.size > 0
    # A preload without ttl_s is never unloaded idle: Ollama's far-future date.
    assert chat.expires_at is not None and chat.expires_at.year > now.year + 100


def test_keep_alive_loads_and_unloads(client: ollama.Client) -> None:
    loaded = client.chat(model="lazy", messages=[], keep_alive="5m")
    assert loaded.done is True and loaded.done_reason == "load"
    running = {model.model: model for model in client.ps().models}
    assert "lazy" in running
    expires = running["lazy"].expires_at
    assert expires is not None
    left = (expires - datetime.datetime.now(datetime.UTC)).total_seconds()
    assert 240 < left <= 300
    answer = client.generate(model="lazy", prompt="tokens:1", keep_alive=-1)
    assert answer.response == "t0 "
    # -1 keeps it as long as the operator's ttl_s (600 s) allows: no client keeps a
    # shared model for ever (docs, Many models).
    kept = {model.model: model for model in client.ps().models}["lazy"].expires_at
    assert kept is not None
    assert 540 < (kept - datetime.datetime.now(datetime.UTC)).total_seconds() <= 600
    unloaded = client.generate(model="lazy", prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload"
    wait_until(
        lambda: "lazy" not in {model.model for model in client.ps().models},
        slack(15.0),
        message="lazy unloaded",
    )


def test_errors_in_ollama_shape(daemon: Daemon, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == 404 and "nope" in raised.value.error
    chat = {"model": "chat", "stream": False}
    image = {"role": "user", "content": "what is this", "images": ["AAAA"]}
    refused = error_of(post(daemon, "/api/chat", {**chat, "messages": [image]}), 400)
    assert "messages[0].images[0]: the data is not a PNG" in refused
    hello = [{"role": "user", "content": "x"}]
    # /api/generate thinks apart as /api/chat does (test_reasoning), but not a raw prompt.
    think = {**chat, "prompt": "x", "think": True, "raw": True}
    assert "nothing thinks apart" in error_of(post(daemon, "/api/generate", think), 400)
    fim = post(daemon, "/api/generate", {**chat, "prompt": "def f(", "suffix": "return 1"})
    assert "does not support insert" in error_of(fim, 400)
    too_long = {**chat, "messages": hello, "options": {"num_ctx": CONTEXT * 2}}
    assert f"context of {CONTEXT}" in error_of(post(daemon, "/api/chat", too_long), 400)
    mirostat = {**chat, "messages": hello, "options": {"mirostat": 2}}
    assert "options.mirostat" in error_of(post(daemon, "/api/chat", mirostat), 400)
    bad_tokens = {**chat, "messages": hello, "options": {"num_predict": 0}}
    assert error_of(post(daemon, "/api/chat", bad_tokens), 400).startswith("options.num_predict")
    costly = {**chat, "messages": hello, "options": {"num_predict": 10**6}}
    assert "max_request_tokens" in error_of(post(daemon, "/api/chat", costly), 400)
    huge = {**chat, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert "larger than" in error_of(post(daemon, "/api/chat", huge), 413)
    pulled = post(daemon, "/api/pull", {"model": "llama3.2"})
    assert "serves the models its configuration names" in error_of(pulled, 501)
    deleted = httpx.request(
        "DELETE", daemon.url + "/api/delete", json={"model": "chat"}, headers=AUTH, timeout=10
    )
    assert error_of(deleted, 501)


def test_key_host_and_origin_are_checked(daemon: Daemon) -> None:
    hello = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
    keyless = httpx.post(daemon.url + "/api/chat", json=hello, timeout=10)
    assert "API key" in error_of(keyless, 401)
    with pytest.raises(ollama.ResponseError) as raised:
        ollama.Client(host=daemon.url).list()
    assert raised.value.status_code == 401
    browser = post(daemon, "/api/chat", hello, Origin="https://evil.example")
    assert "cross-origin" in error_of(browser, 403)
    rebound = post(daemon, "/api/chat", hello, Host="evil.example")  # DNS rebinding
    assert "is not served here" in error_of(rebound, 403)


def test_deadline_mid_stream_is_an_error_line(client: ollama.Client, daemon: Daemon) -> None:
    timed = ollama.Client(host=daemon.url, headers={**AUTH, "X-Request-Timeout": "1"})
    with pytest.raises(ollama.ResponseError, match="deadline"):
        list(
            timed.chat(model="chat", messages=[{"role": "user", "content": "stall:2"}], stream=True)
        )


def test_disconnect_cancels_the_run(daemon: Daemon) -> None:
    before = chat_counters(daemon)["cancelled"]
    # 30 s of tokens in the chat model's context: its 20 s deadline would end it first.
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "tokens:3000:0.01"}],
        "options": {"num_predict": 3000},
    }
    with httpx.stream("POST", daemon.url + "/api/chat", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert json.loads(next(lines))["done"] is False
    # Cancelled: neither completed nor timed out.
    wait_until(
        lambda: chat_counters(daemon)["cancelled"] == before + 1,
        slack(5.0),
        message="the run cancelled",
    )


def chat_counters(daemon: Daemon) -> dict[str, int]:
    stats = httpx.get(daemon.url + "/stats", headers=AUTH, timeout=10).json()
    counters: dict[str, int] = stats["models"]["chat"]["pool"]["counters"]
    return counters


def test_langchain_chat_ollama(daemon: Daemon) -> None:
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    kwargs: dict[str, Any] = {"headers": AUTH}
    chat = ChatOllama(model="chat", base_url=daemon.url, client_kwargs=kwargs, num_predict=8)
    assert chat.invoke("tokens:3").content == "t0 t1 t2 "
    streamed = "".join(str(chunk.content) for chunk in chat.stream("tokens:2"))
    assert streamed == "t0 t1 "
    with_tools = chat.bind_tools([get_weather])
    called = with_tools.invoke("echo:" + CALL)
    assert [call["name"] for call in called.tool_calls] == ["get_weather"]  # type: ignore[attr-defined]
    embeddings = OllamaEmbeddings(model="emb", base_url=daemon.url, client_kwargs=kwargs)
    vectors = embeddings.embed_documents(["one text", "two texts"])
    assert len(vectors) == 2 and len(vectors[0]) > 0
    assert embeddings.embed_query("one text") == pytest.approx(vectors[0])


def _ollama_js() -> tuple[str, Path]:
    """node, and the folder the ``ollama`` npm package is installed in (once, into the
    user's cache); skipped where there is no npm."""
    npm = shutil.which("npm")
    node = shutil.which("node")
    if npm is None or node is None:
        pytest.skip("node and npm are needed for the ollama npm client")
    cache = Path.home() / ".cache" / "modelpool" / "ollama-js"
    package = cache / "node_modules" / "ollama"
    if (
        not (package / "package.json").exists()
        or OLLAMA_JS.split("@")[1] not in (package / "package.json").read_text()
    ):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(cache), OLLAMA_JS],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return node, cache


JS_CHECK = """
import { Ollama } from 'ollama'
const client = new Ollama({ host: process.env.HOST, headers: { Authorization: process.env.AUTH } })
const chat = await client.chat({ model: 'chat', messages: [{ role: 'user', content: 'tokens:3' }] })
const parts = []
for await (const part of await client.chat({
  model: 'chat', messages: [{ role: 'user', content: 'tokens:2' }], stream: true })) {
  parts.push(part)
}
const generated = await client.generate({ model: 'chat', prompt: 'tokens:1' })
const embedded = await client.embed({ model: 'emb', input: ['a text'] })
const listed = await client.list()
let refused = null
try { await client.pull({ model: 'llama3.2' }) } catch (error) { refused = error.status_code }
console.log(JSON.stringify({
  chat: chat.message.content, done: chat.done, evalCount: chat.eval_count,
  streamed: parts.map((part) => part.message.content).join(''),
  last: parts[parts.length - 1].done,
  generated: generated.response, dims: embedded.embeddings[0].length,
  names: listed.models.map((model) => model.name).sort(), refused,
}))
"""


def test_ollama_npm_client(daemon: Daemon) -> None:
    node, cache = _ollama_js()
    script = cache / "check.mjs"  # beside node_modules, where node resolves 'ollama'
    script.write_text(JS_CHECK)
    ran = subprocess.run(
        [node, str(script)],
        capture_output=True,
        text=True,
        timeout=slack(60.0),
        env={**os.environ, "HOST": daemon.url, "AUTH": AUTH["Authorization"]},
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen == {
        "chat": "t0 t1 t2 ",
        "done": True,
        "evalCount": 3,
        "streamed": "t0 t1 ",
        "last": True,
        "generated": "t0 ",
        "dims": seen["dims"],
        "names": sorted(MODELS),
        "refused": 501,
    }
    assert seen["dims"] > 0


def test_one_model_daemon(tmp_path: Path) -> None:
    """Without a registry: the one pool whatever ``model`` says, listed, loaded for good
    (a keep_alive 0 unload is refused, saying why); a client past its share is a 429."""
    server = {"client_max_running": 1, "client_max_queued": 0}
    one = start_daemon(tmp_path, daemon_config(workers=2, server=server))
    try:
        client = ollama.Client(host=one.url)
        assert client.chat(model="any", messages=[{"role": "user", "content": "tokens:1"}])
        assert len(client.list().models) == 1 and len(client.ps().models) == 1
        assert client.chat(model="any", messages=[]).done_reason == "load"
        with pytest.raises(ollama.ResponseError) as raised:
            client.chat(model="any", messages=[], keep_alive=0)
        assert raised.value.status_code == 400 and "one model" in raised.value.error
        long = {"model": "any", "messages": [{"role": "user", "content": "tokens:200:0.05"}]}
        with httpx.stream("POST", one.url + "/api/chat", json=long, timeout=30) as running:
            lines = running.iter_lines()  # held: a closed iterator closes the stream
            assert json.loads(next(lines))["done"] is False
            with pytest.raises(ollama.ResponseError) as raised:
                client.chat(model="any", messages=[{"role": "user", "content": "tokens:1"}])
            assert raised.value.status_code == 429
    finally:
        assert one.stop() == 0, one.log()[-4000:]


@pytest.mark.slow
def test_structured_format_on_a_real_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = daemon_config(model=str(tiny_model_dir), backend="hf", workers=1, deadline_s=60.0)
    hf = start_daemon(tmp_path, config, ready_timeout=300.0)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    try:
        client = ollama.Client(host=hf.url, timeout=60.0)
        messages = [{"role": "user", "content": "Is this small or large?"}]
        shaped = client.chat(
            model="tiny",
            messages=messages,
            format=schema,
            options={"num_predict": 60, "repeat_penalty": 1.2},
        )
        jsonschema.validate(json.loads(shaped.message.content or ""), schema)
        generated = client.generate(
            model="tiny", prompt="Say it", format=schema, options={"num_predict": 60, "seed": 1}
        )
        assert shaped.done_reason == "stop"
        jsonschema.validate(json.loads(generated.response), schema)
    finally:
        assert hf.stop() == 0, hf.log()[-4000:]
