"""The worker's image decoder (worker/images.py) and the testing backend's vision, in
process: each bad image is a typed refusal naming its part, before a pixel is decoded."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from helpers import FakeCall, Recorder
from images_support import animated_gif, encoded, image_part, png_bomb, text_part
from modelpool.shared.errors import ImageRefused, InvalidRequest
from modelpool.shared.images import ImageLimits
from modelpool.shared.protocol import Generation, WorkerSpec
from modelpool.worker import images
from modelpool.worker.backends import testing, testing_images
from modelpool.worker.calls import send_failure


def _refusal(messages: list[dict[str, Any]], limits: ImageLimits | None = None) -> ImageRefused:
    with pytest.raises(ImageRefused) as caught:
        images.decode_prompt_images(messages, limits or ImageLimits())
    return caught.value


def _one(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [text_part("look"), part]},
    ]


def test_a_real_image_of_each_format_decodes_to_rgb_with_its_part() -> None:
    for fmt, media_type in (
        ("PNG", "image/png"),
        ("JPEG", "image/jpeg"),
        ("WEBP", "image/webp"),
        ("GIF", "image/gif"),
    ):
        (decoded,) = images.decode_prompt_images(_one(image_part(encoded(64, 48, fmt), media_type)))
        assert decoded.part == "messages[1].content[1]"
        assert (decoded.image.size, decoded.image.mode, decoded.format) == ((64, 48), "RGB", fmt)


def test_a_bomb_is_refused_from_its_header_before_it_is_decoded() -> None:
    bomb = png_bomb(100_000, 100_000)  # 10 gigapixels declared in a few dozen bytes
    assert len(bomb) < 200
    refusal = _refusal(_one(image_part(bomb)))
    assert (refusal.part, refusal.reason) == ("messages[1].content[1]", "too_many_pixels")
    assert isinstance(refusal, InvalidRequest)
    # Within Pillow's own bound but over the pool's: the pool's limit decides.
    small_limit = _refusal(_one(image_part(encoded(64, 48))), ImageLimits(max_pixels=64 * 47))
    assert small_limit.reason == "too_many_pixels" and "64x48" in str(small_limit)
    assert images.decode_prompt_images(
        _one(image_part(encoded(64, 48))), ImageLimits(max_pixels=64 * 48)
    )


def test_a_truncated_file_a_non_image_and_a_wrong_media_type_are_each_named() -> None:
    whole = encoded(64, 48)
    assert _refusal(_one(image_part(whole[: len(whole) // 2]))).reason == "truncated"
    assert _refusal(_one(image_part(b"#!/bin/sh\necho not a picture\n"))).reason == "not_an_image"
    mismatch = _refusal(_one(image_part(encoded(8, 8, "JPEG"), "image/png")))
    assert mismatch.reason == "media_type_mismatch" and "JPEG" in str(mismatch)
    assert _refusal(_one(image_part(whole, "image/svg+xml"))).reason == "malformed"
    assert _refusal(_one({"type": "image", "media_type": "image/png"})).reason == "malformed"


def test_frames_bytes_and_count_are_bounded() -> None:
    gif = animated_gif(3)
    refusal = _refusal(_one(image_part(gif, "image/gif")))
    assert refusal.reason == "too_many_frames" and "3 frames" in str(refusal)
    assert images.decode_prompt_images(
        _one(image_part(gif, "image/gif")), ImageLimits(max_frames=3)
    )
    big = encoded(64, 48)
    assert (
        _refusal(_one(image_part(big)), ImageLimits(max_bytes=len(big) - 1)).reason == "too_large"
    )
    many = [{"role": "user", "content": [image_part(encoded(4, 4))] * 3}]
    over = _refusal(many, ImageLimits(max_images=2))
    assert (over.part, over.reason) == ("messages[0].content[2]", "too_many_images")


def test_the_worker_decodes_under_the_limits_its_spec_carries() -> None:
    spec = WorkerSpec("m", "testing", {}, "cpu", [], 0, {}, image_limits=ImageLimits(max_frames=5))
    assert pickle.loads(pickle.dumps(spec)).image_limits.max_frames == 5
    assert WorkerSpec("m", "testing", {}, "cpu", [], 0, {}).image_limits == ImageLimits()
    images.configure(ImageLimits(max_frames=3))
    try:
        assert images.decode_prompt_images(_one(image_part(animated_gif(3), "image/gif")))
    finally:
        images.configure(ImageLimits())
    assert images.current_limits() == ImageLimits()


def test_a_refusal_travels_as_an_invalid_answer_with_its_part_and_reason() -> None:
    sent: list[tuple[Any, ...]] = []

    class Channel:
        def send(self, message: tuple[Any, ...]) -> None:
            sent.append(message)

    refusal = _refusal(_one(image_part(png_bomb(50_000, 50_000))))
    send_failure(Channel(), 7, refusal)  # type: ignore[arg-type]
    ((kind, attempt, what, text, _, _, detail),) = sent
    assert (kind, attempt, what) == ("error", 7, "invalid")
    assert detail == {"part": "messages[1].content[1]", "reason": "too_many_pixels"}
    assert "too_many_pixels" in text


# ---- the testing backend with vision = true -------------------------------------------------


def test_the_testing_backend_describes_each_image_then_does_as_its_text_says() -> None:
    backend = testing.load(vision=True)
    call = FakeCall(
        [
            {"role": "user", "content": [image_part(encoded(64, 48))]},
            {"role": "assistant", "content": "seen"},
            {
                "role": "user",
                "content": [
                    text_part("echo:"),
                    image_part(encoded(10, 12, "JPEG"), "image/jpeg"),
                    text_part("two pictures"),
                ],
            },
        ]
    )
    answer = backend.generate(call)
    assert isinstance(answer, Generation)
    assert answer.text == "image 1: 64x48 PNG\nimage 2: 10x12 JPEG\ntwo pictures"
    assert call.chunks == ["image 1: 64x48 PNG\nimage 2: 10x12 JPEG\n"]
    # 3 messages x 2 markers + 3 words + 2 images + the assistant's turn
    assert answer.prompt_tokens == 6 + 3 + 2 * testing_images.IMAGE_TOKENS + 1
    assert testing.count_tokens(call.prompt) == answer.prompt_tokens


def test_the_batched_testing_backend_streams_the_description_first() -> None:
    backend = testing.load(vision=True)
    call = Recorder(
        [{"role": "user", "content": [image_part(encoded(5, 6)), text_part("tokens:2")]}], {}
    )
    backend.admit(call)
    finished: list[tuple[Any, Any]] = []
    while not finished:
        finished = list(backend.step())
    ((ended, generation),) = finished
    assert ended is call and generation.text == "image 1: 5x6 PNG\nt0 t1 "
    assert call.chunks == ["image 1: 5x6 PNG\n", "t0 ", "t1 "]
    assert call.prompt_counts == (2 + 1 + testing_images.IMAGE_TOKENS + 1, 0)


def test_without_vision_an_image_is_a_typed_refusal_and_bad_images_are_refused() -> None:
    prompt = _one(image_part(encoded(4, 4)))
    with pytest.raises(ImageRefused) as caught:
        testing.load().generate(FakeCall(prompt))
    assert (caught.value.part, caught.value.reason) == (
        "messages[1].content[1]",
        "model_not_multimodal",
    )
    with pytest.raises(ImageRefused) as bomb:
        testing.load(vision=True).generate(FakeCall(_one(image_part(png_bomb(90_000, 90_000)))))
    assert bomb.value.reason == "too_many_pixels"
    with pytest.raises(ImageRefused):
        testing.load(vision=True).admit(Recorder(prompt[:1] + _one(image_part(b"GIF89a")), {}))
