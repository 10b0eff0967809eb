"""Time to first token with an image, through the pool against in process (issue 55).

Side by side in one run, on the same vision model, greedy, one request at a time. The
model is a random LLaVA built from configs (``modelpool.tinyvision``) and kept in
``--cache-dir``: ``--size tiny`` (the tests' model, a forward pass in milliseconds: the
pool's own overhead shows most) or ``--size realistic`` (a CLIP ViT-B/16 tower, 224 px,
~86M parameters, before a language model of SmolLM2-135M's shape: what a small real
vision model costs), or any directory given with ``--model``.

1. **pool, image**: ``pool.stream`` of a chat message with one PNG (``--image-side``
   pixels a side, varied pixels) and a question: the image's bytes travel to the worker, which
   decodes them within the pool's limits (``worker.images``) and runs the processor and
   ``generate()``; the time to the first text chunk;
2. **in process, image**: the same bytes decoded with Pillow, the same processor and
   ``generate()`` in this process, with a streamer: the time to its first visible text
   (a token that completes a character, as the pool's stream sends text);
3. and 4.: the same two with the text alone (the image part left out).

Each contender runs ``--runs`` times, interleaved; medians are reported, with the ratio
in-process / pool for each prompt (target >= 0.95: the pool costs at most 5 % of a first
token)::

    python -m benchmarks.images_ttft                     # tiny model, 512x512, 20 runs
    python -m benchmarks.images_ttft --size realistic --runs 10 --threads 2
    python -m benchmarks.images_ttft --image-side 1024 --runs 30 --threads 2
    python -m benchmarks.images_ttft --model /models/smolvlm --device cuda:0

Prints one JSON object (median seconds by contender, ratios).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelpool import ModelPool, PoolConfig
from modelpool.tinyvision import REALISTIC, TINY, build_tiny_vision_model

SHAPES = {"tiny": TINY, "realistic": REALISTIC}

QUESTION = "What is in this picture? Describe it in a few words."


def make_png(size: int) -> bytes:
    """A ``size`` x ``size`` PNG with varied pixels (what a screenshot's decode costs)."""
    from PIL import Image

    image = Image.new("RGB", (size, size))
    image.putdata(
        [((x * 7) % 256, (y * 11) % 256, (x * y) % 256) for y in range(size) for x in range(size)]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def messages(png: bytes | None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if png is not None:
        parts.append({"type": "image", "data": png, "media_type": "image/png"})
    return [{"role": "user", "content": parts}]


class InProcess:
    """The reference: the model and processor loaded here, ``generate()`` with a streamer."""

    def __init__(self, model: Path, device: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        torch.set_num_threads(threads)
        self.processor: Any = AutoProcessor.from_pretrained(model)  # type: ignore[no-untyped-call]
        loaded: Any = AutoModelForImageTextToText.from_pretrained(model)
        self.model: Any = loaded.to(device).eval()

    def first_token_s(self, png: bytes | None, tokens: int) -> float:
        import torch
        from PIL import Image
        from transformers.generation.streamers import BaseStreamer

        started = time.perf_counter()
        first: list[float] = []
        tokenizer = self.processor.tokenizer

        class FirstText(BaseStreamer):
            """When the first visible text exists: a token that decodes to a whole
            character (as the pool's stream sends it: never half a character)."""

            def __init__(self) -> None:
                self.prompt_seen = False
                self.ids: list[int] = []

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # the first put is the prompt
                    self.prompt_seen = True
                    return
                self.ids = [*self.ids, *value.reshape(-1).tolist()]
                text = tokenizer.decode(self.ids, skip_special_tokens=True)
                if not first and text and not text.endswith("\ufffd"):
                    first.append(time.perf_counter())

            def end(self) -> None:
                if not first:
                    first.append(time.perf_counter())

        content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
        if png is not None:
            image = Image.open(io.BytesIO(png)).convert("RGB")
            content.append({"type": "image", "image": image})
        inputs = self.processor.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        ).to(self.model.device, dtype=self.model.dtype)
        with torch.inference_mode():
            self.model.generate(
                **inputs, max_new_tokens=tokens, do_sample=False, streamer=FirstText()
            )
        return first[0] - started


def pool_first_chunk_s(pool: ModelPool, png: bytes | None, tokens: int) -> float:
    started = time.perf_counter()
    stream = pool.stream(messages(png), max_new_tokens=tokens)
    first = None
    for _chunk in stream:
        if first is None:
            first = time.perf_counter() - started
    assert first is not None, "the pool streamed no text"
    return first


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a vision model directory (default: the tiny LLaVA)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny", help="the model built")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "modelpool-bench-vision",
        help="where the built model is kept between runs",
    )
    parser.add_argument("--image-side", type=int, default=512, help="the image's side in pixels")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4, help="new tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, each side")
    args = parser.parse_args(argv)

    if args.model:
        model = Path(args.model)
    else:
        model = build_tiny_vision_model(
            args.cache_dir / f"llava-{args.size}", shape=SHAPES[args.size], context_length=2048
        )
    png = make_png(args.image_side)
    reference = InProcess(model, args.device, args.threads)
    config = PoolConfig(
        model=str(model),
        backend="hf",
        workers=1,
        devices=(args.device,),
        backend_options={"torch_threads": args.threads},
    )
    timings: dict[str, list[float]] = {
        "pool_image": [],
        "in_process_image": [],
        "pool_text": [],
        "in_process_text": [],
    }
    with ModelPool(config) as pool:
        for _ in range(2):  # warm both sides: first calls pay for lazy set-up
            pool_first_chunk_s(pool, png, args.tokens)
            reference.first_token_s(png, args.tokens)
        for _ in range(args.runs):
            timings["pool_image"].append(pool_first_chunk_s(pool, png, args.tokens))
            timings["in_process_image"].append(reference.first_token_s(png, args.tokens))
            timings["pool_text"].append(pool_first_chunk_s(pool, None, args.tokens))
            timings["in_process_text"].append(reference.first_token_s(None, args.tokens))
    medians = {name: statistics.median(values) for name, values in timings.items()}
    report = {
        "model": str(args.model or f"llava-{args.size}"),
        "device": args.device,
        "image": f"{args.image_side}x{args.image_side} PNG, {len(png)} bytes",
        "runs": args.runs,
        "median_ttft_s": {name: round(value, 5) for name, value in medians.items()},
        "ratio_in_process_over_pool": {
            "image": round(medians["in_process_image"] / medians["pool_image"], 3),
            "text": round(medians["in_process_text"] / medians["pool_text"], 3),
        },
        "image_cost_s": {
            "pool": round(medians["pool_image"] - medians["pool_text"], 5),
            "in_process": round(medians["in_process_image"] - medians["in_process_text"], 5),
        },
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
