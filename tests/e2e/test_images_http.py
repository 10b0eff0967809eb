"""Images through every API of a real daemon (docs/images.md), with real clients.

Two models of one registry: ``eyes`` (the testing backend with ``vision = true``, which
decodes each image in its worker and answers "image 1: 64x48 PNG") and ``text`` (the
testing backend without it: a text-only model). The answers show that the image sent
is the one the worker read; the bad ones are 400s naming the part, each followed by a
request the pool still serves. Remote URLs: a real HTTP server on 127.0.0.1, the only
host the daemon may fetch from.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from e2e_support import Daemon, daemon_config, keyed_daemon, registry_config, start_daemon

from helpers import slack
from image_files import b64, data_url, png
from images_support import encoded, png_bomb
from modelpool.server.http import JOIN_OFF_LOOP_BYTES
from modelpool.shared.image_input import IMAGE_NOTE
from modelpool.worker.backends.testing_images import IMAGE_TOKENS

KEY = "images-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PICTURE = encoded(64, 48)
SEEN = "image 1: 64x48 PNG"
LIMITS = {"max_images": 4, "max_bytes": 300_000}
MODELS: dict[str, dict[str, Any]] = {
    "eyes": {
        "model": "eyes",
        "preload": True,
        "backend_options": {"vision": True},
        "image_limits": LIMITS,
    },
    "text": {"model": "text", "preload": True},
}
OMITTED = "x-modelpool-images-omitted"


class _Images(http.server.BaseHTTPRequestHandler):
    """A picture, one over max_bytes, a text file and a redirect to another host."""

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cat.png")
            self.end_headers()
            return
        body, kind = {
            "/cat.png": (PICTURE, "image/png"),
            "/big.png": (png(400, 300, noise=True), "image/png"),
            "/notes.txt": (b"not a picture at all", "text/plain"),
        }.get(self.path, (b"", ""))
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", kind or "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    server = {
        "max_body_bytes": 4_000_000,
        "image_url_hosts": ["127.0.0.1"],
        "image_fetch_timeout_s": 10.0,
    }
    config = registry_config(MODELS, workers=1, server=server)
    yield from keyed_daemon(tmp_path_factory.mktemp("images"), config, KEY)


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=slack(30.0)
    ) as client:
        yield client


@pytest.fixture()
def claude(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=daemon.url, api_key=KEY, max_retries=0, timeout=slack(30.0)
    ) as client:
        yield client


def post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(daemon.url + path, json=body, headers=AUTH, timeout=slack(30.0))


def chat_body(model: str, *parts: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    content = [{"type": "text", "text": "echo:hi"}, *parts]
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_serves(daemon: Daemon) -> None:
    """The pool answers the next request (a refusal never costs it a worker)."""
    answer = post(daemon, "/v1/chat/completions", chat_body("eyes", image_url(data_url(PICTURE))))
    assert answer.status_code == 200, answer.text
    assert SEEN in answer.json()["choices"][0]["message"]["content"]


# --------------------------------------------------------------------------------------
# Every API reads the image sent


def test_chat_image_url_data_url(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="eyes",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "echo:what is this"},
                    {
                        "type": "image_url",
                        "image_url": {"url": data_url(encoded(20, 10, "JPEG")), "detail": "low"},
                    },
                    {"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                ],
            }
        ],
    )
    text = answer.choices[0].message.content or ""
    assert text.startswith("image 1: 20x10 JPEG\nimage 2: 64x48 PNG\n"), text


def test_chat_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="eyes",
        messages=[{"role": "user", "content": [image_url(data_url(PICTURE))]}],
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert SEEN in text


def test_anthropic_image_block(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="eyes",
        max_tokens=32,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": b64(PICTURE),
                        },
                    },
                    {"type": "text", "text": "echo:describe"},
                ],
            }
        ],
    )
    assert SEEN in "".join(block.text for block in message.content if block.type == "text")


def test_responses_input_image(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="eyes",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "echo:describe"},
                    {"type": "input_image", "image_url": data_url(PICTURE), "detail": "auto"},
                ],
            }
        ],
    )
    assert SEEN in response.output_text


def test_ollama_images_on_chat_and_generate(daemon: Daemon) -> None:
    message = {"role": "user", "content": "echo:describe", "images": [b64(PICTURE)]}
    chat = post(daemon, "/api/chat", {"model": "eyes", "messages": [message], "stream": False})
    assert chat.status_code == 200, chat.text
    assert SEEN in chat.json()["message"]["content"]
    generate = post(
        daemon,
        "/api/generate",
        {"model": "eyes", "prompt": "echo:describe", "images": [b64(PICTURE)], "stream": False},
    )
    assert generate.status_code == 200, generate.text
    assert SEEN in generate.json()["response"]


# --------------------------------------------------------------------------------------
# Bad images and bombs: a 400 naming the part, and the pool serves the next request


@pytest.mark.parametrize(
    ("part", "where", "code"),
    [
        (image_url("data:image/png;base64,%%%%"), "messages[0].content[1]", "invalid_base64"),
        (image_url(data_url(b"a text file")), "messages[0].content[1]", "not_an_image"),
        (
            image_url(data_url(png(400, 300, noise=True))),
            "messages[0].content[1]",
            "image_too_large",
        ),
        (image_url(data_url(png_bomb(100_000, 100_000))), "messages[0].content[1]", None),
        (image_url("https://example.com/cat.png"), "messages[0].content[1]", "remote_image_url"),
        (image_url("file:///etc/passwd"), "messages[0].content[1]", "invalid_image_url"),
    ],
)
def test_a_bad_image_is_a_400_naming_the_part(
    daemon: Daemon, part: dict[str, Any], where: str, code: str | None
) -> None:
    answer = post(daemon, "/v1/chat/completions", chat_body("eyes", part))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == where and where in error["message"]
    if code is not None:
        assert error["code"] == code
    assert_serves(daemon)


def test_the_remote_url_refusal_says_how_to_allow_it(daemon: Daemon) -> None:
    answer = post(
        daemon, "/v1/chat/completions", chat_body("eyes", image_url("https://example.com/a.png"))
    )
    assert "[server] image_url_hosts" in answer.json()["error"]["message"]


def test_a_hundred_images_in_one_request(daemon: Daemon) -> None:
    parts = [image_url(data_url(png(4, 4))) for _ in range(100)]
    answer = post(daemon, "/v1/chat/completions", chat_body("eyes", *parts))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_images", "messages[0].content[5]")
    assert_serves(daemon)


def test_bad_images_in_the_other_apis_shapes(daemon: Daemon) -> None:
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!"}}
    anthropic_body = {
        "model": "eyes",
        "max_tokens": 8,
        "system": "s",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, bad]}],
    }
    answer = post(daemon, "/v1/messages", anthropic_body)
    assert answer.status_code == 400
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["param"] == "messages[0].content[1]"
    ollama_body = {"model": "eyes", "prompt": "x", "images": [b64(b"plain text")], "stream": False}
    answer = post(daemon, "/api/generate", ollama_body)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("images[0]: the data is not a PNG")
    assert_serves(daemon)


def test_an_allowed_host_is_fetched(daemon: Daemon, image_host: str) -> None:
    answer = post(
        daemon, "/v1/chat/completions", chat_body("eyes", image_url(f"{image_host}/cat.png"))
    )
    assert answer.status_code == 200, answer.text
    assert SEEN in answer.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/big.png", "image_too_large"),
        ("/notes.txt", "not_an_image"),
        ("/missing.png", "image_fetch_failed"),
        ("/redirect", "remote_image_url"),
    ],
)
def test_a_fetched_url_is_bounded(daemon: Daemon, image_host: str, path: str, code: str) -> None:
    answer = post(daemon, "/v1/chat/completions", chat_body("eyes", image_url(image_host + path)))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == code
    assert_serves(daemon)


# --------------------------------------------------------------------------------------
# A text-only model: a note and a header (or a 400 when the operator says so)


def test_a_text_only_model_gets_a_note_and_the_header(daemon: Daemon) -> None:
    picture = image_url(data_url(PICTURE))
    answer = post(daemon, "/v1/chat/completions", chat_body("text", picture, picture))
    assert answer.status_code == 200, answer.text
    assert answer.headers[OMITTED] == "2"
    assert (
        "[image omitted: this model reads no images]"
        in answer.json()["choices"][0]["message"]["content"]
    )
    with httpx.stream(
        "POST",
        daemon.url + "/v1/chat/completions",
        json=chat_body("text", picture, stream=True),
        headers=AUTH,
        timeout=slack(30.0),
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers[OMITTED] == "1"
        assert "image omitted" in streamed.read().decode()
    without = post(daemon, "/v1/chat/completions", chat_body("text"))
    assert OMITTED not in without.headers


def test_the_note_on_every_api(daemon: Daemon, claude: anthropic.Anthropic) -> None:
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(PICTURE)},
    }
    raw = claude.messages.with_raw_response.create(
        model="text",
        max_tokens=32,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "echo:hi"}]}],  # type: ignore[list-item]
    )
    assert raw.headers[OMITTED] == "1"
    responses = post(
        daemon,
        "/v1/responses",
        {
            "model": "text",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": data_url(PICTURE)}],
                }
            ],
        },
    )
    assert responses.status_code == 200 and responses.headers[OMITTED] == "1"
    message = {"role": "user", "content": "echo:hi", "images": [b64(PICTURE)]}
    ollama = post(daemon, "/api/chat", {"model": "text", "messages": [message], "stream": False})
    assert ollama.status_code == 200 and ollama.headers[OMITTED] == "1"


def test_an_image_in_a_tool_result(daemon: Daemon, claude: anthropic.Anthropic) -> None:
    """Claude Code's Read of a picture (an ``image`` block in a ``tool_result``) and a chat
    ``tool`` message with an image part: read as an image by a vision model, a note with
    the header for a text-only one."""
    use = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.png"}}
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(PICTURE)},
    }
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [block]}
    tools = [{"name": "Read", "input_schema": {"type": "object"}}]
    turns: list[Any] = [
        {"role": "user", "content": "echo:look"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result, {"type": "text", "text": "echo:seen"}]},
    ]
    seen = claude.messages.create(model="eyes", max_tokens=32, messages=turns, tools=tools)  # type: ignore[arg-type]
    assert SEEN in seen.content[0].text  # type: ignore[union-attr]
    noted = claude.messages.with_raw_response.create(
        model="text",
        max_tokens=32,
        messages=turns,
        tools=tools,  # type: ignore[arg-type]
    )
    assert noted.headers[OMITTED] == "1"
    call = {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": "{}"}}
    chat = [
        {"role": "user", "content": "echo:look"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [image_url(data_url(PICTURE))]},
        {"role": "user", "content": "echo:seen"},
    ]
    answer = post(daemon, "/v1/chat/completions", {"model": "eyes", "messages": chat})
    assert answer.status_code == 200, answer.text
    assert SEEN in answer.json()["choices"][0]["message"]["content"]


def test_a_body_of_megabytes_is_read_whole(daemon: Daemon) -> None:
    """A body over JOIN_OFF_LOOP_BYTES (joined in a thread): its image reaches the checks
    whole, here over eyes' max_bytes, so a 400 naming the part."""
    big = png(700, 700, noise=True)
    body = chat_body("eyes", image_url(data_url(big)))
    answer = post(daemon, "/v1/chat/completions", body)
    assert len(answer.request.content) > JOIN_OFF_LOOP_BYTES
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("image_too_large", "messages[0].content[1]")
    assert str(len(big)) in error["message"]
    assert_serves(daemon)


def test_count_tokens_settles_images_as_messages_does(claude: anthropic.Anthropic) -> None:
    """A text-only model counts the note its generation is given (and says so in the
    header); a vision model counts its image's tokens (16 on the testing backend)."""
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(PICTURE)},
    }
    text = {"type": "text", "text": "hi"}
    counts = {}
    for model in ("text", "eyes"):
        alone = claude.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": [text]}]
        )
        raw = claude.messages.with_raw_response.count_tokens(
            model=model,
            messages=[{"role": "user", "content": [block, text]}],  # type: ignore[list-item]
        )
        counts[model] = (alone.input_tokens, raw.parse().input_tokens, raw.headers.get(OMITTED))
    assert counts["text"] == (2, 2 + len(IMAGE_NOTE) + 1, "1")  # the note, a newline, "hi"
    assert counts["eyes"] == (2, 2 + IMAGE_TOKENS, None)


def test_refuse_mode(tmp_path_factory: pytest.TempPathFactory) -> None:
    config = daemon_config(server={"unsupported_images": "refuse", "max_body_bytes": 1_000_000})
    refusing = start_daemon(tmp_path_factory.mktemp("refuse"), config)
    try:
        url = refusing.url + "/v1/chat/completions"
        answer = httpx.post(url, json=chat_body("m", image_url(data_url(PICTURE))), timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_multimodal", "messages[0].content[1]")
        assert httpx.post(url, json=chat_body("m"), timeout=30).status_code == 200
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
        block["source"]["data"] = b64(PICTURE)
        counted = httpx.post(
            refusing.url + "/v1/messages/count_tokens",
            json={"model": "m", "messages": [{"role": "user", "content": [block]}]},
            timeout=30,
        )
        assert counted.status_code == 400, counted.text
        assert counted.json()["error"]["type"] == "invalid_request_error"
        assert "model_not_multimodal" in counted.text
    finally:
        assert refusing.stop() == 0, refusing.log()[-4000:]
