"""Structured outputs, the worker's side: compile a grammar off the decoding loop, within a
bound, and hold each row's grammar state while it decodes.

A constrained request carries ``params["grammar"]``: llguidance grammar text (its Lark-like
syntax, JSON schemas embedded with ``%json {...}``), built and checked by the supervisor
(:mod:`modelpool.shared.structured`). In the worker:

- :class:`GrammarCompiler` compiles each grammar text once, on a thread of its own, and
  caches the result by text. The decoding loop never waits on a compilation: a batched row
  whose grammar is not ready yet waits beside the batch, which goes on decoding; a one-call
  request polls its cancel flag while it waits. A compilation still running after the
  request's ``grammar_compile_timeout_s`` fails that request with
  :class:`~modelpool.shared.errors.GrammarCompileTimeout`; the worker stays warm (a later request
  for the same text waits on the same compilation, never starts a second one).
- A text new to the worker, of ``PROBE_MIN_TEXT_BYTES`` or more, is first compiled in a
  forked child (:func:`probe_in_child`, a copy of the worker with its tokenizer), killed
  once the request's bound passes: a compilation
  that would outlast its timeout then stops consuming CPU when its request fails, instead
  of running on in a thread nobody can stop (llguidance's own limits bound its memory, not
  its time: a 250k-alternative grammar was refused after 117 s). Only a text that compiled
  in the child within its bound is compiled in the worker (about as long again: the
  compiled matcher cannot cross processes); one that crashed the child is refused, and
  one that ran out of time stays refused for that bound. Passed texts are remembered by
  their hash, so an evicted grammar compiles again without a second child. Smaller texts
  compile in the worker directly: llguidance's time grows with the grammar's size (its
  lexer fuel bounds the rest), 30 ms of CPU for 16 KiB, while forking a 1 GB worker
  costs 100-250 ms, which the usual schema (a few KB, new to the worker) should not pay.
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

import contextlib
import ctypes
import hashlib
import math
import os
import resource
import select
import signal
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from modelpool.shared.errors import GrammarCompileTimeout, GrammarEngineMissing, GrammarError

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
# Texts this long or longer compile in a child first (see the module's docstring).
PROBE_MIN_TEXT_BYTES = 16 * 1024
# Texts whose compilation passed in a child, remembered by hash (32 bytes each).
PASSED_CACHE_SIZE = 4096
# What a child's refusal may say (the first line of an engine's message is enough).
_PROBE_MESSAGE_BYTES = 4096
_PR_SET_PDEATHSIG = 1

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
    must not hold up the ones after it. With ``probe``, a text of ``probe_min_bytes`` or
    more not yet passed is first given to ``probe(text)`` in a child process killed past
    the request's bound
    (:func:`probe_in_child`), and compiled here only if it passed there; ``prepare()``
    runs first, in the worker, so that what every child needs (the tokenizer) is made
    once, before the fork.
    """

    def __init__(
        self,
        compile: Callable[[str], Compiled],
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_text_bytes: int = DEFAULT_CACHE_TEXT_BYTES,
        *,
        probe: Callable[[str], object] | None = None,
        prepare: Callable[[], object] | None = None,
        probe_min_bytes: int = PROBE_MIN_TEXT_BYTES,
    ) -> None:
        self._compile = compile
        self._probe = probe
        self._probe_min_bytes = probe_min_bytes
        self._prepare = prepare
        self._cache: OrderedDict[str, Future[Compiled]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_text_bytes = cache_text_bytes
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # _passed: compile threads write it
        self.cached_text_bytes = 0  # the cached grammars' text, together
        self.compilations = 0  # compilations started (cache misses)
        self.probes = 0  # texts compiled in a child first
        self.probes_killed = 0  # children killed past their bound

    def start(self, text: str, bound_s: float) -> PendingGrammar[Compiled]:
        future = self._cache.get(text)
        if future is not None and _timed_out_sooner(future, bound_s):
            # Refused under a shorter bound than this request's: it may compile in this one.
            self._forget(text)
            future = None
        started = time.monotonic()
        if future is None:
            future = Future()
            self.compilations += 1
            threading.Thread(
                target=self._run,
                args=(text, future, started + bound_s, bound_s),
                name="modelpool-grammar",
                daemon=True,
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
        return PendingGrammar(text, future, started, bound_s)

    def _forget(self, text: str) -> None:
        del self._cache[text]
        self.cached_text_bytes -= len(text)

    def _run(self, text: str, future: Future[Compiled], deadline: float, bound_s: float) -> None:
        try:
            if (
                self._probe is not None
                and len(text) >= self._probe_min_bytes
                and not self._has_passed(text)
            ):
                if self._prepare is not None:
                    # The tokenizer (made on a worker's first grammar) is not the grammar's
                    # time: the child's deadline moves by it.
                    prepared = time.monotonic()
                    self._prepare()
                    deadline += time.monotonic() - prepared
                self.probes += 1
                try:
                    refusal = probe_in_child(self._probe, text, deadline, bound_s)
                except OSError:
                    # No child to be had (fork refused: memory, process limits): the
                    # compilation runs here unprobed, as it would for a small text.
                    refusal = None
                else:
                    if refusal is None:
                        self._remember_passed(text)
                if refusal is not None:
                    if isinstance(refusal, GrammarCompileTimeout):
                        self.probes_killed += 1
                    future.set_exception(refusal)
                    return
            future.set_result(self._compile(text))
        except BaseException as exc:
            future.set_exception(exc)

    def _has_passed(self, text: str) -> bool:
        digest = _digest(text)
        with self._lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return True
            return False

    def _remember_passed(self, text: str) -> None:
        with self._lock:
            self._passed[_digest(text)] = None
            while len(self._passed) > PASSED_CACHE_SIZE:
                self._passed.popitem(last=False)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _timed_out_sooner(future: Future[Any], bound_s: float) -> bool:
    if not future.done() or future.cancelled():
        return False
    refusal = future.exception()
    return isinstance(refusal, GrammarCompileTimeout) and (refusal.bound_s or 0.0) < bound_s


def probe_in_child(
    probe: Callable[[str], object], text: str, deadline: float, bound_s: float
) -> Exception | None:
    """Run ``probe(text)`` in a forked child and wait for it until ``deadline``
    (``time.monotonic()``; the request's ``bound_s`` after its start): None if it
    returned; the GrammarError it raised (as a GrammarError of its message); a
    GrammarCompileTimeout once the deadline passed, the child killed; a GrammarError if
    the child died (the engine crashed on the text: the worker does not).

    The child is a fork of the worker, so it has the tokenizer without making it; it runs
    only the probe, with its CPU time limited to the bound as well (the kernel ends it if
    this thread cannot), and dies with the thread that forked it."""
    read_fd, write_fd = os.pipe()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about forking a process with threads: the child runs only
            # the engine's code and exits, taking none of the locks the other threads hold.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        _probe_child(probe, text, bound_s, read_fd, write_fd)
    os.close(write_fd)
    message = b""
    finished = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            readable, _, _ = select.select([read_fd], [], [], left)
            if not readable:
                continue
            chunk = os.read(read_fd, _PROBE_MESSAGE_BYTES)
            if not chunk:
                finished = True
                break
            message += chunk
    finally:
        os.close(read_fd)
        if not finished:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if not finished:
        return GrammarCompileTimeout(
            f"the grammar did not compile within grammar_compile_timeout_s = {bound_s:g} s "
            "(its compilation was stopped)",
            bound_s=bound_s,
            param=COMPILE_TIMEOUT_PARAM,
        )
    if message.startswith(b"ok"):
        return None
    if message.startswith(b"error:"):
        return GrammarError(message[6:].decode("utf-8", "replace"))
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return GrammarCompileTimeout(
            f"the grammar did not compile within grammar_compile_timeout_s = {bound_s:g} s "
            "of CPU time (its compilation was stopped)",
            bound_s=bound_s,
            param=COMPILE_TIMEOUT_PARAM,
        )
    how = (
        f"signal {os.WTERMSIG(status)}"
        if os.WIFSIGNALED(status)
        else f"exit status {os.WEXITSTATUS(status)}"
    )
    return GrammarError(f"the grammar engine crashed compiling this grammar ({how})")


def _probe_child(
    probe: Callable[[str], object], text: str, bound_s: float, read_fd: int, write_fd: int
) -> None:
    """The forked child's whole life: the probe, one message, ``os._exit``."""
    try:
        os.close(read_fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        seconds = math.ceil(bound_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            probe(text)
            message = b"ok"
        except GrammarError as exc:
            message = b"error:" + str(exc).encode("utf-8", "replace")
        except Exception as exc:
            message = b"error:" + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        os.write(write_fd, message[:_PROBE_MESSAGE_BYTES])
    finally:
        os._exit(0)


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
        self.compiler: GrammarCompiler[Any] = GrammarCompiler(
            self._compile, probe=self._probe, prepare=self._llg_tokenizer
        )

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

    def _probe(self, text: str) -> None:
        """What the child compiles: the grammar and its first mask (where the engine's
        per-row limits and a first step's lexer work show)."""
        matcher = self._compile(text)
        words = (self._llg_tokenizer().vocab_size + 31) // 32
        mask = (ctypes.c_int32 * words)()
        matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), ctypes.sizeof(mask))
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {matcher.get_error()}")

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
