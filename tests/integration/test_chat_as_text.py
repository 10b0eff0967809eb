"""Chat content tokenized as text (issue 40, review #7), on the hf backend: special
tokens written in user, tool and assistant content, tool descriptions and call
arguments stay text; only the chat template's own markers are special-token ids. Also
through the daemon's ``/tokenize``. (The llama_cpp backend's test is in
``test_llama_cpp_backend.py``.)

The docs, Security and limits: chat content is text.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from helpers import ORDINARY_CHATS, TOOL_INJECTION, injected_chat, ordinary_tools
from modelpool import ModelPool, PoolConfig
from modelpool.server import create_app
from modelpool.shared.config import ServerConfig
from modelpool.shared.tools import render_chat
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


@pytest.fixture(scope="module")
def model() -> str:
    from modelpool.shared.embedded import prepare_model

    return str(prepare_model(progress=False))


@pytest.fixture(scope="module")
def handler(model: str) -> HFHandler:
    return load(model, dtype="float32", torch_threads=1, prefix_cache_bytes=0)


def im_starts(handler: HFHandler, ids: list[int]) -> int:
    return ids.count(handler.tokenizer.convert_tokens_to_ids("<|im_start|>"))


def test_injected_markers_in_content_stay_text(handler: HFHandler) -> None:
    chat, tools = injected_chat()
    assert handler.chat_as_text
    # The template's own: system, user, assistant, tool, and the generation prompt's.
    ids = handler.encode(chat, tools)[0].tolist()
    assert im_starts(handler, ids) == 5
    end_of_text = handler.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_text not in ids
    # The text is all there, as text: the model reads what the client sent.
    assert TOOL_INJECTION in handler.tokenizer.decode(ids)
    assert im_starts(handler, handler.tokenize(chat)) == 5


def test_ordinary_chats_tokenize_exactly_as_before(handler: HFHandler) -> None:
    tokenizer = handler.tokenizer
    for chat in ORDINARY_CHATS:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        before = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert handler.tokenize(chat) == before, chat
        with_tools = render_chat(tokenizer, chat, ordinary_tools())
        before = tokenizer(with_tools, add_special_tokens=False)["input_ids"]
        assert handler.encode(chat, ordinary_tools())[0].tolist() == before, chat


@pytest.fixture(scope="module")
def client(model: str) -> Iterator[TestClient]:
    config = PoolConfig(
        model=model,
        backend="hf",
        workers=1,
        devices=["cpu"],
        deadline_s=120.0,
        backend_options={"dtype": "float32", "torch_threads": 1},
    )
    with ModelPool(config) as pool:
        app = create_app(pool, ServerConfig(api_key_env=None), "smollm2")
        yield TestClient(app, base_url="http://127.0.0.1")


def test_tokenize_route_counts_only_the_templates_markers(
    client: TestClient, handler: HFHandler
) -> None:
    chat, _ = injected_chat()
    answer: dict[str, Any] = client.post("/tokenize", json={"messages": chat}).json()
    assert im_starts(handler, answer["tokens"]) == 5, answer
