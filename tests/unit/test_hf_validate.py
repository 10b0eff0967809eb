"""The hf backend's light request check, and that importing it stays light."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

from modelpool.shared.errors import InvalidRequest
from modelpool.worker.backends.common.params import GENERATION_PARAMS
from modelpool.worker.backends.common.text import MAX_STOP_STRINGS
from modelpool.worker.backends.hf.handler import validate


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"max_new_tokens": 1},
        {
            "max_new_tokens": 64,
            "min_new_tokens": 8,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "do_sample": True,
            "repetition_penalty": 1.1,
            "no_repeat_ngram_size": 3,
            "stop": ["\n\n", "User:"],
            "seed": 1234,
        },
        {"temperature": 0},
        {"temperature": 0.0, "do_sample": False},
        {"top_k": 0, "no_repeat_ngram_size": 0, "min_new_tokens": 0},
        {"stop": "###"},
        {"stop": []},
        {"stop": ("a", "b")},
        {"stop": ["x"] * MAX_STOP_STRINGS},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"repetition_penalty": 1},
        {"min_new_tokens": 4, "max_new_tokens": 4},
    ],
)
def test_accepts(params: dict[str, Any]) -> None:
    validate(params)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"max_tokens": 5}, "max_tokens"),
        ({"stream": True}, "stream"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 5.0}, "top_k"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
        ({"do_sample": 1}, "do_sample"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"do_sample": True, "temperature": 0}, "temperature"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": False}, "repetition_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": None}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_rejects_naming_the_key(params: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequest, match=named) as caught:
        validate(params)
    assert isinstance(caught.value, ValueError)


def test_unknown_keys_message_lists_the_allowed_ones() -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate({"max_length": 3, "beams": 2})
    message = str(caught.value)
    assert "beams" in message and "max_length" in message
    assert all(key in message for key in GENERATION_PARAMS)


def test_importing_the_light_modules_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import modelpool.worker.backends.hf.handler, modelpool.tinymodel\n"
        "import modelpool.shared.embedded\n"
        "import modelpool.worker.backends.llama_cpp.handler\n"
        "modelpool.worker.backends.hf.handler.validate({'max_new_tokens': 3, 'stop': 'x'})\n"
        "modelpool.worker.backends.llama_cpp.handler.validate({'max_new_tokens': 3})\n"
        "heavy = ('torch', 'transformers', 'tokenizers', 'numpy', 'llama_cpp')\n"
        "heavy = sorted(m for m in heavy if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "", f"imported at module level: {result.stdout.strip()}"
