"""Grammar work within its bounds in the worker (issue 40, review #9 and #8): a compilation
past ``grammar_compile_timeout_s`` stops consuming the worker's CPU when its request fails
(it ran in a forked child, killed at the bound), a crash of the engine in that child is a
refusal rather than a dead worker, and a burst of distinct large grammars leaves the
worker's RSS within a stated margin.

The docs, Security and limits: grammar work in the worker.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers import counters, open_pool, slack, wait_until
from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import GrammarCompileTimeout, GrammarError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

# CPU seconds a worker may use in CPU_WINDOW_S once the refused compilation is over: its
# idle loop, not a compilation (which would use up to the whole window).
CPU_WINDOW_S = 2.0
IDLE_CPU_S = 0.3
# A worker's RSS growth after BURST distinct 200 KB grammars, each compiled and used once
# (measured: 66 MB on the tiny model, 49 MB for 24 on SmolLM2; the cache holds them all).
BURST = 20
RSS_MARGIN_MB = 120


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def cpu_used_over_window(pid: int) -> float:
    """The worker's own CPU seconds (its threads, not its reaped children) over
    CPU_WINDOW_S of idleness."""
    process = psutil.Process(pid)
    before = cpu_seconds(process)
    threading.Event().wait(CPU_WINDOW_S)  # the measuring window, not a synchronisation
    return cpu_seconds(process) - before


def assert_no_compilation_left(pid: int) -> None:
    """The refused compilation's child is gone soon after its request's answer (they end
    at the same deadline), and the worker's CPU stays idle."""
    wait_until(
        lambda: psutil.Process(pid).children() == [],
        slack(1.0),
        message="the refused compilation's child gone",
    )
    used = cpu_used_over_window(pid)
    assert used < IDLE_CPU_S, f"the worker used {used:.2f} CPU s after the refusal"


@pytest.fixture(scope="module", params=[1, 4], ids=["solo", "batched"])
def pool(request: pytest.FixtureRequest) -> Iterator[ModelPool]:
    with open_pool(
        workers=1, max_batch_size=request.param, grammar_compile_timeout_s=0.5, deadline_s=30
    ) as started:
        yield started


def test_a_compilation_past_its_bound_stops_using_the_workers_cpu(pool: ModelPool) -> None:
    pid = int(pool.generate("pid").text)
    with pytest.raises(GrammarCompileTimeout) as caught:
        pool.generate("echo:x", grammar='start: "compile_burn"')
    assert caught.value.bound_s == 0.5
    assert_no_compilation_left(pid)
    # The same text again: refused for the same bound, no second compilation burning.
    with pytest.raises(GrammarCompileTimeout):
        pool.generate("echo:y", grammar='start: "compile_burn"')
    assert_no_compilation_left(pid)
    # A longer bound is another chance (and another child, stopped in its turn).
    with pytest.raises(GrammarCompileTimeout) as longer:
        pool.generate("echo:z", grammar='start: "compile_burn"', grammar_compile_timeout_s=0.8)
    assert longer.value.bound_s == 0.8
    assert_no_compilation_left(pid)
    # Honest compilations beside and after it; the same warm worker throughout.
    assert pool.generate("echo:fine", grammar='start: "compile_sleep:0.05"').text == "fine"
    with pytest.raises(GrammarError, match="rehearsed"):
        pool.generate("echo:x", grammar='start: "compile_error"')
    assert int(pool.generate("pid").text) == pid
    assert counters(pool)["kills"] == 0


# ---- hf: llguidance itself -------------------------------------------------------------------


def choice_grammar(count: int, tag: str, width: int = 0) -> str:
    return "start: " + " | ".join(json.dumps(f"{tag}{i}" + "x" * width) for i in range(count))


@pytest.fixture(scope="module")
def hf_pool(tiny_model_dir: Path) -> Iterator[ModelPool]:
    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        workers=1,
        devices=["cpu"],
        deadline_s=120.0,
        grammar_compile_timeout_s=30.0,
        backend_options={"dtype": "float32", "torch_threads": 1},
    )
    with ModelPool(config) as started:
        yield started


def worker_pid(pool: ModelPool) -> int:
    (worker,) = [w for w in pool.stats().workers if w.pid]
    assert worker.pid is not None
    return worker.pid


@pytest.mark.slow
def test_llguidance_past_its_bound_is_stopped_and_the_worker_serves_on(
    hf_pool: ModelPool,
) -> None:
    assert hf_pool.generate("a", max_new_tokens=8, grammar='start: "yes" | "no"').text in (
        "yes",
        "no",
    )
    pid = worker_pid(hf_pool)
    # Under 256 KB: within the supervisor's grammar bound, a few CPU seconds to compile.
    huge = choice_grammar(22_000, "s")
    assert 200_000 < len(huge) < 262_144
    started = time.monotonic()
    with pytest.raises(GrammarCompileTimeout):
        hf_pool.generate("a", max_new_tokens=1, grammar=huge, grammar_compile_timeout_s=0.05)
    assert time.monotonic() - started < slack(5.0)
    assert_no_compilation_left(pid)
    assert hf_pool.generate("a", max_new_tokens=8, grammar='start: "ok"').text == "ok"
    assert worker_pid(hf_pool) == pid
    assert counters(hf_pool)["kills"] == 0


@pytest.mark.slow
def test_a_burst_of_distinct_large_grammars_leaves_the_worker_within_its_rss_margin(
    hf_pool: ModelPool,
) -> None:
    hf_pool.generate("a", max_new_tokens=1, grammar=choice_grammar(1_500, "warm", 140))
    pid = worker_pid(hf_pool)
    before = psutil.Process(pid).memory_info().rss / 2**20
    for index in range(BURST):
        grammar = choice_grammar(1_500, f"b{index}_", 140)  # about 230 KB, each its own
        assert len(grammar) > 200_000
        assert hf_pool.generate("a", max_new_tokens=5, grammar=grammar).text.startswith(
            f"b{index}_"
        )
    after = psutil.Process(pid).memory_info().rss / 2**20
    assert after - before < RSS_MARGIN_MB, f"RSS {before:.0f} -> {after:.0f} MB"
    assert worker_pid(hf_pool) == pid
