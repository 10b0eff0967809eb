"""Fuzz the inputs (hypothesis): prompts, generation parameters, TOML configs.

Against a running testing-backend pool, a random or malformed prompt or
parameter set either raises ``InvalidRequest`` synchronously or gives a normal
``Result`` with the text the backend echoes, and an input the README calls
valid (``certainly_valid``) must be served; after every example the pool is
ready and no worker died. Random TOML documents and config
dicts give a ``PoolConfig`` or ``ValueError``, never ``TypeError``,
``KeyError``, ``AttributeError`` or ``OverflowError``.

Each bug this fuzzing found keeps a focused test here as a regression test.
"""

from __future__ import annotations

import datetime
import math
import os
import string
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import make_config, open_pool, toml_key, toml_value
from modelpool import (
    DeadlineExceeded,
    InvalidRequest,
    ModelPool,
    PoolConfig,
    Result,
)

FLOAT_MAX_INT = 2**1023  # beyond roughly this, float(int) overflows

# Prompt texts the testing backend would act on (hang, crash, sleep, ...), not echo.
FAULT_COMMANDS = frozenset(
    {
        "tokens",
        "hang",
        "stall",
        "segfault",
        "exit",
        "raise",
        "hog",
        "leak",
        "crash_once",
        "hang_once",
        "pid",
        "spin",
        "batch_raise",
        "env",
        "device",
        "device_memory",
        "detach",
    }
)
# Stable examples in CI; MODELPOOL_FUZZ_RANDOM=1 explores new ones (a nightly or local run).
DERANDOMIZE = not os.environ.get("MODELPOOL_FUZZ_RANDOM")

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=DERANDOMIZE,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

# ---- value strategies ------------------------------------------------------------------------

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
huge_ints = st.integers(min_value=FLOAT_MAX_INT, max_value=10**400) | st.integers(
    min_value=-(10**400), max_value=-FLOAT_MAX_INT
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | text
    | huge_ints
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
# Python values beyond JSON (all picklable: an unpicklable one is a known bug, tested below).
exotic = st.one_of(
    st.binary(max_size=20),
    st.tuples(scalars, scalars),
    st.frozensets(st.integers(), max_size=3),
    st.complex_numbers(allow_nan=True),
    st.decimals(allow_nan=True),
    st.datetimes(),
    st.just(Ellipsis),
    st.just(object()),
    st.builds(bytearray, st.binary(max_size=8)),
)
any_value = json_like | exotic


def _has_huge_int(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) >= FLOAT_MAX_INT
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_has_huge_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_huge_int(v) for v in value.values())
    return False


def neutral(content: str) -> str:
    """A prompt text the testing backend echoes instead of acting on."""
    command = content.partition(":")[0]
    acted_on = command in FAULT_COMMANDS or command.startswith("cuda_")
    return "echo:" + content if acted_on else content


def echoed(content: str) -> str:
    command, _, argument = content.partition(":")
    return argument if command == "echo" else content


role = st.one_of(
    st.sampled_from(["user", "system", "assistant", "tool", "", "USER"]),
    text,
    st.integers(),
    st.none(),
)
message = st.one_of(
    st.fixed_dictionaries({"role": role, "content": text.map(neutral)}),
    st.fixed_dictionaries({"role": role, "content": json_like}),
    st.dictionaries(text, json_like, max_size=3),
    json_like,
)
prompts = st.one_of(
    text.map(neutral),
    st.builds(lambda n, c: "echo:" + c * n, st.integers(0, 2_000_000), st.sampled_from("xé")),
    st.lists(message, max_size=4),
    st.lists(
        st.fixed_dictionaries({"role": st.just("user"), "content": text.map(neutral)}),
        min_size=1,
        max_size=3,
    ),
    json_like,
    exotic,
)
param_names = st.sampled_from(
    [
        "max_new_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "deadline_s",
        "do_sample",
        "top_k",
        "stream",
    ]
) | st.from_regex(r"\A[a-z_][a-z0-9_]{0,12}\Z")
edge_numbers = st.one_of(
    huge_ints,
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from([0, -1, 1, 0.5, 1.0, -0.0, 1e-300, 1e308, 2**63]),
)
params = st.one_of(
    st.dictionaries(param_names.filter(lambda name: name != "prompt"), any_value, max_size=4),
    st.dictionaries(
        st.sampled_from(["max_new_tokens", "temperature", "top_p", "deadline_s"]),
        edge_numbers,
        min_size=1,
        max_size=3,
    ),
)


def is_token_ids(prompt: Any) -> bool:
    """A non-empty list or tuple of token ids (ints in [0, 2**63)), a prompt the README
    accepts as it is."""
    return (
        isinstance(prompt, (list, tuple))
        and bool(prompt)
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in prompt)
    )


def expected_text(prompt: Any) -> str:
    if is_token_ids(prompt):
        return " ".join(str(i) for i in prompt)  # how the testing backend reads token ids
    content = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return echoed(content)


# ---- a pool for all the examples -------------------------------------------------------------


class PoolHolder:
    """One pool for all the examples; should an example kill it, the next gets a new one
    (so the culprit fails alone, and shrinking works) and ``restarts`` tells."""

    def __init__(self) -> None:
        self.pool: ModelPool | None = None
        self.restarts = 0

    def get(self) -> ModelPool:
        if self.pool is not None and self.pool.stats().state != "ready":
            self.pool.close(drain=False, timeout=5.0)
            self.pool = None
            self.restarts += 1
        if self.pool is None:
            self.pool = ModelPool(make_config(workers=2, deadline_s=20.0)).start()
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close(drain=False, timeout=5.0)


@pytest.fixture(scope="module")
def holder() -> Iterator[PoolHolder]:
    pools = PoolHolder()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture
def pool(holder: PoolHolder) -> ModelPool:
    return holder.get()


def _is_number(value: Any) -> bool:
    """A finite real number as a float can hold it (an int beyond float range is not one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not _has_huge_int(value) and math.isfinite(value)


# What the README promises to serve, checked independently of modelpool.shared.validation: a
# validator that rejected everything (or too much) must fail these tests, not pass them.
VALID_PARAMS = {
    "max_new_tokens": lambda v: (
        isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**63  # a C int64
    ),
    "temperature": lambda v: _is_number(v) and v >= 0,
    "top_p": lambda v: _is_number(v) and 0 < v <= 1,
    "deadline_s": lambda v: _is_number(v) and v > 0,
}


def certainly_valid(prompt: Any, kwargs: dict[str, Any]) -> bool:
    """A prompt and keywords the pool must serve: a string, token ids, or a non-empty list
    of plain ``{"role": non-empty str, "content": str}`` dicts; keywords (if any) among the
    documented ones with documented values."""
    if isinstance(prompt, str) or is_token_ids(prompt):
        prompt_ok = True
    else:
        prompt_ok = (
            isinstance(prompt, list)
            and bool(prompt)
            and all(
                type(m) is dict
                and set(m) == {"role", "content"}
                and isinstance(m["role"], str)
                and m["role"] != ""
                and isinstance(m["content"], str)
                for m in prompt
            )
        )
    params_ok = all(name in VALID_PARAMS and VALID_PARAMS[name](v) for name, v in kwargs.items())
    return prompt_ok and params_ok


def _call(holder: PoolHolder, prompt: Any, kwargs: dict[str, Any]) -> None:
    """One example: a certainly valid input is served with the echoed text; anything else is
    served or rejected with ``InvalidRequest`` at submit; the pool survives either way."""
    pool = holder.get()
    must_serve = certainly_valid(prompt, kwargs)
    rejection: InvalidRequest | None = None
    try:
        future = pool.submit(prompt, **kwargs)
    except InvalidRequest as exc:
        rejection = exc
    assert pool.stats().state == "ready", "the pool died"
    if rejection is not None:
        assert not must_serve, f"a valid request was rejected: {rejection}"
        return
    deadline = kwargs.get("deadline_s")
    error = future.exception(timeout=20)
    snapshot = pool.stats()
    assert snapshot.state == "ready", f"the pool died: {error!r}"
    assert snapshot.counters["crashes"] == 0, f"a worker crashed: {error!r}"
    if isinstance(error, DeadlineExceeded) and _is_number(deadline) and deadline < 5:
        return  # a tiny deadline that passed: the contract's answer
    assert error is None, repr(error)
    result = future.result()
    assert isinstance(result, Result)
    assert result.finish_reason == "stop"
    assert result.request_id == future.request_id
    assert result.text == expected_text(prompt), (result.text[:80], prompt)


def test_the_validity_oracle_tells_valid_from_invalid() -> None:
    """The oracle that decides which examples must be served is itself right."""
    assert certainly_valid("hi", {})
    assert certainly_valid([{"role": "user", "content": ""}], {"max_new_tokens": 3})
    assert certainly_valid("hi", {"temperature": 0, "top_p": 1.0, "deadline_s": 1e12})
    assert certainly_valid([0, 7], {}) and certainly_valid((1,), {})
    assert not certainly_valid([], {})
    assert not certainly_valid([-1], {}) and not certainly_valid([True], {})
    assert not certainly_valid([{"role": "", "content": "x"}], {})
    assert not certainly_valid([{"role": "user", "content": 1}], {})
    assert not certainly_valid("hi", {"max_new_tokens": True})
    assert not certainly_valid("hi", {"max_new_tokens": 2**63})
    assert not certainly_valid("hi", {"top_p": 0})
    assert not certainly_valid("hi", {"temperature": math.nan})
    assert not certainly_valid("hi", {"deadline_s": 10**400})
    assert not certainly_valid("hi", {"do_sample": True})  # not a testing-backend keyword


@SETTINGS
@given(prompt=prompts)
def test_any_prompt_is_rejected_or_served(holder: PoolHolder, prompt: Any) -> None:
    _call(holder, prompt, {})


@settings(SETTINGS, max_examples=400)
@given(
    prompt=st.lists(
        st.fixed_dictionaries({"role": st.just("user"), "content": text.map(neutral)}),
        min_size=1,
        max_size=2,
    )
    | text.map(neutral),
    kwargs=params,
)
def test_any_parameters_are_rejected_or_served(
    holder: PoolHolder, prompt: Any, kwargs: dict[str, Any]
) -> None:
    _call(holder, prompt, kwargs)


# ---- configs ---------------------------------------------------------------------------------

CONFIG_KEYS = [*sorted(PoolConfig.__dataclass_fields__), "server", "retry", "wrokers", "x-y"]
RETRY_KEYS = ["max_retries", "on", "backoff_s", "tries"]
toml_scalars = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | huge_ints
    | st.floats(allow_nan=True, allow_infinity=True)
    | text
    | st.sampled_from(["cpu", "cuda:0", "auto", "testing", "hf", "timeout", "crash", "m"])
    | st.datetimes(min_value=datetime.datetime(1900, 1, 1))
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from([*RETRY_KEYS, "max_new_tokens", "temperature", "host"]) | text,
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
NUMBER_FIELDS = [
    "deadline_s",
    "attempt_timeout_s",
    "cancel_grace_s",
    "term_grace_s",
    "startup_timeout_s",
    "stall_timeout_s",
    "max_worker_rss_mb",
    "workers",
    "spares",
    "max_queue",
    "max_requests_per_worker",
    "gpu_release_timeout_s",
]
configs = st.one_of(
    st.dictionaries(st.sampled_from(CONFIG_KEYS) | text, toml_values, max_size=8),
    st.dictionaries(st.sampled_from(NUMBER_FIELDS), edge_numbers, min_size=1, max_size=3),
    st.builds(
        lambda table: {"retry": table},
        st.dictionaries(st.sampled_from(RETRY_KEYS), toml_values | edge_numbers, max_size=3),
    ),
    st.builds(
        lambda table: {"generation_defaults": table},
        st.dictionaries(
            st.sampled_from(["max_new_tokens", "temperature", "top_p"]), edge_numbers, max_size=3
        ),
    ),
)
models = st.one_of(st.just("m"), st.just("m"), st.just("m"), st.none(), toml_scalars)


def with_model(data: dict[str, Any], model: Any) -> dict[str, Any]:
    if model is not None:
        data = {**data, "model": model}
    return data


def to_toml(data: dict[str, Any]) -> str:
    """A TOML document for ``data``: tables for top-level dicts, inline tables below."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"[{toml_key(key)}]")
            lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


def _only_value_error(load: Any) -> None:
    try:
        config = load()
    except ValueError:
        return
    assert isinstance(config, PoolConfig)


@SETTINGS
@given(data=configs, model=models)
def test_any_config_dict_gives_a_config_or_value_error(data: dict[str, Any], model: Any) -> None:
    data = with_model(data, model)
    _only_value_error(lambda: PoolConfig.from_dict(data))


@SETTINGS
@given(data=configs, model=models)
def test_any_toml_document_gives_a_config_or_value_error(
    tmp_path_factory: pytest.TempPathFactory, data: dict[str, Any], model: Any
) -> None:
    data = with_model(data, model)
    path = tmp_path_factory.mktemp("toml") / "pool.toml"
    path.write_text(to_toml(data), encoding="utf-8")
    _only_value_error(lambda: PoolConfig.from_toml(path))


@SETTINGS
@given(
    document=st.text(string.printable, max_size=200)
    | st.binary(max_size=200).map(lambda raw: raw.decode("latin-1"))
)
def test_any_text_as_toml_gives_a_config_or_value_error(
    tmp_path_factory: pytest.TempPathFactory, document: str
) -> None:
    path = tmp_path_factory.mktemp("toml") / "pool.toml"
    path.write_text(document, encoding="utf-8", errors="surrogateescape")
    _only_value_error(lambda: PoolConfig.from_toml(path))


def test_a_valid_config_round_trips_through_the_toml_writer(tmp_path: Path) -> None:
    """The writer above produces TOML the loader reads: the fuzzing reaches validation."""
    data = {
        "model": "m",
        "backend": "testing",
        "workers": 2,
        "devices": ["cpu"],
        "retry": {"max_retries": 1, "on": ["timeout"]},
        "generation_defaults": {"max_new_tokens": 4, "temperature": 0.5},
    }
    path = tmp_path / "pool.toml"
    path.write_text(to_toml(data), encoding="utf-8")
    config = PoolConfig.from_toml(path)
    assert config.workers == 2 and config.retry.on == ("timeout",)


# ---- bugs this fuzzing found, one focused test each ------------------------------------------
# Fixed: ints beyond float range raised OverflowError from validation and config; an
# unpicklable parameter crashed the dispatcher thread (and the pool with it); a deadline
# beyond 2**31 ms overflowed the selector timeout and crashed the dispatcher.
# retry.on that is not a list raised TypeError instead of ValueError.


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 10**400}, {"top_p": -(10**400)}, {"deadline_s": 10**400}]
)
def test_huge_numbers_are_invalid_requests(pool: ModelPool, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        pool.submit("echo:x", **kwargs)


def test_huge_number_in_toml_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text('model = "m"\ndeadline_s = 1' + "0" * 400 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="deadline_s"):
        PoolConfig.from_toml(path)


def test_retry_on_not_a_list_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text('model = "m"\n[retry]\non = 5\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"retry\.on"):
        PoolConfig.from_toml(path)


def test_unpicklable_parameter_is_rejected_and_the_pool_survives() -> None:
    with open_pool(workers=1, deadline_s=5.0) as fresh:
        with pytest.raises(InvalidRequest, match="cannot be sent to a worker"):
            fresh.submit("echo:x", stop=threading.Lock())
        assert fresh.stats().counters["submitted"] == 0
        assert fresh.generate("echo:alive", deadline_s=5).text == "alive"
        assert fresh.stats().state == "ready"


@pytest.mark.parametrize("deadline_s", [2.2e6, 1e12, 1e308])
def test_long_deadline_is_served_and_does_not_crash_the_pool(deadline_s: float) -> None:
    """Any finite deadline > 0 is valid (the docs); the ones beyond the selector's range
    crashed the dispatcher once."""
    with open_pool(workers=1, deadline_s=5.0) as fresh:
        assert fresh.submit("echo:x", deadline_s=deadline_s).result(timeout=10).text == "x"
        assert fresh.generate("echo:y").text == "y"
        assert fresh.stats().state == "ready"
