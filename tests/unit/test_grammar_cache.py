"""The worker's compiled-grammar cache is bounded by its grammars' text, not only by their
number: a burst of distinct huge grammars does not stay in the worker (issue 40, item 7)."""

from __future__ import annotations

import threading

from modelpool.grammar import GrammarCompiler

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
