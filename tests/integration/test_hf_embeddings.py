"""The hf backend's pooling models (``backends/hf/pooling.py``): tiny random
sentence-transformers directories and a cross-encoder (``tests/embedding_models.py``),
compared with sentence-transformers itself, in process and through real workers.

The packaged all-MiniLM-L6-v2 is in ``test_embedded_minilm.py``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from embedding_models import MAX_SEQ_LENGTH, build_cross_encoder, build_embedding_model
from helpers import FakeCall
from modelpool import ContextLengthExceeded, InvalidRequest, ModelPool, PoolConfig, WrongTask
from modelpool.shared.protocol import EmbedRequest, Generation, ScoreRequest
from modelpool.worker.backends.hf import load
from modelpool.worker.backends.hf.pooling import PoolingHandler, pooling_task, read_layout

sentence_transformers = pytest.importorskip("sentence_transformers")

TEXTS = [
    "hello world",
    "the capital of france is paris",
    "a",
    "banana fruit yellow " * 8,
    "  Mixed Case text!  ",
    "cat dog animal",
]


def _cosines(first: list[list[float]], second: Any) -> list[float]:
    result = []
    for mine, theirs in zip(first, second.tolist(), strict=True):
        dot = sum(a * b for a, b in zip(mine, theirs, strict=True))
        norms = math.sqrt(sum(a * a for a in mine) * sum(b * b for b in theirs))
        result.append(dot / norms)
    return result


def _pooling(path: Path, **options: Any) -> PoolingHandler:
    handler = load(str(path), **options)
    assert isinstance(handler, PoolingHandler)
    return handler


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pooling-models")


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "lasttoken", "mean_sqrt_len"])
@pytest.mark.parametrize("normalize", [True, False])
def test_vectors_equal_sentence_transformers(models: Path, mode: Any, normalize: bool) -> None:
    path = build_embedding_model(models / f"st-{mode}-{normalize}", mode=mode, normalize=normalize)
    assert pooling_task(str(path)) == "embed"
    assert read_layout(path).modes == (mode,)
    handler = _pooling(path)
    assert handler.task == "embed" and handler.max_model_len == MAX_SEQ_LENGTH
    answer = handler.embed(EmbedRequest(tuple(TEXTS)), FakeCall(""))
    assert answer.pooled is not None and answer.pooled.vectors is not None
    reference = sentence_transformers.SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    assert min(_cosines(answer.pooled.vectors, reference)) >= 0.9999
    for mine, theirs in zip(answer.pooled.vectors, reference.tolist(), strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)


def test_micro_batches_pack_by_tokens_and_keep_input_order(models: Path) -> None:
    path = build_embedding_model(models / "st-mean-True")
    whole = _pooling(path).embed(EmbedRequest(tuple(TEXTS)), FakeCall(""))
    packed = _pooling(path, batch_tokens=20)
    batches = packed._micro_batches(packed._features(TEXTS, False))
    widths = [len(packed._features([TEXTS[i]], False)[0]["input_ids"]) for i in range(6)]
    # Longest first; every batch's rows x widest row within the budget (or one row alone).
    assert batches[0] == [widths.index(max(widths))]
    assert all(len(batch) == 1 or widths[batch[0]] * len(batch) <= 20 for batch in batches)
    assert len(batches) > 1 and sorted(i for b in batches for i in b) == list(range(6))
    split = packed.embed(EmbedRequest(tuple(TEXTS)), FakeCall(""))
    assert split.pooled is not None and whole.pooled is not None
    for mine, theirs in zip(split.pooled.vectors or [], whole.pooled.vectors or [], strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)


def test_cancel_is_read_between_micro_batches(models: Path) -> None:
    handler = _pooling(build_embedding_model(models / "st-mean-True"), batch_tokens=1)
    call = FakeCall("", flag=True)
    answer = handler.embed(EmbedRequest(tuple(TEXTS)), call)
    assert answer.finish_reason == "cancelled" and call.checks_after_cancel == 1


def test_context_truncate_token_ids_and_dimensions(models: Path) -> None:
    handler = _pooling(build_embedding_model(models / "st-mean-True"))
    long_text = "paris " * 100
    with pytest.raises(ContextLengthExceeded, match=r"input\[1\]") as caught:
        handler.embed(EmbedRequest(("short", long_text)), FakeCall(""))
    assert caught.value.max_model_len == MAX_SEQ_LENGTH
    cut = handler.embed(EmbedRequest(("short", long_text), truncate=True), FakeCall(""))
    reference = sentence_transformers.SentenceTransformer(
        str(models / "st-mean-True"), device="cpu"
    ).encode(["short", long_text])
    assert cut.pooled is not None and cut.pooled.vectors is not None
    assert min(_cosines(cut.pooled.vectors, reference)) >= 0.9999
    ids = tuple(handler.tokenize("hello world"))
    by_ids = handler.embed(EmbedRequest((ids,)), FakeCall(""))
    by_text = handler.embed(EmbedRequest(("hello world",)), FakeCall(""))
    assert by_ids.pooled == by_text.pooled and by_ids.prompt_tokens == len(ids)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        handler.embed(EmbedRequest(((10**6,),)), FakeCall(""))
    small = handler.embed(EmbedRequest(("hello world",), dimensions=8), FakeCall(""))
    assert small.pooled is not None and small.pooled.vectors is not None
    vector = small.pooled.vectors[0]
    assert len(vector) == 8 and math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-5)
    with pytest.raises(InvalidRequest, match="dimensions"):
        handler.embed(EmbedRequest(("x",), dimensions=33), FakeCall(""))


def test_cross_encoder_scores_equal_sentence_transformers(models: Path) -> None:
    path = build_cross_encoder(models / "cross-encoder")
    assert pooling_task(str(path)) == "score"
    handler = _pooling(path)
    assert handler.task == "score"
    documents = ("paris is the capital", "bananas", "the capital of france is paris, a city")
    scored = handler.score(ScoreRequest("capital of france", documents), FakeCall(""))
    raw = handler.score(ScoreRequest("capital of france", documents, True), FakeCall(""))
    reference = sentence_transformers.CrossEncoder(str(path), device="cpu")
    expected = reference.predict([("capital of france", d) for d in documents]).tolist()
    assert scored.pooled is not None and raw.pooled is not None
    assert scored.pooled.method == "cross-encoder"
    assert scored.pooled.scores == pytest.approx(expected, abs=1e-6)
    assert [1 / (1 + math.exp(-s)) for s in raw.pooled.scores or []] == pytest.approx(expected)


def test_unsupported_modules_are_refused_by_name(tmp_path: Path, models: Path) -> None:
    import json
    import shutil

    path = tmp_path / "with-dense"
    shutil.copytree(build_embedding_model(models / "st-mean-True"), path)
    modules = json.loads((path / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        load(str(path))


@pytest.mark.slow
def test_pools_of_an_embedding_model_and_a_cross_encoder(models: Path) -> None:
    """Through real workers, with no setting but the directory."""
    embedding = build_embedding_model(models / "st-mean-True")
    with ModelPool(PoolConfig(model=str(embedding), workers=1, devices=["cpu"])) as pool:
        assert pool.task == "embed" and pool.stats().task == "embed"
        assert pool.stats().max_model_len == MAX_SEQ_LENGTH
        result = pool.embed(TEXTS)
        reference = sentence_transformers.SentenceTransformer(str(embedding), device="cpu")
        assert min(_cosines(result.vectors, reference.encode(TEXTS))) >= 0.9999
        assert result.dimensions == 32 and result.prompt_tokens > len(TEXTS)
        assert pool.score("capital of france", ["paris", "banana"]).method == "cosine"
        with pytest.raises(WrongTask):
            pool.generate("hello")
        with pytest.raises(ContextLengthExceeded):
            pool.embed("paris " * 100)
        assert len(pool.tokenize("hello world")) == 4
    cross = build_cross_encoder(models / "cross-encoder")
    with ModelPool(PoolConfig(model=str(cross), workers=1, devices=["cpu"])) as pool:
        assert pool.task == "score"
        scored = pool.score("capital of france", ["paris is the capital", "bananas"])
        assert scored.method == "cross-encoder" and len(scored.scores) == 2
        with pytest.raises(WrongTask, match="embed"):
            pool.embed("text")


@dataclass(eq=False)
class _PoolingCall(FakeCall):
    """The worker's PoolingCall as a batched backend sees it: a call with its request."""

    request: EmbedRequest | ScoreRequest | None = None


def test_one_step_embeds_every_admitted_request_as_it_would_alone(models: Path) -> None:
    handler = _pooling(build_embedding_model(models / "st-mean-True"), batch_tokens=64)
    requests = [
        EmbedRequest((TEXTS[0],)),
        EmbedRequest(tuple(TEXTS[1:4]), dimensions=16),
        ScoreRequest("capital of france", (TEXTS[1], TEXTS[5])),
        EmbedRequest((TEXTS[4],)),
    ]
    alone = [
        (handler.embed if isinstance(r, EmbedRequest) else handler.score)(r, FakeCall(""))  # type: ignore[arg-type]
        for r in requests
    ]
    calls = [_PoolingCall("", request=request) for request in requests]
    cancelled = _PoolingCall("", flag=True, request=EmbedRequest(tuple(TEXTS)))
    for call in (*calls[:2], cancelled, *calls[2:]):
        handler.admit(call)
    finished = handler.step()
    order = [*calls[:2], cancelled, *calls[2:]]
    assert all(call is want for (call, _), want in zip(finished, order, strict=True))
    answers = [outcome for _, outcome in finished]
    assert isinstance(answers[2], Generation) and answers[2].finish_reason == "cancelled"
    for answer, solo in zip(answers[:2] + answers[3:], alone, strict=True):
        assert isinstance(answer, Generation) and answer.pooled is not None
        assert solo.pooled is not None and answer.prompt_tokens == solo.prompt_tokens
        mine = answer.pooled.vectors or [answer.pooled.scores]
        theirs = solo.pooled.vectors or [solo.pooled.scores]
        for row, solo_row in zip(mine, theirs, strict=True):
            assert row == pytest.approx(solo_row, abs=1e-5)
    assert handler.step() == []


def test_a_bad_request_is_refused_at_admission_alone(models: Path) -> None:
    handler = _pooling(build_embedding_model(models / "st-mean-True"))
    good = _PoolingCall("", request=EmbedRequest(("fine",)))
    handler.admit(good)
    with pytest.raises(ContextLengthExceeded):
        handler.admit(_PoolingCall("", request=EmbedRequest(("paris " * 100,))))
    with pytest.raises(InvalidRequest):
        handler.admit(_PoolingCall("", request=EmbedRequest(("x",), dimensions=10_000)))
    assert [call is good for call, _ in handler.step()] == [True]


@pytest.mark.slow
def test_concurrent_clients_batch_in_a_real_worker(models: Path) -> None:
    embedding = build_embedding_model(models / "st-mean-True")
    config = PoolConfig(model=str(embedding), workers=1, max_batch_size=8, devices=["cpu"])
    with ModelPool(config) as pool, ThreadPoolExecutor(8) as executor:
        assert pool.stats().capacity == 8
        solo = [pool.embed(text).vectors[0] for text in TEXTS]
        together = list(executor.map(lambda text: pool.embed(text).vectors[0], TEXTS * 3))
        for mine, theirs in zip(together, solo * 3, strict=True):
            assert mine == pytest.approx(theirs, abs=1e-5)
        assert pool.stats().counters["completed"] == len(TEXTS) * 4


@dataclass(eq=False)
class _CancelledAtRead(_PoolingCall):
    """A call whose cancel flag reads set from its ``at``-th read on (0: never), counting
    its reads."""

    at: int = 0
    reads: int = 0

    def cancelled(self) -> bool:
        self.reads += 1
        return 0 < self.at <= self.reads


def test_cancel_is_read_before_each_layer_and_stops_the_pass(models: Path) -> None:
    """One micro-batch (the default ``batch_tokens`` holds all of TEXTS): its flag is read
    once before it and once before each of the model's two layers; set at the first layer,
    the pass stops there, where the between-batch read alone would have answered it."""
    handler = _pooling(build_embedding_model(models / "st-mean-True"))
    assert len(handler._micro_batches(handler._features(TEXTS, False))) == 1
    whole = _CancelledAtRead("")
    assert handler.embed(EmbedRequest(tuple(TEXTS)), whole).finish_reason == "stop"
    assert whole.reads == 1 + 2
    stopped = _CancelledAtRead("", at=2)
    assert handler.embed(EmbedRequest(tuple(TEXTS)), stopped).finish_reason == "cancelled"
    assert stopped.reads == 2
    cross = _pooling(build_cross_encoder(models / "cross-encoder"))
    scored = _CancelledAtRead("", at=3)
    answer = cross.score(ScoreRequest("capital of france", tuple(TEXTS)), scored)
    assert answer.finish_reason == "cancelled" and scored.reads == 3


def test_layer_reads_change_no_answer_and_a_shared_pass_stops_only_for_all(
    models: Path,
) -> None:
    handler = _pooling(build_embedding_model(models / "st-mean-True"))
    request = EmbedRequest(tuple(TEXTS))
    read = handler.embed(request, FakeCall(""))
    for layer in handler._layer_stops.layers:
        layer._forward_pre_hooks.clear()
    unhooked = handler.embed(request, FakeCall(""))
    assert read.pooled is not None and read.pooled == unhooked.pooled
    # Two requests in one pass: the first cancelled at its first layer read, the other not.
    handler = _pooling(build_embedding_model(models / "st-mean-True"))
    leaving = _CancelledAtRead("", at=2, request=EmbedRequest(tuple(TEXTS[:3])))
    staying = _CancelledAtRead("", request=EmbedRequest(tuple(TEXTS[3:])))
    handler.admit(leaving)
    handler.admit(staying)
    _, (_, second) = handler.step()
    assert isinstance(second, Generation) and second.finish_reason == "stop"
    alone = handler.embed(EmbedRequest(tuple(TEXTS[3:])), FakeCall(""))
    assert second.pooled is not None and alone.pooled is not None
    for row, solo_row in zip(second.pooled.vectors or [], alone.pooled.vectors or [], strict=True):
        assert row == pytest.approx(solo_row, abs=1e-6)
    # The pass went on for the request still wanted: each layer read both flags.
    assert staying.reads == 1 + 2 and leaving.reads == 1 + 2


@pytest.mark.slow
def test_a_deadline_mid_pass_stops_between_layers_and_keeps_the_worker(models: Path) -> None:
    """Issue 58: a deadline cancelled a pooling run that stopped only between micro-batches,
    so one pass longer than ``cancel_grace_s`` got its worker killed. Here one micro-batch
    of 24 rows takes 64 layers x ``SLOW_POOLING_LAYER_S`` (each layer sleeps: a lower bound
    whatever the load), many times the deadline plus the grace: it ends with its deadline
    error, the worker stays (no kill, same pid) and answers as before."""
    from helpers import make_config, slack, wait_idle, workers
    from modelpool.shared.errors import DeadlineExceeded
    from reliability_backends import SLOW_POOLING_LAYER_S, SLOW_POOLING_ROWS

    layers, deadline_s, grace_s = 64, 0.5, slack(0.5)
    inputs = tuple(TEXTS * 4)
    assert len(inputs) > SLOW_POOLING_ROWS
    assert layers * SLOW_POOLING_LAYER_S > 2 * (deadline_s + grace_s), "false premise"
    deep = build_embedding_model(models / "st-deep", layers=layers)
    config = make_config(
        model=str(deep),
        backend="reliability_backends:slow_pooling",
        backend_options={"torch_threads": 1, "batch_tokens": 1_000_000},
        workers=1,
        max_batch_size=8,  # the batched form, as the hf backend's pooling pools have it
        cancel_grace_s=grace_s,
        startup_timeout_s=120.0,
    )
    with ModelPool(config) as pool:
        (before,) = workers(pool)
        alone = pool.embed(TEXTS).vectors
        for _ in range(2):
            with pytest.raises(DeadlineExceeded):
                pool.embed(inputs, deadline_s=deadline_s)
            wait_idle(pool, 1, timeout=slack(5))
        assert pool.embed(TEXTS).vectors == alone
        stats = pool.stats()
        (after,) = stats.workers
        assert after.pid == before.pid
        assert stats.counters["kills"] == 0 and stats.counters["cancel_escalations"] == 0
        assert stats.counters["respawns"] == 0
