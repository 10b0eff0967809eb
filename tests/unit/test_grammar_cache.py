"""The worker's compiled-grammar cache is bounded by its grammars' text, not only by their
number: a burst of distinct huge grammars does not stay in the worker; a large text new to
it compiles first in a forked child, whose refusal or crash is a refusal (issue 40, item 7)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

import pytest

from modelpool.shared.errors import GrammarError
from modelpool.shared.grammar import GrammarCompiler

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, Linux signals")

MIB = 1024 * 1024


def compiled(compiler: GrammarCompiler[str], text: str) -> str:
    pending = compiler.start(text, bound_s=30.0)
    done = threading.Event()
    pending.future.add_done_callback(lambda _: done.set())
    assert done.wait(30.0)
    return pending.result()


def test_the_cache_holds_at_most_its_text_bound_and_keeps_the_newest() -> None:
    compiler: GrammarCompiler[str] = GrammarCompiler(str.upper, cache_text_bytes=3 * MIB)
    texts = [chr(ord("a") + number) * MIB for number in range(10)]
    for text in texts:
        assert compiled(compiler, text) == text.upper()
        assert compiler.cached_text_bytes <= 3 * MIB
    assert compiler.compilations == 10
    compiled(compiler, texts[-1])  # the newest is cached
    assert compiler.compilations == 10
    compiled(compiler, texts[0])  # the oldest was evicted: compiled again
    assert compiler.compilations == 11


def test_one_grammar_larger_than_the_bound_is_still_served_and_cached_alone() -> None:
    compiler: GrammarCompiler[str] = GrammarCompiler(str.upper, cache_text_bytes=MIB)
    compiled(compiler, "a" * 100)
    assert compiled(compiler, "b" * (2 * MIB)) == "B" * (2 * MIB)
    assert compiler.cached_text_bytes == 2 * MIB
    compiled(compiler, "b" * (2 * MIB))
    assert compiler.compilations == 2


# ---- the child a large text compiles in first (issue 40, item 7) ------------------------------


def probed(compiler: GrammarCompiler[str], text: str) -> str | BaseException:
    try:
        return compiled(compiler, text)
    except Exception as exc:
        return exc


def crash(text: str) -> None:
    faulthandler.disable()  # pytest's: its dump of the child's stack is noise here
    os.kill(os.getpid(), signal.SIGSEGV)


def refuse(text: str) -> None:
    raise GrammarError("no such rule (in the child)")


@linux
def test_a_text_compiles_in_the_worker_only_after_it_passed_in_a_child() -> None:
    compiler: GrammarCompiler[str] = GrammarCompiler(
        str.upper, probe=len, probe_min_bytes=10, cache_text_bytes=20
    )
    assert compiled(compiler, "short") == "SHORT"
    assert compiler.probes == 0, "a small text compiles here directly"
    assert compiled(compiler, "a" * 15) == "A" * 15
    assert compiler.probes == 1
    compiled(compiler, "b" * 15)  # evicts the first: the cache holds 20 bytes of text
    assert compiled(compiler, "a" * 15) == "A" * 15
    assert compiler.compilations == 4 and compiler.probes == 2, "passed once, not probed again"


@linux
def test_what_the_child_refuses_or_dies_of_is_a_refusal_and_never_compiles_here() -> None:
    calls: list[str] = []

    def compile(text: str) -> str:
        calls.append(text)
        return text

    refused = probed(GrammarCompiler(compile, probe=refuse, probe_min_bytes=0), "x")
    assert isinstance(refused, GrammarError) and "no such rule" in str(refused)
    crashed = probed(GrammarCompiler(compile, probe=crash, probe_min_bytes=0), "y")
    assert isinstance(crashed, GrammarError) and "crashed" in str(crashed)
    assert f"signal {int(signal.SIGSEGV)}" in str(crashed)
    assert calls == []
