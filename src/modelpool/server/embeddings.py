"""The bodies and answers of the daemon's embedding routes: OpenAI's ``/v1/embeddings`` and
TEI's ``/embed``, parsed and checked field by field (every refusal names the field the
client sent) and written as each API writes them::

    job = parse_embeddings(body)         # ApiError 400 naming "input", "dimensions", ...
    result = await pool.aembed(job.inputs, dimensions=job.dimensions, truncate=job.truncate)
    answer = embeddings_body(job, result.vectors, result.prompt_tokens, "all-minilm-l6-v2")

    POST /v1/embeddings {"model": M, "input": "text" | ["a", "b"] | [1, 2] | [[1, 2], [3]],
                         "encoding_format": "float" | "base64", "dimensions": 128}
      -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": ...}],
          "model": M, "usage": {"prompt_tokens": N, "total_tokens": N}}
    POST /embed         {"inputs": "text" | ["a", "b"], "normalize": true, "truncate": false}
      -> [[0.1, ...], ...]

``base64`` is what the ``openai`` client asks for whenever numpy is installed: each
vector's float32 values, little-endian, base64-encoded, as OpenAI sends them (a server
that answered floats there would be decoded into garbage of a quarter of the size). An
empty input (no items, an empty string, an empty list of token ids) is a 400 naming
``input``, never an answer with an empty ``data``.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelpool.server.core.fields import check_fields, opt_bool, opt_int, parse_priority
from modelpool.server.http import invalid

# OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048

EmbedInput = str | tuple[int, ...]
EncodingFormat = Literal["float", "base64"]

# ``keep_alive`` (Ollama's) is the registry's, read where the request takes its model's
# pool (``server.models.serve``), as on the generation routes.
EMBEDDINGS_FIELDS = frozenset(
    {
        "model",
        "input",
        "encoding_format",
        "dimensions",
        "user",
        "truncate",
        "priority",
        "keep_alive",
    }
)
TEI_EMBED_FIELDS = frozenset(
    {
        "model",
        "inputs",
        "normalize",
        "truncate",
        "truncation_direction",
        "dimensions",
        "priority",
        "keep_alive",
    }
)


@dataclass(frozen=True)
class EmbedJob:
    """What an embedding request asks of the pool, and how its answer is written."""

    inputs: tuple[EmbedInput, ...]
    dimensions: int | None = None
    truncate: bool = False
    encoding_format: EncodingFormat = "float"
    # TEI's ``normalize``: the vectors scaled to length 1 (whatever the model's pooling).
    normalize: bool = False
    priority: int = 0  # vLLM's: lower runs first

    def pool_inputs(self) -> list[str] | list[tuple[int, ...]]:
        """The inputs as ``ModelPool.aembed`` takes them: all texts or all token ids (the
        parser lets no request mix them)."""
        texts = [item for item in self.inputs if isinstance(item, str)]
        if len(texts) == len(self.inputs):
            return texts
        return [item for item in self.inputs if not isinstance(item, str)]


def parse_embeddings(body: Mapping[str, Any]) -> EmbedJob:
    """OpenAI's body: ``input`` as a string, strings, token ids or lists of token ids;
    ``encoding_format``; ``dimensions``; ``truncate`` (vLLM's and TEI's: cut an input
    past the model's context instead of refusing it)."""
    check_fields(body, EMBEDDINGS_FIELDS)
    if "input" not in body:
        raise invalid("missing field 'input'", param="input", code="missing_field")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise invalid(
            f"encoding_format must be 'float' or 'base64', got {encoding!r}",
            param="encoding_format",
        )
    return EmbedJob(
        inputs=parse_inputs(body["input"], "input"),
        dimensions=opt_int(body, "dimensions", 1),
        truncate=bool(opt_bool(body, "truncate")),
        encoding_format="base64" if encoding == "base64" else "float",
        priority=parse_priority(body) or 0,
    )


def parse_tei_embed(body: Mapping[str, Any]) -> EmbedJob:
    """TEI's ``/embed`` body: ``inputs`` a string or strings (token ids too, as TEI
    takes them), ``normalize`` (true unless it says false), ``truncate``."""
    check_fields(body, TEI_EMBED_FIELDS)
    if "inputs" not in body:
        raise invalid("missing field 'inputs'", param="inputs", code="missing_field")
    direction = body.get("truncation_direction")
    if direction not in (None, "right", "Right"):
        raise invalid(
            "truncation_direction: only 'right' (the end of a text is cut) is supported",
            param="truncation_direction",
            code="unsupported_value",
        )
    return EmbedJob(
        inputs=parse_inputs(body["inputs"], "inputs"),
        dimensions=opt_int(body, "dimensions", 1),
        truncate=bool(opt_bool(body, "truncate")),
        normalize=opt_bool(body, "normalize") is not False,
        priority=parse_priority(body) or 0,
    )


def parse_inputs(value: object, param: str) -> tuple[EmbedInput, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids;
    each non-empty, at most ``MAX_INPUTS`` of them."""
    if isinstance(value, str):
        return (_text(value, param),)
    if not isinstance(value, list) or not value:
        raise invalid(
            f"{param} must be a non-empty string, a non-empty list of strings, a list of "
            "token ids or a list of lists of token ids",
            param=param,
        )
    if len(value) > MAX_INPUTS:
        raise invalid(
            f"{param} has {len(value)} items; at most {MAX_INPUTS} in one request", param=param
        )
    if all(isinstance(item, str) for item in value):
        return tuple(_text(item, f"{param}[{index}]", param) for index, item in enumerate(value))
    if all(isinstance(item, list) for item in value):
        return tuple(
            _token_ids(item, f"{param}[{index}]", param) for index, item in enumerate(value)
        )
    if not any(isinstance(item, (str, list)) for item in value):
        return (_token_ids(value, param, param),)
    raise invalid(f"{param} mixes strings, token ids and lists: send one kind of item", param=param)


def _text(value: str, where: str, param: str | None = None) -> str:
    if not value:
        raise invalid(f"{where} must not be an empty string", param=param or where)
    return value


def _token_ids(value: list[Any], where: str, param: str) -> tuple[int, ...]:
    if not value:
        raise invalid(f"{where} must not be an empty list of token ids", param=param)
    for index, token_id in enumerate(value):
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise invalid(
                f"{where}[{index}] must be a token id (an integer >= 0), got {token_id!r}",
                param=param,
            )
    return tuple(value)


def inputs_size(inputs: Sequence[EmbedInput]) -> int:
    """The inputs' size in the request budget's units: token ids, or characters (a bound
    on the tokens of a text, known without the model), as a prompt is counted."""
    return sum(len(item) for item in inputs)


def base64_vector(vector: Sequence[float]) -> str:
    """A vector as OpenAI's ``base64`` encoding writes it: little-endian float32 bytes."""
    values = array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def embeddings_body(
    job: EmbedJob, vectors: Sequence[Sequence[float]], prompt_tokens: int, model: str
) -> dict[str, Any]:
    """OpenAI's answer: one ``embedding`` per input, in the order sent."""
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": base64_vector(vector) if job.encoding_format == "base64" else list(vector),
        }
        for index, vector in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def tei_embed_body(job: EmbedJob, vectors: Sequence[Sequence[float]]) -> list[list[float]]:
    """TEI's answer: the vectors, scaled to length 1 unless ``normalize`` was false."""
    if not job.normalize:
        return [list(vector) for vector in vectors]
    return [unit(vector) for vector in vectors]


def unit(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to length 1 (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(value * value for value in vector))
    if norm == 0.0:
        return list(vector)
    return [value / norm for value in vector]
