"""Structured outputs, the supervisor's side: every form a caller asks for one in, turned
into one grammar text for the worker (``params["grammar"]``, see :mod:`modelpool.shared.grammar`),
and checked before anything is dispatched.

Forms taken (the library's ``response_format=`` takes the first three, the HTTP routes all
but the pydantic class)::

    {"type": "json_object"}                                   any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    {"type": "object", "properties": {...}}                   a bare JSON schema (library)
    SomePydanticModel                                         its model_json_schema() (library)
    "structured_outputs": {"json" | "regex" | "choice" | "grammar": ...}   vLLM's extension
    "guided_json" / "guided_regex" / "guided_choice" / "guided_grammar"     vLLM's older fields

The grammar engine is llguidance. Its validation needs no tokenizer and takes about a
millisecond for the usual schema (p50 1.2 ms, p99 57 ms over JSONSchemaBench's 9,557 on a
loaded 2-core machine), so it runs here, before dispatch: a schema the engine cannot
honour (a keyword it does not implement, an unknown ``format``, a ``$ref`` that points
nowhere, a regex with look-around) is a :class:`~modelpool.shared.errors.GrammarError` whose
``param`` points at the keyword (``response_format.json_schema.schema.properties.x
.format``), never a 500 from a worker and never a keyword silently ignored.

Checking is bounded in work, so that it is bounded in time: a schema of more than
``MAX_SCHEMA_NODES`` subschemas, an ``allOf`` whose ``anyOf``/``oneOf`` branches combine
into more than ``MAX_ALLOF_BRANCHES`` alternatives (the engine intersects every
combination), a choice of more than ``MAX_CHOICE_ITEMS`` strings or a grammar of more
than ``MAX_GRAMMAR_BYTES`` is refused with :class:`~modelpool.shared.errors.SchemaTooComplex`
naming the bound, before the engine runs on it; the engine runs with its own limits.

The daemon runs a request's checks in its own bounded check threads, inline
(:func:`checked_inline`): there a request's checks together get ``CHECK_BOUND_S``, past
which the rest is refused (``check_seconds``). A library caller, which may be an event
loop, gets the engine's verdict from one of two helper threads (llguidance releases the
GIL) and waits ``VALIDATE_BOUND_S`` for it; past it, or with more checks in flight than
the helpers take, the request goes on unchecked and the worker's compilation, off its
decoding loop and within ``grammar_compile_timeout_s``, decides (a refusal from there is a
``GrammarError`` too, without the path).

JSON is generated compact (no free whitespace between tokens, unless the schema's own
``x-guidance`` says otherwise): a model cannot then pad an answer with whitespace until it
runs out of tokens.
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from modelpool.shared.errors import GrammarError, SchemaTooComplex
from modelpool.shared.grammar import COMPILE_TIMEOUT_PARAM, GRAMMAR_PARAM, import_llguidance

T = TypeVar("T")

VALIDATE_BOUND_S = 0.1
_VALIDATOR_THREADS = 2
_VALIDATORS = ThreadPoolExecutor(_VALIDATOR_THREADS, thread_name_prefix="modelpool-grammar-check")
# Library checks in flight (running or queued on the helpers); past twice the helpers,
# a check is skipped rather than queued: the queue would otherwise grow without bound.
_in_flight = 0
_in_flight_lock = threading.Lock()

# The bounds on the work of one check (SchemaTooComplex names the one passed).
MAX_SCHEMA_NODES = 2_000
MAX_ALLOF_BRANCHES = 256
# The engine's own bound on the alternatives of one grammar row (max_items_in_row).
MAX_CHOICE_ITEMS = 2_000
MAX_GRAMMAR_BYTES = 262_144
# A request's checks together, in the daemon's check threads.
CHECK_BOUND_S = 2.0
# Patterns tried one by one to say which one the engine refused; past that many, the
# refusal names the schema, not the pattern.
MAX_LOCATED_PATTERNS = 32
# When the current check must be done by (time.monotonic()), inside checked_inline.
_check_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "modelpool_check_deadline", default=None
)
_COMPACT = {"whitespace_flexible": False}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

# Keywords whose value is one subschema, a map of them, or a list of them.
_ONE_SCHEMA = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


# ---- the library's response_format ------------------------------------------------------------


def grammar_for_response_format(value: object, *, param: str = "response_format") -> str | None:
    """Grammar text for ``response_format`` in any of its forms; None for plain text."""
    if value is None:
        return None
    if isinstance(value, type) and callable(getattr(value, "model_json_schema", None)):
        schema = getattr(value, "model_json_schema")()  # noqa: B009 (mypy: a type has none)
        return json_schema_grammar(schema, param=f"{param}.model_json_schema()")
    if not isinstance(value, Mapping):
        raise GrammarError(
            f"{param} must be an object (OpenAI's response_format, a JSON schema) or a "
            f"pydantic model class, got {type(value).__name__}",
            param=param,
        )
    kind = value.get("type")
    if kind == "text":
        _only_keys(value, ("type",), param)
        return None
    if kind == "json_object":
        _only_keys(value, ("type",), param)
        return json_schema_grammar(ANY_JSON_OBJECT, param=param)
    if kind == "json_schema":
        _only_keys(value, ("type", "json_schema"), param)
        spec = value.get("json_schema")
        where = f"{param}.json_schema"
        if not isinstance(spec, Mapping):
            raise GrammarError(f"{where} must be an object with a 'schema'", param=where)
        _only_keys(spec, ("name", "schema", "strict", "description"), where)
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError(f"{where}.name must be a string", param=f"{where}.name")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(f"{where}.strict must be true or false", param=f"{where}.strict")
        # OpenAI's schema is optional: without one, any JSON object.
        schema = spec.get("schema", ANY_JSON_OBJECT)
        return json_schema_grammar(schema, param=f"{where}.schema")
    if _looks_like_a_schema(value):
        return json_schema_grammar(value, param=param)
    raise GrammarError(
        f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param=f"{param}.type",
    )


def constrain(gen_kwargs: dict[str, Any], compile_timeout_s: float) -> dict[str, Any]:
    """A library request's keyword arguments with ``response_format`` (any of its forms)
    or a raw ``grammar`` turned into the checked ``grammar`` parameter and its compilation
    bound; unchanged (the same dict) when the request asks for neither."""
    if "response_format" not in gen_kwargs and gen_kwargs.get(GRAMMAR_PARAM) is None:
        return gen_kwargs
    params = dict(gen_kwargs)
    response_format = params.pop("response_format", None)
    grammar = params.get(GRAMMAR_PARAM)
    if response_format is not None:
        if grammar is not None:
            raise GrammarError("give response_format or grammar, not both", param="response_format")
        grammar = grammar_for_response_format(response_format)
    elif grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"{GRAMMAR_PARAM} must be grammar text", param=GRAMMAR_PARAM)
        check_grammar(grammar, GRAMMAR_PARAM)
    if grammar is None:
        params.pop(GRAMMAR_PARAM, None)
        return params
    params[GRAMMAR_PARAM] = grammar
    params.setdefault(COMPILE_TIMEOUT_PARAM, compile_timeout_s)
    return params


# ---- the HTTP bodies ---------------------------------------------------------------------------


def grammar_for_body(body: Mapping[str, Any]) -> str | None:
    """Grammar text for an OpenAI request body (either route): ``response_format``, vLLM's
    ``structured_outputs`` or its older ``guided_*`` fields, at most one of them."""
    given = [
        name
        for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
        if body.get(name) is not None and body.get(name) != {"type": "text"}
    ]
    if len(given) > 1:
        raise GrammarError(
            f"only one structured-output field at a time, got {', '.join(given)}",
            param=given[1],
        )
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, Mapping) else None
        if kind not in ("json_object", "json_schema"):
            raise GrammarError(
                "response_format.type must be 'text', 'json_object' or 'json_schema'",
                param="response_format.type",
            )
        return grammar_for_response_format(value)
    if name == "structured_outputs":
        return grammar_for_structured_outputs(value)
    return _structured_kind(name.removeprefix("guided_"), value, param=name)


def grammar_for_structured_outputs(value: object, *, param: str = "structured_outputs") -> str:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object."""
    if not isinstance(value, Mapping):
        raise GrammarError(f"{param} must be an object", param=param)
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS))
    if unknown:
        raise GrammarError(
            f"{param}.{unknown[0]} is not supported (supported: {', '.join(_STRUCTURED_KINDS)})",
            param=f"{param}.{unknown[0]}",
        )
    kinds = [kind for kind in _STRUCTURED_KINDS if value.get(kind) not in (None, False)]
    if len(kinds) != 1:
        raise GrammarError(
            f"{param} must set exactly one of {', '.join(_STRUCTURED_KINDS)}", param=param
        )
    return _structured_kind(kinds[0], value[kinds[0]], param=f"{param}.{kinds[0]}")


def _structured_kind(kind: str, value: object, *, param: str) -> str:
    llguidance = import_llguidance()
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT, param=param)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise GrammarError(f"{param} is not valid JSON: {exc}", param=param) from exc
        return json_schema_grammar(value, param=param)
    if kind == "regex":
        if not isinstance(value, str):
            raise GrammarError(f"{param} must be a regular expression string", param=param)
        try:
            text = f"start: /{llguidance.regex_to_lark(value, '')}/"
        except ValueError as exc:
            raise GrammarError(f"{param}: {exc}", param=param) from exc
        return check_grammar(text, param=param)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(item, str) for item in value)
        ):
            raise GrammarError(f"{param} must be a non-empty list of strings", param=param)
        if len(value) > MAX_CHOICE_ITEMS:
            raise SchemaTooComplex(
                f"{param}: {len(value)} choices, more than {MAX_CHOICE_ITEMS} (choices)",
                bound="choices",
                param=param,
            )
        return check_grammar("start: " + " | ".join(json.dumps(item) for item in value), param)
    if not isinstance(value, str) or not value.strip():
        raise GrammarError(f"{param} must be grammar text (Lark or GBNF)", param=param)
    try:
        text = llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise GrammarError(f"{param}: {exc}", param=param) from exc
    return check_grammar(text, param=param)


# ---- JSON schemas ----------------------------------------------------------------------------


def json_schema_grammar_fragment(schema: object, *, param: str) -> str:
    """``%json {...}``: ``schema`` as an llguidance grammar expression, checked, for use as
    the right-hand side of a rule in a bigger grammar (a tool call's arguments, say).
    Raises GrammarError naming the keyword and its path under ``param``."""
    if not isinstance(schema, Mapping) and not isinstance(schema, bool):
        raise GrammarError(f"{param} must be a JSON schema (an object)", param=param)
    compact: Any = schema
    if isinstance(schema, Mapping):
        _check_bounds(schema, param)  # before any other walk of it
        options = dict(_COMPACT)
        if _one_of_is_discriminated(schema):
            # Each branch fixes the discriminator to its own value: no output can match two
            # branches, so oneOf means anyOf here (pydantic writes unions with a
            # discriminator this way).
            options["coerce_one_of"] = True
        given = schema.get("x-guidance")
        compact = {
            **schema,
            "x-guidance": {**options, **(given if isinstance(given, Mapping) else {})},
        }
    try:
        text = json.dumps(compact, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"{param} is not JSON: {exc!r:.200}", param=param) from exc
    fragment = f"%json {text}"
    _check_schema(f"start: {fragment}", schema, param)
    return fragment


def json_schema_grammar(schema: object, *, param: str) -> str:
    """A whole grammar that generates one JSON value valid under ``schema`` (checked)."""
    return "start: " + json_schema_grammar_fragment(schema, param=param)


def checked_inline(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` with its grammar checks run here, in the calling thread, within
    ``CHECK_BOUND_S`` together: for a caller that is itself a bounded check thread."""
    token = _check_deadline.set(time.monotonic() + CHECK_BOUND_S)
    try:
        return work(*args)
    finally:
        _check_deadline.reset(token)


def _limits() -> Any:
    # No parser state or grammar text in the messages: they are a client's answer.
    return import_llguidance().LLParserLimits(verbose_errors=False)


def _validate(text: str, param: str) -> tuple[bool, list[str]] | None:
    """llguidance's verdict on ``text`` (failed, messages), or None when a library
    caller would wait longer than VALIDATE_BOUND_S (the worker's bounded compilation
    decides then)."""
    global _in_flight
    if len(text) > MAX_GRAMMAR_BYTES:
        raise SchemaTooComplex(
            f"{param}: the grammar is {len(text)} bytes, more than the {MAX_GRAMMAR_BYTES} "
            "checked (grammar_bytes)",
            bound="grammar_bytes",
            param=param,
        )
    llguidance = import_llguidance()
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    deadline = _check_deadline.get()
    if deadline is not None:
        if time.monotonic() > deadline:
            raise SchemaTooComplex(
                f"{param}: the request's structured-output checks took more than "
                f"{CHECK_BOUND_S:g} s together (check_seconds)",
                bound="check_seconds",
                param=param,
            )
        failed, messages = validate(text, limits=_limits())
        return bool(failed), list(messages)
    with _in_flight_lock:
        if _in_flight >= 2 * _VALIDATOR_THREADS:
            return None
        _in_flight += 1

    def run() -> tuple[bool, list[str]]:
        global _in_flight
        try:
            failed, messages = validate(text, limits=_limits())
            return bool(failed), list(messages)
        finally:
            with _in_flight_lock:
                _in_flight -= 1

    verdict = _VALIDATORS.submit(run)
    try:
        return verdict.result(timeout=VALIDATE_BOUND_S)
    except FutureTimeout:
        return None


def _check_bounds(schema: object, param: str) -> None:
    """SchemaTooComplex past MAX_SCHEMA_NODES subschemas or MAX_ALLOF_BRANCHES
    combinations in one ``allOf``: found by a walk that stops at the bound."""
    for count, (where, subschema) in enumerate(_subschemas(schema, []), start=1):
        path = param + "".join(f".{part}" for part in where)
        if count > MAX_SCHEMA_NODES:
            raise SchemaTooComplex(
                f"{param}: the schema has more than {MAX_SCHEMA_NODES} subschemas (schema_nodes)",
                bound="schema_nodes",
                param=param,
            )
        parts = subschema.get("allOf")
        if not isinstance(parts, list):
            continue
        combinations = 1
        for part in parts:
            if isinstance(part, Mapping):
                for keyword in ("anyOf", "oneOf"):
                    branches = part.get(keyword)
                    if isinstance(branches, list) and branches:
                        combinations *= len(branches)
            if combinations > MAX_ALLOF_BRANCHES:
                raise SchemaTooComplex(
                    f"{path}.allOf: its anyOf/oneOf branches combine into more than "
                    f"{MAX_ALLOF_BRANCHES} alternatives, each of which the grammar engine "
                    "would intersect (allof_branches)",
                    bound="allof_branches",
                    param=f"{path}.allOf",
                )


def check_grammar(text: str, param: str = "grammar") -> str:
    """``text`` unless llguidance refuses it as a grammar (GrammarError at ``param``)."""
    verdict = _validate(text, param)
    if verdict is None:
        return text
    failed, messages = verdict
    # A special token (a tool call's marker, ``<[id]>``) is checked where the tokenizer
    # is: the worker's compilation.
    messages = [m for m in messages if not m.startswith(_NO_TOKENIZER)]
    if failed or messages:
        raise GrammarError(f"{param}: {_first_line(messages)}", param=param)
    return text


_NO_TOKENIZER = "no tokenizer - can't validate"


def _check_schema(text: str, schema: object, param: str) -> None:
    verdict = _validate(text, param)
    if verdict is None:
        return
    failed, messages = verdict
    if not failed and not messages:
        return
    message = _engine_message(messages)
    where, keyword = _locate(schema, message)
    path = param + "".join(f".{part}" for part in where)
    if keyword is not None:
        path = f"{path}.{keyword}"
        raise GrammarError(
            f"{path}: the grammar engine cannot honour {keyword!r}: {message}",
            param=path,
            keyword=keyword,
        )
    raise GrammarError(
        f"{param}: the grammar engine cannot honour this schema: {message}", param=param
    )


def _engine_message(messages: list[str]) -> str:
    """llguidance's message without its grammar-text excerpt."""
    text = _first_line(messages)
    return text.removeprefix("at 1(8): ").removeprefix("failed to compile JSON schema: ")


def _first_line(messages: list[str]) -> str:
    """The message on one line, without the excerpt of grammar text llguidance appends."""
    lines = []
    for line in (messages[0] if messages else "invalid grammar").strip().splitlines():
        if _EXCERPT_LINE.match(line):
            break
        if line.strip() and set(line.strip()) != {"^"}:
            lines.append(line.strip())
    return " ".join(lines)


_EXCERPT_LINE = re.compile(r"^\s+\d+ \|")


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
# llguidance's messages that name a keyword without saying where it is.
_KEYWORD_MESSAGES = (
    ("oneOf constraints are not supported", "oneOf"),
    ("min/maxProperties only supported", "minProperties"),
    ("min/maxProperties only supported", "maxProperties"),
    ("patternProperty regexes", "patternProperties"),
    ("circular references with sibling keys", "$ref"),
    ("is not present in a registry", "$ref"),
)
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (.+)$")
_MISSING_POINTER = re.compile(r"Pointer '(.*)' does not exist")


def _locate(schema: object, message: str) -> tuple[list[str], str | None]:
    """Where in ``schema`` the keyword ``message`` complains about is: (path, keyword), or
    ([], None) when the message names none."""
    matchers: list[tuple[str, Any]] = []
    if match := _UNIMPLEMENTED.search(message):
        for key in json.loads(f"[{match.group(1)}]"):
            matchers.append((key, lambda sub, key=key: key in sub))
    elif match := _UNKNOWN_FORMAT.search(message):
        name = match.group(1).strip()
        matchers.append(("format", lambda sub: sub.get("format") == name))
    elif match := _MISSING_POINTER.search(message):
        ref = "#" + match.group(1)
        matchers.append(("$ref", lambda sub: sub.get("$ref") == ref))
    elif "regex" in message:
        tried = [0]

        def bad_pattern(sub: Mapping[str, Any]) -> bool:
            if not isinstance(sub.get("pattern"), str) or tried[0] >= MAX_LOCATED_PATTERNS:
                return False
            tried[0] += 1
            return _bad_pattern(sub["pattern"])

        matchers.append(("pattern", bad_pattern))
    else:
        for text, key in _KEYWORD_MESSAGES:
            if text in message:
                matchers.append((key, lambda sub, key=key: key in sub))
    for keyword, found in matchers:
        for where, subschema in _subschemas(schema, []):
            if found(subschema):
                return where, keyword
    return [], None


def _one_of_is_discriminated(schema: object) -> bool:
    """Does every ``oneOf`` in ``schema`` come with an OpenAPI ``discriminator``?"""
    one_ofs = [sub for _, sub in _subschemas(schema, []) if "oneOf" in sub]
    return bool(one_ofs) and all("discriminator" in sub for sub in one_ofs)


def _bad_pattern(pattern: object) -> bool:
    if not isinstance(pattern, str):
        return False
    llguidance = import_llguidance()
    text = "start: %json " + json.dumps({"type": "string", "pattern": pattern})
    failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=_limits())
    return bool(failed)


def _subschemas(schema: object, where: list[str]) -> Iterator[tuple[list[str], Mapping[str, Any]]]:
    """Every subschema of ``schema`` with its path, depth first, the schema itself first
    (a stack rather than recursion: a schema may nest deeper than Python recurses)."""
    stack: list[tuple[list[str], object]] = [(where, schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, Mapping):
            continue
        yield path, node
        children: list[tuple[list[str], object]] = []
        for keyword in _ONE_SCHEMA:
            if isinstance(node.get(keyword), Mapping):
                children.append(([*path, keyword], node[keyword]))
        for keyword in _SCHEMA_MAPS:
            named = node.get(keyword)
            if isinstance(named, Mapping):
                children += [([*path, keyword, str(name)], child) for name, child in named.items()]
        for keyword in _SCHEMA_LISTS:
            listed = node.get(keyword)
            if isinstance(listed, list):
                children += [
                    ([*path, f"{keyword}[{index}]"], child) for index, child in enumerate(listed)
                ]
        stack.extend(reversed(children))


_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def _looks_like_a_schema(value: Mapping[str, Any]) -> bool:
    kind = value.get("type", "object")
    if isinstance(kind, str):
        return kind in _JSON_TYPES
    return isinstance(kind, list)  # {"type": ["string", "null"]}


def _only_keys(value: Mapping[str, Any], allowed: tuple[str, ...], param: str) -> None:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise GrammarError(
            f"{param}.{unknown[0]} is not supported here", param=f"{param}.{unknown[0]}"
        )
