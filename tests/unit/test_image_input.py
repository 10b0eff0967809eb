"""Images as each API sends them, into the pool's one form; their limits at intake; the
configuration of both; which models read them (shared.image_input, shared.images)."""

from __future__ import annotations

import binascii
import json
import random
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from image_files import b64, data_url, png
from modelpool.server.anthropic.request import parse_messages
from modelpool.server.core.cost import prompt_size
from modelpool.server.core.generation_body import parse_chat
from modelpool.server.http import ApiError
from modelpool.server.ollama.request import parse_chat_body, parse_generate_body
from modelpool.server.responses.request import parse_responses
from modelpool.server.responses.store import ResponseStore
from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.shared.errors import ImageRefused, InvalidRequest
from modelpool.shared.image_input import (
    IMAGE_NOTE,
    check_image_limits,
    decode_base64,
    image_from_url,
    omit_images,
)
from modelpool.shared.images import IMAGE_TOKEN_ESTIMATE, ImageLimits, model_reads_images
from modelpool.shared.prefixes import prompt_fingerprints
from modelpool.shared.validation import check_prompt
from modelpool.supervisor.intake import check_request

PNG = png(8, 4)


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def _image_url(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


# --------------------------------------------------------------------------------------
# Configuration


def test_image_limits_from_a_models_table_and_their_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text('model = "m"\n[image_limits]\nmax_images = 3\nmax_bytes = 1000\n')
    limits = PoolConfig.from_toml(path).image_limits
    assert (limits.max_images, limits.max_bytes) == (3, 1000)
    assert limits.max_pixels == ImageLimits().max_pixels
    assert PoolConfig(model="m").image_limits == ImageLimits()
    with pytest.raises(ValueError, match=r"unknown key 'max_pixel' in \[image_limits\]"):
        PoolConfig.from_dict({"model": "m", "image_limits": {"max_pixel": 3}})
    with pytest.raises(ValueError, match=r"image_limits\.max_bytes must be >= 1"):
        PoolConfig.from_dict({"model": "m", "image_limits": {"max_bytes": 0}})
    with pytest.raises(ValueError, match=r"image_limits\.max_frames must be an integer"):
        PoolConfig.from_dict({"model": "m", "image_limits": {"max_frames": "2"}})


def test_server_image_settings_are_checked() -> None:
    assert ServerConfig().unsupported_images == "note"
    assert ServerConfig().image_url_hosts == ()
    assert ServerConfig(image_url_hosts=["img.example"]).image_url_hosts == ("img.example",)
    with pytest.raises(ValueError, match="unsupported_images must be 'note' or 'refuse'"):
        ServerConfig(unsupported_images="drop")
    with pytest.raises(ValueError, match="image_url_hosts must be a list of strings"):
        ServerConfig(image_url_hosts="img.example")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# The parsers


def test_chat_image_url_data_url_becomes_an_image_part_in_order() -> None:
    job = parse_chat(
        _chat({"type": "text", "text": "what?"}, _image_url(data_url(PNG), detail="low"))
    )
    content = job.prompts[0][0]["content"]  # type: ignore[index]
    assert content == [
        {"type": "text", "text": "what?"},
        {"type": "image", "data": PNG, "media_type": "image/png"},
    ]


def test_a_text_only_content_list_is_still_one_string() -> None:
    job = parse_chat(_chat({"type": "text", "text": "a"}, {"type": "text", "text": "b"}))
    assert job.prompts[0][0]["content"] == "a\nb"  # type: ignore[index]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64,@@@@", "invalid_base64"),
        ("data:image/png;base64,abc", "invalid_base64"),
        (data_url(b"hello, I am text, not a picture"), "not_an_image"),
        (data_url(PNG, "text/plain"), "unsupported_media_type"),
        (data_url(PNG, "image/tiff"), "unsupported_media_type"),
        ("data:image/png," + b64(PNG), "invalid_image_url"),
        ("file:///etc/passwd", "invalid_image_url"),
        ("/etc/passwd", "invalid_image_url"),
    ],
)
def test_a_malformed_image_url_is_refused_naming_the_part(url: str, reason: str) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "x"}, _image_url(url)]},
        ]
    }
    with pytest.raises(ImageRefused) as caught:
        parse_chat(body)
    assert caught.value.part == "messages[1].content[1]"
    assert caught.value.reason == reason
    assert "messages[1].content[1]" in caught.value.message


def test_missing_image_url_and_a_bad_detail_are_400s() -> None:
    with pytest.raises(ImageRefused, match=r"messages\[0\].content\[0\]: missing image_url.url"):
        parse_chat(_chat({"type": "image_url", "image_url": {}}))
    with pytest.raises(ApiError, match="detail must be"):
        parse_chat(_chat(_image_url(data_url(PNG), detail="huge")))


def test_a_mislabelled_image_type_is_forgiven_by_its_signature() -> None:
    gif = b"GIF89a" + bytes(20)
    assert image_from_url(data_url(gif, "image/png"), "p")["media_type"] == "image/gif"


def test_an_http_url_is_left_pending_with_its_name() -> None:
    part = image_from_url("https://img.example/cat.png", "messages[0].content[0]")
    assert part == {
        "type": "image",
        "url": "https://img.example/cat.png",
        "part": "messages[0].content[0]",
    }


def test_images_only_in_user_messages() -> None:
    body = {"messages": [{"role": "system", "content": [_image_url(data_url(PNG))]}]}
    with pytest.raises(ApiError, match="user messages and tool results only"):
        parse_chat(body)


def test_base64_is_decoded_strictly() -> None:
    data = bytes(range(256)) * 9000
    assert decode_base64(b64(data), "p") == data
    assert decode_base64("data:," + b64(data[:7]), "p", start=6) == data[:7]
    with pytest.raises(ImageRefused, match="not valid base64"):
        decode_base64(b64(data)[:-4] + "a=bc", "p")


def test_base64_decoding_agrees_with_binascii_strict_mode() -> None:
    """The decoder (pybase64) accepts exactly what ``binascii.a2b_base64(strict_mode=True)``
    does, and gives the same bytes: random strings with stray characters and padding
    in every place."""
    rng = random.Random(56)
    alphabet = string.ascii_letters + string.digits + "+/"
    for _ in range(3000):
        chars = [rng.choice(alphabet) for _ in range(rng.choice((4, 8, 12, 40)))]
        for _ in range(rng.choice((0, 0, 1, 2))):
            chars[rng.randrange(len(chars))] = rng.choice("== $\n-_\u00e9")
        if rng.random() < 0.3:
            chars[-1] = "="
        if rng.random() < 0.2:
            chars[-2] = "="
        text = "".join(chars)
        try:
            expected: bytes | None = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
        except (binascii.Error, UnicodeEncodeError):
            expected = None
        try:
            got: bytes | None = decode_base64(text, "p")
        except ImageRefused:
            got = None
        assert got == expected, text


def test_a_data_url_whose_comma_is_past_any_header_is_refused() -> None:
    url = "data:image/png;" + "x" * 300 + ";base64," + b64(PNG)
    with pytest.raises(ImageRefused, match="data URL must be") as refused:
        image_from_url(url, "p")
    assert refused.value.reason == "invalid_image_url"


def test_anthropic_image_and_text_document_blocks() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": "be brief",
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG)},
                    },
                    {
                        "type": "document",
                        "source": {"type": "text", "media_type": "text/plain", "data": "doc"},
                    },
                    {"type": "text", "text": "describe"},
                ],
            }
        ],
    }
    prompt = parse_messages(body).job.prompts[0]
    assert prompt[1]["content"] == [  # type: ignore[index]
        {"type": "image", "data": PNG, "media_type": "image/png"},
        {"type": "text", "text": "doc"},
        {"type": "text", "text": "describe"},
    ]


def test_anthropic_errors_name_the_clients_block() -> None:
    def body(block: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": "m",
            "max_tokens": 8,
            "system": "s",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, block]}],
        }

    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!"}}
    with pytest.raises(ImageRefused) as caught:
        parse_messages(body(bad))
    assert caught.value.part == "messages[0].content[1]"
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf"}}
    with pytest.raises(ApiError) as refused:
        parse_messages(body(pdf))
    assert refused.value.param == "messages[0].content[1]"
    assert "application/pdf" in refused.value.message


def test_anthropic_tool_result_with_an_image_as_claude_code_reads_a_file() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    image["source"]["data"] = b64(PNG)  # type: ignore[index]
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "read shot.png"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}],
            },
        ],
    }
    prompt = parse_messages(body).job.prompts[0]
    assert prompt[-1]["role"] == "tool"  # type: ignore[index]
    assert prompt[-1]["content"][0]["data"] == PNG  # type: ignore[index]


def test_responses_input_image_and_file_id() -> None:
    store = ResponseStore(max_entries=4, max_bytes=10_000, ttl_s=60)
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "what?"},
            {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
        ],
    }
    request = parse_responses({"model": "m", "input": [item]}, store, owner="o")
    assert request.job.prompts[0][0]["content"][1]["data"] == PNG  # type: ignore[index]
    item["content"][1] = {"type": "input_image", "file_id": "file-1"}  # type: ignore[index]
    with pytest.raises(ImageRefused) as caught:
        parse_responses({"model": "m", "input": [item]}, store, owner="o")
    assert (caught.value.part, caught.value.reason) == (
        "input[0].content[1]",
        "unsupported_file_id",
    )


def test_a_stored_response_with_an_image_is_sized_without_failing() -> None:
    store = ResponseStore(max_entries=4, max_bytes=100_000, ttl_s=60)
    messages = [{"role": "user", "content": [{"type": "image", "data": PNG, "media_type": "x"}]}]
    assert store.put("r", {"id": "r"}, messages, owner="o")
    big = [{"role": "user", "content": [{"type": "image", "data": bytes(200_000)}]}]
    assert not store.put("r2", {"id": "r2"}, big, owner="o")


def test_ollama_images_on_chat_and_generate() -> None:
    chat = parse_chat_body(
        {"model": "m", "messages": [{"role": "user", "content": "what?", "images": [b64(PNG)]}]}
    )
    assert chat.job.prompts[0][0]["content"] == [  # type: ignore[index]
        {"type": "image", "data": PNG, "media_type": "image/png"},
        {"type": "text", "text": "what?"},
    ]
    generate = parse_generate_body({"model": "m", "prompt": "what?", "images": [b64(PNG)]})
    assert generate.job.prompts[0][0]["content"][0]["data"] == PNG  # type: ignore[index]
    with pytest.raises(ImageRefused) as caught:
        parse_generate_body({"model": "m", "prompt": "x", "images": [b64(PNG), "%%%%"]})
    assert caught.value.part == "images[1]"
    with pytest.raises(ApiError, match="raw: true"):
        parse_generate_body({"model": "m", "prompt": "x", "raw": True, "images": [b64(PNG)]})


# --------------------------------------------------------------------------------------
# The pool's checks


def _image(data: bytes = PNG) -> dict[str, Any]:
    return {"type": "image", "data": data, "media_type": "image/png"}


def test_check_prompt_copies_parts_and_drops_the_parsers_names() -> None:
    data = bytearray(PNG)
    messages = [{"role": "user", "content": [{**_image(), "data": data, "part": "x"}]}]
    checked = check_prompt(messages)
    part = checked[0]["content"][0]  # type: ignore[index]
    assert part == {"type": "image", "data": PNG, "media_type": "image/png"}
    data[0] = 0
    assert part["data"] == PNG
    image = _image()
    assert (
        check_prompt([{"role": "user", "content": [image]}])[0]["content"][0]["data"]
        is (  # type: ignore[index]
            image["data"]
        )
    )
    with pytest.raises(ImageRefused, match=r"prompt\[0\].content\[0\]"):
        check_prompt([{"role": "user", "content": [{"type": "image", "url": "https://a/b"}]}])
    with pytest.raises(InvalidRequest, match="text part or an image part"):
        check_prompt([{"role": "user", "content": [{"type": "audio"}]}])


def _vision_config(**limits: int) -> PoolConfig:
    return PoolConfig(
        model="m",
        backend="testing",
        backend_options={"vision": True},
        image_limits=ImageLimits(**limits),
    )


def test_intake_refuses_too_many_images_and_an_over_size_one() -> None:
    many = [{"role": "user", "content": [_image() for _ in range(100)]}]
    with pytest.raises(ImageRefused) as caught:
        check_request(many, None, {}, _vision_config(), None)
    assert (caught.value.reason, caught.value.part) == (
        "too_many_images",
        "prompt[0].content[16]",
    )
    large = [{"role": "user", "content": [_image(PNG + bytes(2000))]}]
    with pytest.raises(ImageRefused, match="over the 1000 allowed") as over:
        check_request(large, None, {}, _vision_config(max_bytes=1000), None)
    assert over.value.reason == "image_too_large"
    checked = check_request(
        [{"role": "user", "content": [_image()]}], None, {}, _vision_config(), None
    )
    assert (
        checked.size.prompt_chars is not None and checked.size.prompt_chars >= IMAGE_TOKEN_ESTIMATE
    )


def test_intake_refuses_images_for_a_model_that_reads_none() -> None:
    with pytest.raises(ImageRefused) as caught:
        check_request(
            [{"role": "user", "content": [_image()]}],
            None,
            {},
            PoolConfig(model="m", backend="testing"),
            None,
        )
    assert caught.value.reason == "model_not_multimodal"


def test_check_image_limits_names_the_parsers_part() -> None:
    messages = [{"role": "user", "content": [{**_image(), "part": "images[0]"}]}]
    with pytest.raises(ImageRefused) as caught:
        check_image_limits(messages, ImageLimits(max_images=0))
    assert caught.value.part == "images[0]"


def test_omit_images_leaves_a_string_with_a_note() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, _image(), _image()]},
    ]
    omitted, count = omit_images(messages)
    assert count == 2
    assert omitted[1]["content"] == f"look\n{IMAGE_NOTE}\n{IMAGE_NOTE}"
    assert omitted[0] == messages[0]


def test_model_reads_images(tmp_path: Path) -> None:
    assert model_reads_images("testing", "m", {"vision": True})
    assert not model_reads_images("testing", "m", {})
    assert model_reads_images("llama_cpp", "m.gguf", {"mmproj": "mm.gguf"})
    assert not model_reads_images("llama_cpp", "m.gguf", {})
    vision, text = tmp_path / "vision", tmp_path / "text"
    vision.mkdir()
    text.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (text / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_reads_images("hf", str(vision), {})
    assert model_reads_images("auto", str(vision), {})
    assert not model_reads_images("hf", str(text), {})
    assert not model_reads_images("hf", str(tmp_path / "missing"), {})
    assert not model_reads_images("my.pkg:factory", str(vision), {})


def test_the_daemon_tells_a_vision_directory_without_importing_torch(tmp_path: Path) -> None:
    """The table of image-text-to-text model types is read from transformers' source in a
    process that has not imported it (the import brings torch into the daemon), and that
    reading equals the table the import gives."""
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "llava"}))
    probe = (
        "import sys\n"
        "from modelpool.shared.images import _types_from_source, model_reads_images\n"
        f"assert model_reads_images('hf', {str(vision)!r}, {{}})\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "print(sorted(_types_from_source() or ()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    assert json.loads(done.stdout.replace("'", '"')) == sorted(
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def test_an_image_is_sized_and_fingerprinted_without_its_bytes() -> None:
    one = [{"role": "user", "content": [_image(png(8, 4))]}]
    other = [{"role": "user", "content": [_image(png(8, 5))]}]
    assert prompt_size(one) >= IMAGE_TOKEN_ESTIMATE
    assert prompt_fingerprints(one) != prompt_fingerprints(other)
    assert prompt_fingerprints(one) == prompt_fingerprints(
        [{"role": "user", "content": [_image(png(8, 4))]}]
    )
