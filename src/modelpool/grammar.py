"""Structured outputs, the worker's side: compile a grammar off the decoding loop, within a
bound, and hold each row's grammar state while it decodes.

A constrained request carries ``params["grammar"]``: llguidance grammar text (its Lark-like
syntax, JSON schemas embedded with ``%json {...}``), built and checked by the supervisor
(:mod:`modelpool.structured`). In the worker:

- :class:`GrammarCompiler` compiles each grammar text once, on a thread of its own, and
  caches the result by text. The decoding loop never waits on a compilation: a batched row
  whose grammar is not ready yet waits beside the batch, which goes on decoding; a one-call
  request polls its cancel flag while it waits. A compilation still running after the
  request's ``grammar_compile_timeout_s`` fails that request with
  :class:`~modelpool.errors.GrammarCompileTimeout`; the worker stays warm (the thread is
  left to finish or hang on its own; a later request for the same text waits on the same
  compilation, never starts a second one).
- :class:`GuidanceGrammars` is what every backend's engine shares: the tokenizer's
  llguidance view (made on the first compilation, about a second for a 50k vocabulary),
  one compiled ``LLMatcher`` per grammar text, a fresh copy of it per row
  (:class:`RowGrammar`). Each backend applies the token masks to its logits before the
  token is chosen (``backends.hf.grammars``, ``backends.llama_cpp.grammars``). The
  end-of-sequence token is allowed only where the grammar accepts, and a row ends
  ("stop") as soon as its grammar is complete.

A grammar engine that crashes or wedges the worker process is a worker crash or a stall
like any other: the pool's poison isolation and collateral retries apply.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from modelpool.errors import GrammarCompileTimeout, GrammarEngineMissing, GrammarError

if TYPE_CHECKING:
    import torch

GRAMMAR_PARAM = "grammar"
"""The request parameter holding the grammar text (absent or None: unconstrained)."""
COMPILE_TIMEOUT_PARAM = "grammar_compile_timeout_s"
"""The request parameter holding its compilation bound (the pool sets it from its config)."""
DEFAULT_COMPILE_TIMEOUT_S = 5.0
DEFAULT_CACHE_SIZE = 256
# The cache's bound in grammar text: a compiled grammar's memory grows with its text (a
# choice list's lexer holds every item), so a burst of distinct huge grammars must not
# stay in the worker. 256 grammars of the supervisor's largest (256 KiB) would be 64 MiB
# of text and several times that compiled; 16 MiB of text holds 64 of them.
DEFAULT_CACHE_TEXT_BYTES = 16 * 1024 * 1024
_POLL_S = 0.05  # how often a one-call request waiting for its grammar reads its cancel flag

Compiled = TypeVar("Compiled")


@dataclass(eq=False)
class PendingGrammar(Generic[Compiled]):
    """One request's wait for its grammar: ready, failed, or past its bound."""

    text: str
    future: Future[Compiled]
    started: float
    bound_s: float

    def ready(self, now: float | None = None) -> bool:
        """Done (compiled or failed) or past its bound: :meth:`result` answers at once."""
        if self.future.done():
            return True
        return (time.monotonic() if now is None else now) - self.started >= self.bound_s

    def result(self) -> Compiled:
        """The compiled grammar; raises its compile error, or GrammarCompileTimeout once past
        the bound. Call only when :meth:`ready`."""
        if not self.future.done():
            raise GrammarCompileTimeout(
                f"the grammar did not compile within grammar_compile_timeout_s = "
                f"{self.bound_s:g} s",
                bound_s=self.bound_s,
                param=COMPILE_TIMEOUT_PARAM,
            )
        return self.future.result()

    def wait(self, cancelled: Callable[[], bool]) -> Compiled | None:
        """Block until :meth:`ready`, reading ``cancelled`` meanwhile; None if cancelled."""
        while not self.ready():
            if cancelled():
                return None
            left = self.bound_s - (time.monotonic() - self.started)
            wait([self.future], timeout=max(0.0, min(_POLL_S, left)))
        return self.result()


class GrammarCompiler(Generic[Compiled]):
    """Compiles grammar texts on threads of their own; results cached by text (LRU),
    within ``cache_size`` grammars and ``cache_text_bytes`` of their text together (the
    newest is always kept).

    ``compile(text)`` returns the compiled form or raises (a ``GrammarError`` for a grammar
    the engine refuses). Threads rather than a fixed pool: a compilation that never ends
    must not hold up the ones after it.
    """

    def __init__(
        self,
        compile: Callable[[str], Compiled],
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_text_bytes: int = DEFAULT_CACHE_TEXT_BYTES,
    ) -> None:
        self._compile = compile
        self._cache: OrderedDict[str, Future[Compiled]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_text_bytes = cache_text_bytes
        self.cached_text_bytes = 0  # the cached grammars' text, together
        self.compilations = 0  # compilations started (cache misses)

    def start(self, text: str, bound_s: float) -> PendingGrammar[Compiled]:
        future = self._cache.get(text)
        if future is None:
            future = Future()
            self.compilations += 1
            threading.Thread(
                target=self._run, args=(text, future), name="modelpool-grammar", daemon=True
            ).start()
            self._cache[text] = future
            self.cached_text_bytes += len(text)
            while len(self._cache) > 1 and (
                len(self._cache) > self._cache_size
                or self.cached_text_bytes > self._cache_text_bytes
            ):
                evicted, _ = self._cache.popitem(last=False)
                self.cached_text_bytes -= len(evicted)
        else:
            self._cache.move_to_end(text)
        return PendingGrammar(text, future, time.monotonic(), bound_s)

    def _run(self, text: str, future: Future[Compiled]) -> None:
        try:
            future.set_result(self._compile(text))
        except BaseException as exc:
            future.set_exception(exc)


def check_grammar_params(params: Mapping[str, Any]) -> None:
    """The grammar parameters' types (cheap; the supervisor checks the grammar itself)."""
    grammar = params.get(GRAMMAR_PARAM)
    if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
        raise GrammarError(
            f"{GRAMMAR_PARAM} must be llguidance grammar text, got {grammar!r:.80}",
            param=GRAMMAR_PARAM,
        )
    bound = params.get(COMPILE_TIMEOUT_PARAM)
    if bound is not None and (
        isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0
    ):
        raise GrammarError(
            f"{COMPILE_TIMEOUT_PARAM} must be a number of seconds > 0, got {bound!r}",
            param=COMPILE_TIMEOUT_PARAM,
        )


def compile_bound(params: Mapping[str, Any]) -> float:
    bound = params.get(COMPILE_TIMEOUT_PARAM)
    return DEFAULT_COMPILE_TIMEOUT_S if bound is None else float(bound)


def wait_for_any(pending: Iterable[PendingGrammar[Any]], timeout_s: float) -> None:
    """Block until one of ``pending`` compiles or ``timeout_s`` passes: what a batched
    loop with nothing else to do waits on instead of spinning."""
    futures = [grammar.future for grammar in pending]
    if futures:
        wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)


class RowGrammar:
    """One request's grammar state: a fresh matcher of its compiled grammar."""

    def __init__(self, matcher: Any, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_ids = eos_ids

    def fill_mask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into ``bitmask[index]`` (one bit per token id)."""
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")

    def take(self, token_id: int) -> bool:
        """Advance by the chosen token; True once the grammar is complete (the row ends)."""
        if token_id in self.eos_ids:
            return True
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"grammar: token {token_id} refused: {self.matcher.get_error()}")
        return bool(self.matcher.is_stopped())


class CompilingRow(Protocol):
    """A batched loop's row whose grammar may still be compiling (both backends' rows)."""

    pending_grammar: PendingGrammar[Any] | None
    grammar: RowGrammar | None


Row = TypeVar("Row", bound=CompilingRow)


def settle_compiled(
    compiling: list[Row], make_row: Callable[[Any], RowGrammar]
) -> tuple[list[Row], list[tuple[Row, Exception]]]:
    """Take out of ``compiling`` the rows whose grammar is done: those that now hold their
    matcher (they go on to wait for KV room), and those whose compilation failed or
    outlasted its bound, each with its error (theirs alone)."""
    now = time.monotonic()
    ready: list[Row] = []
    failed: list[tuple[Row, Exception]] = []
    for row in list(compiling):
        pending = row.pending_grammar
        if pending is None or not pending.ready(now):
            continue
        compiling.remove(row)
        row.pending_grammar = None
        try:
            row.grammar = make_row(pending.result())
        except Exception as exc:
            failed.append((row, exc))
            continue
        ready.append(row)
    return ready, failed


class GuidanceGrammars:
    """What every backend's grammar engine shares: llguidance's view of the model's
    tokenizer (made by ``make_tokenizer`` on the first compilation, about a second for a
    50k vocabulary), one compiled ``LLMatcher`` per grammar text (cached, see
    :class:`GrammarCompiler`), a fresh copy of it per row. A backend adds how a row's mask
    reaches its logits (torch on hf, numpy on llama_cpp)."""

    def __init__(self, make_tokenizer: Callable[[], Any], eos_ids: frozenset[int]) -> None:
        self._make_tokenizer = make_tokenizer
        self.eos_ids = eos_ids
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.compiler: GrammarCompiler[Any] = GrammarCompiler(self._compile)

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _compile(self, text: str) -> Any:
        llguidance = import_llguidance()
        # Short errors: a verbose one dumps the engine's parser state into the answer.
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return matcher

    def start(self, params: Mapping[str, Any]) -> PendingGrammar[Any]:
        return self.compiler.start(params[GRAMMAR_PARAM], compile_bound(params))

    def row(self, compiled: Any) -> RowGrammar:
        return RowGrammar(compiled.deep_copy(), self.eos_ids)


def grammar_refusal(text: str, detail: Mapping[str, Any]) -> GrammarError:
    """The supervisor's typed error for a worker's grammar refusal (see worker.py)."""
    bound_s = detail.get("bound_s")
    if bound_s is not None:
        return GrammarCompileTimeout(text, bound_s=float(bound_s), param=detail.get("param"))
    return GrammarError(text, param=detail.get("param"), keyword=detail.get("keyword"))


def import_llguidance() -> Any:
    """llguidance, or GrammarEngineMissing saying how to install it."""
    try:
        import llguidance
    except ImportError as exc:
        raise GrammarEngineMissing(
            "structured outputs need the llguidance grammar engine: "
            "pip install 'modelpool[structured]'",
            param="response_format",
        ) from exc
    return llguidance
