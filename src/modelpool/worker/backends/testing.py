"""A fault-injection backend: rehearse hangs, crashes and leaks without a model.

Use it as ``backend="testing"``; the prompt says what the worker should do::

    with ModelPool(PoolConfig(model="none", backend="testing", deadline_s=2)) as pool:
        pool.generate("echo:hello").text          # "hello"
        pool.generate("tokens:50:0.01")           # 50 tokens, 10 ms apart, honours cancel
        pool.generate("hang")                     # ignores the cancel flag and SIGTERM
        pool.generate("segfault")                 # dies with SIGSEGV

Commands (``name[:arg[:arg]]``, after any ``<system-reminder>`` blocks Claude Code writes
ahead of its user's text; anything else is echoed back):

=====================  ======================================================
``echo:TEXT``          returns TEXT, cut before the first ``stop`` string in it
``tokens:N[:DELAY]``   emits N tokens ``"t0 t1 ..."``, DELAY seconds apart,
                       checking the cancel flag before each; honours
                       ``max_new_tokens`` (finish_reason "length"); the Nth
                       token is its end of sequence: with ``ignore_eos`` it
                       goes on to ``max_new_tokens``; a token holding a
                       ``stop`` string (``stop=["t2"]``) ends it there, cut
                       before the stop (a stop across two tokens is not seen)
``hang[:term]``        never returns, never checks the flag; ignores SIGTERM
                       unless ``:term`` is given
``stall:N``            emits N tokens, then hangs without progress
``segfault``           dereferences NULL
``exit:CODE``          ``os._exit(CODE)``
``raise:MESSAGE``      raises ``RuntimeError(MESSAGE)``
``batch_raise:MESSAGE`` batched: raises ``RuntimeError(MESSAGE)`` out of the step, a
                       shared forward pass that failed with no one request to blame
                       (every request in the batch is lost with it); one-call: like
                       ``raise``
``hog:MB``             allocates and touches MB megabytes, then hangs
``leak:MB``            allocates MB megabytes kept for the worker's life, returns "ok"
``crash_once:PATH``    exits if PATH does not exist (creating it first), else "ok"
``hang_once:PATH``     hangs like ``hang`` if PATH does not exist (creating it first),
                       else "ok": a timeout that a retry recovers from
``pid``                returns the worker's pid
``spin``               never finishes and never produces a token, but (batched)
                       keeps its decoding loop turning: a livelock
``env:NAME``           returns the worker's environment variable NAME ("" if unset);
                       only with the load option ``env_command = true`` (a test's),
                       since the testing backend is a flag of the production daemon
``device``             returns the ``device`` the worker's backend was loaded with
``cuda_oom:BYTES[:MB]`` raises a simulated CUDA out-of-memory (torch's class name
                       and message) for an allocation of BYTES; MB megabytes of
                       simulated device memory stay allocated afterwards (default
                       0), so that the memory is not back to the baseline
``cuda_sticky``        raises a simulated illegal memory access; from then on every
                       request and every device check fails the same way, as a
                       poisoned CUDA context does
``cuda_error:MESSAGE`` raises ``RuntimeError("CUDA error: MESSAGE")`` once, with the
                       device still usable (a CUDA error that is not sticky)
``device_memory``      returns the simulated allocated bytes and cache releases,
                       "ALLOCATED/RELEASES"
``think:N:ANSWER``     a reasoning model: N thinking tokens (``loop``: endless),
                       then ANSWER (see ``testing_thinking``; ``harmony:``: gpt-oss)
``detach:SECONDS``     starts a child in a session of its own (outside the worker's
                       process group, so a kill of the group misses it) that sleeps
                       SECONDS (default 60) and returns its pid
=====================  ======================================================

With ``max_batch_size`` above 1 the backend batches (``protocol.BatchedHandler``):
every admitted request advances one token per ``step()``, a step lasts as long
as the slowest ``DELAY`` among the requests in it (one shared decoding step),
and each fault happens inside the batch the way it would on a real model:
``hang``, ``hog`` and ``stall`` freeze the whole step (every request in the
batch stops getting tokens), ``segfault`` and ``exit`` take the worker and its
batch down, ``raise`` fails only its own request, ``batch_raise`` fails the
step itself, ``spin`` keeps the loop iterating without delivering tokens.

A request with a ``grammar`` (``response_format`` and the like) has its grammar "compiled"
the way the hf backend compiles one, on a thread of its own within
``grammar_compile_timeout_s``, first in a forked child killed past the bound (every text,
however short), then in the worker, cached by text, solo and in a batch; the output is
not constrained (there is no tokenizer). What the compilation does is said in the grammar text:

=========================  ==================================================
``compile_sleep:SECONDS``  takes SECONDS (in the child, then in the worker),
                           then succeeds
``compile_hang``           never finishes (the child is killed, its request
                           fails past the bound; the worker stays warm)
``compile_burn``           burns CPU and never finishes, as a huge grammar
                           does (the child is killed at the bound)
``compile_segfault``       dereferences NULL on the worker's compiling thread,
                           not in the child (an engine whose crash the probe
                           does not show): the worker dies, with its batch
``compile_wedge``          blocks in C holding the GIL on the worker's
                           compiling thread, as an engine that forgot to
                           release it would: the whole worker stops (a stall,
                           then a kill)
``compile_error``          fails, as a grammar the engine refuses does
=========================  ==================================================

e.g. ``pool.generate("echo:x", grammar='start: "compile_hang"')``.

A prompt given as token ids (``TokenIds``) reads as the ids joined by spaces.
``tokenize`` gives one id per character (its code point), ``detokenize`` the reverse.
``logprobs=N`` gives every generated token (each ``tokens`` piece; the whole text
otherwise) the logprob -0.25, with N alternatives (itself first, then made-up
ones); ``prompt_logprobs=N`` scores the prompt the same way, one token per
character (per id for token ids), the first with no logprob. ``max_new_tokens=0``
with ``prompt_logprobs`` returns no text.

Load-time options (``backend_options``): ``env_command`` (allow ``env:NAME``),
``load_delay_s`` (sleep before ready), ``hold_mb`` (megabytes held from the load on, as
weights are: a model of a given size for the registry's budget), ``fail_load`` (raise during
load), ``exit_on_load`` (``os._exit`` during load), ``exit_after_load_s`` (``os._exit(1)``
that many seconds after a successful load: a worker that says ready and dies), ``task``
("embed" or "score": an embedding model or a cross-encoder, which refuse to generate; its
faults are in ``testing_embeddings``), ``batch_log`` (a file each batched step of pooling
requests appends its number of requests to), ``pooling_token_s`` and
``pooling_batch_tokens`` (an embedding's or a score's time: ``testing_embeddings.Passes``),
``vision`` (reads images: ``testing_images``), ``max_model_len`` (a context length, so that
the pool's side of context limits is tested without a model). With it, a string prompt
counts one token per whitespace-separated word, chat messages count as a template renders
them (a role marker, the words and an end marker each, then one for the assistant's turn), a
request that does not fit is refused as the hf backend refuses it, a ``tokens:N`` request
without ``max_new_tokens`` of its own stops at 128 tokens or where the context ends, and
with ``fit_to_context`` where the context ends (finish_reason "length"), and its result
reports prompt_tokens::

    load(max_model_len=8).generate(call)    # call.prompt "tokens:20" -> t0 .. t6, "length"

This module imports nothing heavy, so a worker is ready in a few tens of ms.

Faults in the supervisor itself are rehearsed from its side:
:func:`modelpool.supervisor.faults.run_on_dispatcher`.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from modelpool.shared.context import check_max_model_len, fit_to_context
from modelpool.shared.errors import GrammarError, InvalidRequest
from modelpool.shared.grammar import (
    COMPILE_TIMEOUT_PARAM,
    GRAMMAR_PARAM,
    GrammarCompiler,
    PendingGrammar,
    check_grammar_params,
    compile_bound,
    wait_for_any,
)
from modelpool.shared.logprob_columns import TokenLogprobs
from modelpool.shared.prefixes import CACHE_SALT_PARAM
from modelpool.shared.protocol import (
    TASKS,
    BatchCall,
    Call,
    EmbedRequest,
    Finished,
    FinishReason,
    Generation,
    Prompt,
    ScoreRequest,
    Task,
    TokenIds,
    note_prompt,
)
from modelpool.shared.reasoning.controls import THINKING_PARAMS
from modelpool.shared.validation import (
    FIT_PARAM,
    PRIORITY_PARAM,
    PROMOTED_AT_PARAM,
    check_generation_params,
)
from modelpool.worker.backends import testing_embeddings, testing_images, testing_thinking
from modelpool.worker.backends.common.params import DEFAULT_MAX_NEW_TOKENS, requested_new_tokens
from modelpool.worker.backends.common.text import first_stop, stop_strings
from modelpool.worker.backends.testing_prompts import command_text, count_tokens, prompt_text

# The sampling parameters and the penalties are accepted (and checked) without effect:
# this backend has no scores;
# so are tools (the echo command writes a call as a model would).
ACCEPTED_PARAMS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "logprobs",
        "prompt_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "tools",
        GRAMMAR_PARAM,
        COMPILE_TIMEOUT_PARAM,
        "ignore_eos",
        PRIORITY_PARAM,
        PROMOTED_AT_PARAM,
        CACHE_SALT_PARAM,
        FIT_PARAM,
        *THINKING_PARAMS,
    }
)
TOKEN_LOGPROB = -0.25


def validate(params: dict[str, Any]) -> None:
    """Light pre-dispatch check, called by the supervisor."""
    check_generation_params(params)
    unknown = sorted(set(params) - ACCEPTED_PARAMS)
    if unknown:
        raise InvalidRequest(f"unknown generation parameter {unknown[0]!r} for the testing backend")
    check_grammar_params(params)


_COMPILE_SLEEP = re.compile(r"compile_sleep:([0-9.]+)")


def rehearse_probe(text: str) -> None:
    """What the testing backend's grammar "compiler" does in the child that compiles a
    new text first: all but the faults that only the worker's compilation rehearses."""
    if "compile_segfault" not in text and "compile_wedge" not in text:
        rehearse_compile(text)


def rehearse_compile(text: str) -> str:
    """The testing backend's grammar "compiler": does what the grammar text says."""
    if "compile_hang" in text:
        _block_forever()
    if "compile_burn" in text:
        _burn_forever()
    if "compile_segfault" in text:
        ctypes.string_at(0)
    if "compile_wedge" in text:
        ctypes.PyDLL(None).pause()  # PyDLL: the call keeps the GIL
    if "compile_error" in text:
        raise GrammarError("the grammar cannot be compiled: compile_error (rehearsed)")
    sleep = _COMPILE_SLEEP.search(text)
    if sleep:
        threading.Event().wait(float(sleep.group(1)))
    return text


SIMULATED_WEIGHTS_BYTES = 100 * 1024 * 1024
"""Simulated device memory the loaded "model" holds: the post-load baseline."""


@dataclass(eq=False)
class _Job:
    """One admitted request in the batched form."""

    call: BatchCall
    command: str
    argument: str
    limit: int | None
    count: int = 0
    delay: float = 0.0
    pieces: list[str] = field(default_factory=list)
    whole: bool = False
    grammar: PendingGrammar[str] | None = None  # while its grammar compiles
    preamble: str = ""  # what it says of its images (testing_images)

    def partial(self, finish_reason: Any, stop_sequence: str | None = None) -> Generation:
        return Generation(
            self.preamble + "".join(self.pieces),
            finish_reason,
            None,
            len(self.pieces),
            stop_sequence=stop_sequence,
        )


_STEPPED = frozenset({"tokens", "stall", "spin"})
_SPIN_STEP_S = 0.005


STICKY_MESSAGE = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect."
)


class OutOfMemoryError(RuntimeError):
    """Named as torch's, so that the worker recognises it as torch's would be."""


class FaultBackend:
    """The handler; one per worker. Implements both backend forms; its device memory is
    simulated (see the CUDA commands)."""

    def __init__(
        self,
        device: str = "cpu",
        max_model_len: int | None = None,
        env_command: bool = False,
        task: Task = "generate",
        batch_log: str | None = None,
        passes: testing_embeddings.Passes = testing_embeddings.INSTANT,
        vision: bool = False,
    ) -> None:
        self.task = task
        self.vision = vision
        self.batches_pooling = task != "generate"
        self.passes = passes
        self._pooled = testing_embeddings.PooledBatch(
            max_model_len, task == "score", batch_log, passes
        )
        self.env_command = env_command
        self._leaked: list[bytearray] = []
        self.max_model_len = max_model_len
        self.device = device
        self.allocated_bytes = SIMULATED_WEIGHTS_BYTES
        self.cache_releases = 0
        self.poisoned = False
        self._jobs: list[_Job] = []
        self._pause = threading.Event()
        self.grammars: GrammarCompiler[str] = GrammarCompiler(
            rehearse_compile, probe=rehearse_probe, probe_min_bytes=0
        )

    def hold(self, megabytes: float) -> None:
        """Allocate and touch ``megabytes``, kept for the worker's life (a leak, or weights)."""
        block = bytearray(int(megabytes * 1024 * 1024))
        _touch(block)
        self._leaked.append(block)

    def device_memory_allocated(self) -> int:
        return self.allocated_bytes

    def release_device_cache(self) -> None:
        self.cache_releases += 1

    def check_device(self) -> None:
        if self.poisoned:
            raise RuntimeError(STICKY_MESSAGE)

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """One id per character (its code point), as ``prompt_logprobs`` scores a prompt;
        chat messages as the text of the last one, after id 0 for each of the prompt's
        image tokens (its images read, or refused without ``vision``, as a generation's
        are); token ids as they are."""
        if isinstance(prompt, TokenIds):
            return list(prompt.ids)
        testing_images.read_images(prompt, self.vision)
        return [0] * testing_images.image_tokens(prompt) + [ord(c) for c in prompt_text(prompt)]

    def embed(self, request: EmbedRequest, call: Call) -> Generation:
        """Vectors from a hash, and the faults of a real embedding model (see
        ``testing_embeddings``)."""
        return testing_embeddings.embed(request, call, self.max_model_len, self.passes)

    def score(self, request: ScoreRequest, call: Call) -> Generation:
        cross_encoder = self.task == "score"
        return testing_embeddings.score(
            request, call, self.max_model_len, cross_encoder, self.passes
        )

    def detokenize(self, token_ids: list[int]) -> str:
        if any(token_id > sys.maxunicode for token_id in token_ids):
            raise InvalidRequest(f"token ids are code points here (at most {sys.maxunicode})")
        return "".join(chr(token_id) for token_id in token_ids)

    # ---- batched form ------------------------------------------------------------------

    def admit(self, call: BatchCall) -> None:
        if self._pooled.admit(call):
            return
        prompt = call.prompt
        text = prompt_text(prompt)
        command, _, argument = text.partition(":")
        job = _Job(call, command, argument, self._fit(call)[0])
        job.preamble = testing_images.read_images(prompt, self.vision)
        note_prompt(call, count_tokens(prompt), 0)
        # Log probabilities come from the one-call path: such a request runs whole in one step.
        job.whole = any(
            call.params.get(name) is not None for name in ("logprobs", "prompt_logprobs")
        )
        if command == "tokens":
            count_text, _, delay_text = argument.partition(":")
            job.count = _token_count(count_text, job.limit, call.params)
            job.delay = float(delay_text or 0)
        elif command == "stall":
            job.count = int(argument or 1)
        if call.params.get(GRAMMAR_PARAM) is not None:
            job.grammar = self.grammars.start(
                call.params[GRAMMAR_PARAM], compile_bound(call.params)
            )
        self._jobs.append(job)

    def step(self) -> list[Finished]:
        finished = self._pooled.step()
        compiling = [job.grammar for job in self._jobs if job.grammar is not None]
        if compiling and len(compiling) == len(self._jobs):
            wait_for_any(compiling, _SPIN_STEP_S * 10)  # nothing else to do: no spinning
        for job in list(self._jobs):
            if job.grammar is None or not job.grammar.ready():
                continue
            try:
                job.grammar.result()
            except Exception as exc:
                self._jobs.remove(job)
                finished.append((job.call, exc))
                continue
            job.grammar = None
        finished += self._step_jobs([job for job in self._jobs if job.grammar is None])
        return finished

    def _step_jobs(self, jobs: list[_Job]) -> list[Finished]:
        delay = max((job.delay for job in jobs if job.command == "tokens"), default=0.0)
        if any(job.command == "spin" for job in jobs):
            delay = max(delay, _SPIN_STEP_S)
        if delay:
            self._pause.wait(delay)
        failing = next((job for job in jobs if job.command == "batch_raise"), None)
        if failing is not None:
            raise RuntimeError(failing.argument)
        finished: list[Finished] = []
        for job in jobs:
            outcome: Generation | str | Exception | None
            try:
                outcome = self._advance(job)
            except Exception as exc:
                outcome = exc
            if outcome is not None:
                self._jobs.remove(job)
                finished.append(
                    (job.call, Generation(outcome) if isinstance(outcome, str) else outcome)
                )
        return finished

    def retire(self, call: BatchCall) -> Generation:
        if self._pooled.retire(call):
            return Generation("", "cancelled", None, 0)
        for job in self._jobs:
            if job.call is call:
                self._jobs.remove(job)
                return job.partial("cancelled")
        return Generation("", "cancelled", None, 0)

    def abort(self) -> None:
        self._jobs.clear()
        self._pooled.calls.clear()

    def _advance(self, job: _Job) -> Generation | str | None:
        """One step of one request: its result once it ends, else None."""
        if job.command not in _STEPPED or job.whole:
            return self._generate(job.call, job.preamble)
        if job.command == "spin":
            return None
        if job.preamble and not job.pieces:
            job.call.emit(job.preamble)
        index = len(job.pieces)
        if job.command == "stall" and index >= job.count:
            _block_forever()
        if job.command == "tokens" and job.limit is not None and index >= job.limit:
            return job.partial("length")
        piece, stop = _stopped(f"t{index} ", job.call.params)
        job.pieces.append(piece)
        job.call.delivered()
        if piece:
            job.call.emit(piece)
        if stop is not None:
            return job.partial("stop", stop)
        if job.command == "stall" and len(job.pieces) >= job.count:
            # Hangs right after its last token, as the one-call form does: whoever saw that
            # token knows the step is already frozen.
            _block_forever()
        if job.command == "tokens" and len(job.pieces) >= job.count:
            return job.partial(_tokens_end(job.limit, job.call.params))
        return None

    # ---- one-call form -----------------------------------------------------------------

    def _fit(self, call: Call) -> tuple[int | None, int | None]:
        """The request's token limit within the context, and its prompt's tokens."""
        limit = call.params.get("max_new_tokens")
        prompt_tokens = None
        if self.max_model_len is not None:
            prompt_tokens = count_tokens(call.prompt)
            asked, default = requested_new_tokens(call, call.params, self.max_model_len)
            limit = fit_to_context(prompt_tokens, asked, self.max_model_len, default=default)
        elif limit is None and call.params.get(FIT_PARAM) is not True:
            limit = DEFAULT_MAX_NEW_TOKENS  # as the real backends' (fitting: to its end)
        return limit, prompt_tokens

    def generate(self, call: Call) -> str | Generation:
        return self._generate(call, testing_images.read_images(call.prompt, self.vision))

    def _generate(self, call: Call, preamble: str) -> str | Generation:
        """The answer, after ``preamble`` (what it says of the prompt's images)."""
        if preamble:
            call.emit(preamble)
        output = self._with_logprobs(call)
        if not preamble:
            return output
        generation = Generation(output) if isinstance(output, str) else output
        generation.text = preamble + generation.text
        if generation.prompt_tokens is None:
            generation.prompt_tokens = count_tokens(call.prompt)
        return generation

    def _with_logprobs(self, call: Call) -> str | Generation:
        if call.params.get(GRAMMAR_PARAM) is not None:
            pending = self.grammars.start(call.params[GRAMMAR_PARAM], compile_bound(call.params))
            if pending.wait(call.cancelled) is None:
                return Generation("", "cancelled", None, 0)
        output = self._run(call)
        top = call.params.get("logprobs")
        prompt_top = call.params.get("prompt_logprobs")
        if top is None and prompt_top is None:
            return output
        generation = Generation(output) if isinstance(output, str) else output
        if top is not None:
            pieces = _pieces(generation.text) if _command(call) == "tokens" else [generation.text]
            generation.logprobs = _scored(
                [(index, piece) for index, piece in enumerate(pieces) if piece], top
            )
        if prompt_top is not None:
            prompt = call.prompt
            if isinstance(prompt, TokenIds):
                tokens = [(token_id, f"<{token_id}>") for token_id in prompt.ids]
            else:
                tokens = [(ord(char), char) for char in prompt_text(prompt)]
            generation.prompt_logprobs = _scored(tokens, prompt_top, first_scored=False)
            generation.prompt_tokens = len(tokens)
        return generation

    def _run(self, call: Call) -> str | Generation:
        text = command_text(call.prompt)
        command, _, argument = text.partition(":")
        self.check_device()
        limit, prompt_tokens = self._fit(call)
        if limit == 0:
            return Generation("", "length", prompt_tokens, 0)
        if command == "echo":
            echoed, stop = _stopped(argument, call.params)
            return echoed if stop is None else Generation(echoed, stop_sequence=stop)
        if command.startswith("cuda_") or command in ("env", "device", "device_memory", "detach"):
            return self._device_command(command, argument)
        if command == "tokens":
            return _emit_tokens(call, argument, limit, prompt_tokens)
        if command in testing_thinking.COMMANDS:
            return testing_thinking.think(call, command, argument, limit)
        if command == "hang":
            if argument != "term":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _block_forever()
        if command == "stall":
            for index in range(int(argument or 1)):
                call.emit(f"t{index} ")
            _block_forever()
        if command == "segfault":
            ctypes.string_at(0)
        if command == "exit":
            os._exit(int(argument or 1))
        if command in ("raise", "batch_raise"):
            raise RuntimeError(argument or "requested failure")
        if command == "hog":
            _touch(bytearray(int(float(argument) * 1024 * 1024)))
            _block_forever()
        if command == "leak":
            self.hold(float(argument))
            return "ok"
        if command in ("crash_once", "hang_once"):
            if _first_time(argument):
                if command == "crash_once":
                    os._exit(1)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                _block_forever()
            return "ok"
        if command == "pid":
            return str(os.getpid())
        if command == "spin":
            while True:
                time.sleep(_SPIN_STEP_S)
        return text

    def _device_command(self, command: str, argument: str) -> str:
        if command == "env":
            if not self.env_command:
                raise RuntimeError("env: is off (testing backend option env_command = true)")
            return os.environ.get(argument, "")
        if command == "device":
            return self.device
        if command == "detach":
            child = subprocess.Popen(
                [sys.executable, "-c", f"import time; time.sleep({float(argument or 60)})"],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
            return str(child.pid)
        if command == "device_memory":
            return f"{self.allocated_bytes}/{self.cache_releases}"
        if command == "cuda_oom":
            asked_text, _, held_text = argument.partition(":")
            asked = int(asked_text or 2**31)
            self.allocated_bytes += int(float(held_text or 0) * 1024 * 1024)
            raise OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {asked / 2**20:.2f} MiB. GPU 0 has a "
                "total capacity of 79.19 GiB of which 1.06 GiB is free."
            )
        if command == "cuda_sticky":
            self.poisoned = True
            raise RuntimeError(STICKY_MESSAGE)
        if command == "cuda_error":
            raise RuntimeError(f"CUDA error: {argument or 'invalid argument'}")
        raise InvalidRequest(f"unknown testing command {command!r}")


def _command(call: Call) -> str:
    return command_text(call.prompt).partition(":")[0]


def _pieces(text: str) -> list[str]:
    """``"t0 t1 "`` as the tokens it was emitted in: ``["t0 ", "t1 "]``."""
    return [word + " " for word in text.split(" ") if word]


def _scored(tokens: list[tuple[int, str]], top: int, *, first_scored: bool = True) -> TokenLogprobs:
    """Each (id, text) scored TOKEN_LOGPROB with ``top`` alternatives: itself, then made-up
    ones; built as columns, as a real backend would from its tensors. A prompt's first
    token (``first_scored=False``) has no logprob and no alternatives."""
    made_up = [(-1 - rank, f"<alt{rank}>", -2.0 - rank) for rank in range(1, top)]
    counts = [min(top, 1 + len(made_up))] * len(tokens)
    logprobs: list[float | None] = [TOKEN_LOGPROB] * len(tokens)
    if tokens and not first_scored:
        counts[0] = 0
        logprobs[0] = None
    alternatives = [
        alternative
        for (token_id, token), count in zip(tokens, counts, strict=True)
        for alternative in [(token_id, token, TOKEN_LOGPROB), *made_up][:count]
    ]
    return TokenLogprobs.from_columns(
        [token_id for token_id, _ in tokens],
        [token for _, token in tokens],
        logprobs,
        counts,
        [token_id for token_id, _, _ in alternatives],
        [token for _, token, _ in alternatives],
        [logprob for _, _, logprob in alternatives],
    )


def _emit_tokens(
    call: Call, argument: str, limit: int | None, prompt_tokens: int | None
) -> Generation:
    count_text, _, delay_text = argument.partition(":")
    count = _token_count(count_text, limit, call.params)
    delay = float(delay_text or 0)
    pieces: list[str] = []
    pause = threading.Event()
    note_prompt(call, count_tokens(call.prompt) if prompt_tokens is None else prompt_tokens, 0)
    delivered = getattr(call, "delivered", None)
    for index in range(count):
        if call.cancelled():
            return Generation("".join(pieces), "cancelled", prompt_tokens, len(pieces))
        if limit is not None and index >= limit:
            return Generation("".join(pieces), "length", prompt_tokens, len(pieces))
        if delay:
            pause.wait(delay)
        piece, stop = _stopped(f"t{index} ", call.params)
        pieces.append(piece)
        if delivered is not None:
            delivered()
        if piece:
            call.emit(piece)
        if stop is not None:
            text = "".join(pieces)
            return Generation(text, "stop", prompt_tokens, len(pieces), stop_sequence=stop)
    return Generation("".join(pieces), _tokens_end(limit, call.params), prompt_tokens, len(pieces))


def _stopped(text: str, params: dict[str, Any]) -> tuple[str, str | None]:
    """``text`` cut before the first of the request's stop strings in it, and that stop
    string; ``text`` whole and None when none is there."""
    found = first_stop(text, stop_strings(params.get("stop", ())))
    return (text, None) if found is None else (text[: found[0]], found[1])


def _token_count(count_text: str, limit: int | None, params: dict[str, Any]) -> int:
    """Tokens a ``tokens:N`` request emits before its end of sequence: N, or with
    ``ignore_eos`` (as vLLM's) its ``max_new_tokens`` when it has one."""
    count = int(count_text or 16)
    if params.get("ignore_eos") is True and limit is not None:
        return limit
    return count


def _tokens_end(limit: int | None, params: dict[str, Any]) -> FinishReason:
    """A ``tokens`` request that emitted all its tokens: at its end of sequence ("stop"),
    or at ``max_new_tokens`` when ``ignore_eos`` took it there."""
    return "length" if params.get("ignore_eos") is True and limit is not None else "stop"


def _first_time(marker: str) -> bool:
    """Create ``marker`` holding this worker's pid; False if it existed already."""
    try:
        with open(marker, "x") as handle:
            handle.write(str(os.getpid()))
            return True
    except FileExistsError:
        return False


def _touch(block: bytearray) -> None:
    for offset in range(0, len(block), 4096):
        block[offset] = 1


def _block_forever() -> None:
    threading.Event().wait()


def _burn_forever() -> None:
    total = 0
    while True:
        total = (total + 1) % 1_000_003


def load(model: str = "", device: str = "cpu", **options: Any) -> FaultBackend:
    """Factory: ``backend="testing"``. ``model`` is ignored; ``device`` is kept for the
    ``device`` command."""
    unknown = sorted(
        set(options)
        - {
            "env_command",
            "load_delay_s",
            "fail_load",
            "exit_on_load",
            "exit_after_load_s",
            "max_model_len",
            "task",
            "batch_log",
            "hold_mb",
            "pooling_token_s",
            "pooling_batch_tokens",
            "vision",
        }
    )
    if unknown:
        raise ValueError(f"unknown testing backend option {unknown[0]!r}")
    task = options.get("task", "generate")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    max_model_len = check_max_model_len(options.get("max_model_len"))
    if options.get("load_delay_s"):
        time.sleep(float(options["load_delay_s"]))
    if options.get("exit_on_load"):
        os._exit(int(options["exit_on_load"]))
    if options.get("fail_load"):
        raise RuntimeError(f"testing backend asked to fail its load: {options['fail_load']}")
    if options.get("exit_after_load_s") is not None:
        threading.Timer(float(options["exit_after_load_s"]), os._exit, args=(1,)).start()
    batch_log = options.get("batch_log")
    passes = testing_embeddings.Passes(
        float(options.get("pooling_token_s", 0.0)),
        int(options.get("pooling_batch_tokens", testing_embeddings.Passes.batch_tokens)),
    )
    backend = FaultBackend(
        device,
        max_model_len,
        env_command=options.get("env_command") is True,
        task=task,
        batch_log=None if batch_log is None else str(batch_log),
        passes=passes,
        vision=options.get("vision") is True,
    )
    if options.get("hold_mb"):
        backend.hold(int(options["hold_mb"]))
    return backend
