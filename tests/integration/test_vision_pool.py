"""Images through a real pool: decoded in the worker, refused typed, a crash costs one
request; the tiny vision model's answers equal transformers' ``generate()`` in process."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest

from helpers import counters, open_pool, slack, wait_until, workers
from image_files import png
from images_support import encoded, image_part, pattern, png_bomb, text_part
from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import ImageRefused, InvalidRequest, PoisonRequest
from modelpool.shared.images import SUBMIT_OFF_LOOP_BYTES
from modelpool.shared.validation import check_prompt
from modelpool.tinyvision import IMAGE_TOKENS, build_tiny_vision_model
from modelpool.worker.backends.testing_images import IMAGE_TOKENS as TESTING_IMAGE_TOKENS
from modelpool.worker.backends.testing_images import fault_png


def _pool_takes_image_parts() -> bool:
    try:
        check_prompt([{"role": "user", "content": [image_part(encoded(4, 4))]}])
    except InvalidRequest:
        return False
    return True


# The pool's own check of a prompt (shared/validation.py) lets image parts through once
# the request side of images (the API parsers' branch) is in.
pytestmark = pytest.mark.skipif(
    not _pool_takes_image_parts(), reason="the pool's check_prompt refuses image parts"
)


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def test_the_testing_backend_reads_images_in_its_worker() -> None:
    with open_pool(workers=1, backend_options={"vision": True}) as pool:
        prompt = _user(
            text_part("echo:two"),
            image_part(encoded(64, 48)),
            image_part(encoded(9, 7, "WEBP"), "image/webp"),
        )
        result = pool.generate(prompt)
        assert result.text == "image 1: 64x48 PNG\nimage 2: 9x7 WEBP\ntwo"
        assert result.prompt_tokens == 2 + 1 + 2 * TESTING_IMAGE_TOKENS + 1
        chunks: list[str] = []
        streamed = pool.submit(prompt, on_chunk=chunks.append).result(timeout=slack(10))
        assert "".join(chunks) == streamed.text == result.text


def test_a_bad_image_is_a_typed_refusal_and_the_worker_stays() -> None:
    with open_pool(workers=1, backend_options={"vision": True}) as pool:
        pid = pool.generate("pid").text
        cases = {
            "too_many_pixels": png_bomb(100_000, 100_000),
            "truncated": encoded(64, 48)[:60],
            "not_an_image": b"<?xml version='1.0'?><svg/>",
        }
        for reason, data in cases.items():
            with pytest.raises(ImageRefused) as caught:
                pool.generate(
                    [{"role": "system", "content": "hi"}, *_user(text_part("x"), image_part(data))]
                )
            assert (caught.value.part, caught.value.reason) == ("messages[1].content[1]", reason)
        with pytest.raises(ImageRefused) as mismatch:
            pool.generate(_user(image_part(encoded(8, 8, "GIF"), "image/jpeg")))
        assert mismatch.value.reason == "media_type_mismatch"
        assert pool.generate("pid").text == pid, "refusals never cost the worker"


def test_a_text_only_model_refuses_an_image_typed() -> None:
    with open_pool(workers=1) as pool:
        with pytest.raises(ImageRefused) as caught:
            pool.generate(_user(text_part("echo:x"), image_part(encoded(4, 4))))
        assert caught.value.reason == "model_not_multimodal"
        assert pool.generate("echo:still here").text == "still here"


@pytest.mark.slow
def test_an_image_that_crashes_the_decoder_costs_one_request() -> None:
    with open_pool(
        workers=1,
        spares=1,
        max_batch_size=4,
        deadline_s=60,
        backend_options={"vision": True},
    ) as pool:
        innocents = [pool.submit("tokens:100:0.01") for _ in range(2)]
        wait_until(
            lambda: sum(len(worker.running) for worker in workers(pool)) >= 2,
            slack(10),
            message="2 requests running",
        )
        poison = pool.submit(_user(text_part("echo:x"), image_part(fault_png())))
        with pytest.raises(PoisonRequest):
            poison.result(timeout=60)
        for future in innocents:
            assert future.result(timeout=60).text.startswith("t0 t1 ")
        assert counters(pool)["poison_requests"] == 1
        assert pool.generate(_user(text_part("echo:ok"), image_part(encoded(3, 3)))).text == (
            "image 1: 3x3 PNG\nok"
        )


def test_agenerate_sends_megabytes_of_image_from_off_the_loop() -> None:
    """A prompt with over SUBMIT_OFF_LOOP_BYTES of images is pickled in a thread: the
    answer is the same; a caller cancelled meanwhile cancels its request."""
    picture = png(700, 700, noise=True)
    assert len(picture) > SUBMIT_OFF_LOOP_BYTES
    prompt = _user(text_part("echo:ok"), image_part(picture))

    async def run(pool: ModelPool) -> str:
        answer = await pool.agenerate(prompt, max_new_tokens=8)
        cancelled = asyncio.ensure_future(pool.agenerate(prompt, max_new_tokens=8))
        await asyncio.sleep(0)  # the submission under way in its thread
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return answer.text

    with open_pool(backend_options={"vision": True}, workers=1) as pool:
        assert asyncio.run(run(pool)) == "image 1: 700x700 PNG\nok"
        assert pool.generate(_user(text_part("echo:next"))).text == "next"


# ---- the tiny vision model on the hf backend ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-llava")


def _references(
    model_dir: Path,
    prompts: dict[str, list[dict[str, Any]]],
    max_new_tokens: int,
    chat_template: str | None = None,
) -> dict[str, tuple[str, int]]:
    """transformers' greedy generate() in this process on the same images (decoded as the
    worker decodes them) and the same processor: each prompt's text and prompt tokens."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor: Any = AutoProcessor.from_pretrained(model_dir)
    if chat_template is not None:
        processor.chat_template = chat_template
    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir).eval()

    def part_of(part: dict[str, Any]) -> dict[str, Any]:
        if part["type"] != "image":
            return part
        return {"type": "image", "image": Image.open(io.BytesIO(part["data"])).convert("RGB")}

    answers = {}
    for name, prompt in prompts.items():
        messages = [
            {
                "role": message["role"],
                "content": [part_of(part) for part in message["content"]]
                if isinstance(message["content"], list)
                else [text_part(message["content"])],
            }
            for message in prompt
        ]
        inputs = processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        prompt_tokens = int(inputs["input_ids"].shape[1])
        text = processor.tokenizer.decode(output[0][prompt_tokens:], skip_special_tokens=True)
        answers[name] = (str(text), prompt_tokens)
    return answers


@pytest.mark.slow
def test_the_tiny_vision_model_answers_as_generate_does_in_process(tiny_vision_dir: Path) -> None:
    prompts = {
        "one image": _user(text_part("What is in the picture?"), image_part(pattern(40, 30))),
        "two images": _user(
            image_part(pattern(16, 16, seed=1)),
            text_part("and"),
            image_part(pattern(50, 20, seed=2), "image/png"),
        ),
        "turns": [
            {"role": "system", "content": "Describe images."},
            *_user(text_part("first"), image_part(pattern(32, 32, seed=3))),
            {"role": "assistant", "content": "a square"},
            *_user(text_part("and this one?"), image_part(encoded(20, 40, "JPEG"), "image/jpeg")),
        ],
    }
    config = PoolConfig(model=str(tiny_vision_dir), backend="hf", workers=1, devices=["cpu"])
    with ModelPool(config) as pool:
        answers = {
            name: pool.generate(prompt, max_new_tokens=12) for name, prompt in prompts.items()
        }
        other_image = pool.generate(
            _user(text_part("What is in the picture?"), image_part(pattern(40, 30, seed=9))),
            max_new_tokens=12,
        )
    references = _references(tiny_vision_dir, prompts, 12)
    for name in prompts:
        text, prompt_tokens = references[name]
        assert answers[name].text == text, name
        assert answers[name].prompt_tokens == prompt_tokens, name
    images_in = {"one image": 1, "two images": 2, "turns": 2}
    for name, count in images_in.items():
        assert answers[name].prompt_tokens is not None
        assert answers[name].prompt_tokens > count * IMAGE_TOKENS, "image tokens are counted"
    # The answer depends on the image's pixels, not only on its tokens' places.
    assert other_image.text != answers["one image"].text


@pytest.mark.slow
def test_a_tool_results_image_stays_an_image_where_the_template_renders_no_tools(
    tiny_vision_dir: Path,
) -> None:
    """A template that refuses a ``tool`` turn (as Gemma 3's does): the call and the result
    go in as text, the result's image as an image in the user turn that carries it (how
    Claude Code's Read of a picture arrives), equal to generate() on that conversation."""
    from modelpool.tinyvision import VISION_CHAT_TEMPLATE

    strict = VISION_CHAT_TEMPLATE.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['role'] == 'tool' %}"
        "{{ raise_exception('no tool turns') }}{% endif %}",
        1,
    )
    picture = image_part(pattern(40, 30, seed=4))
    call = {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": {}}}
    conversation = [
        *_user(text_part("read shot.png")),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [picture]},
    ]
    written_call = '<tool_call>{"name": "Read", "arguments": {}}</tool_call>'
    as_rendered = [
        *_user(text_part("read shot.png")),
        {"role": "assistant", "content": written_call},
        *_user(text_part("<tool_response>\n"), picture, text_part("\n</tool_response>")),
    ]
    options = {"chat_template": strict}
    config = PoolConfig(
        model=str(tiny_vision_dir),
        backend="hf",
        workers=1,
        devices=["cpu"],
        backend_options=options,
    )
    with ModelPool(config) as pool:
        answer = pool.generate(conversation, max_new_tokens=12)
    text, prompt_tokens = _references(tiny_vision_dir, {"rendered": as_rendered}, 12, strict)[
        "rendered"
    ]
    assert (answer.text, answer.prompt_tokens) == (text, prompt_tokens)
    assert prompt_tokens > IMAGE_TOKENS
