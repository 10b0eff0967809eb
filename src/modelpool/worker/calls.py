"""What both of a worker's loops do with an attempt: the call a backend receives
(:class:`WorkerCall`, and :class:`PoolingCall` for an embed or score request in a batch),
how a ``run`` message becomes one or is answered at once (unreadable, cancelled in flight,
a tokenizer request, a pooling request outside a batch, invalid), the backend's answer
checked down to plain types, and a failure reported typed (a context overflow, a grammar
error, a wrong task, an out-of-memory with its memory recovered first)."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from modelpool.shared.errors import (
    ContextLengthExceeded,
    GrammarError,
    ImageRefused,
    InvalidRequest,
    WrongTask,
)
from modelpool.shared.pooling_answers import (
    answer_pooling_request,
    check_task,
    handler_task,
    wrong_task,
)
from modelpool.shared.processes import process_rss_bytes
from modelpool.shared.protocol import (
    ControlBlock,
    DetokenizeRequest,
    EmbedRequest,
    Generation,
    Handler,
    PrefixCacheReport,
    Prompt,
    ScoreRequest,
    TokenCounts,
    TokenizeRequest,
)
from modelpool.worker import cuda_faults
from modelpool.worker.channel import Channel


class WorkerCall:
    """The ``Call`` a backend receives: prompt, params (``defaulted``: those the pool filled
    in), a cheap cancel check, ``emit``.

    ``slot`` is the attempt's word in the control block. In the one-call loop
    every ``cancelled()`` check counts as progress (a backend that checks the
    flag is alive); in the batched loop only delivered tokens do, since a loop
    that keeps iterating without producing tokens is exactly a stall.
    """

    __slots__ = (
        "_cached_tokens",
        "_channel",
        "_checks_count",
        "_completion_tokens",
        "_control",
        "_prompt_tokens",
        "attempt_id",
        "defaulted",
        "params",
        "prompt",
        "slot",
    )

    def __init__(
        self,
        attempt_id: int,
        slot: int,
        prompt: Prompt,
        params: dict[str, Any],
        control: ControlBlock,
        channel: Channel,
        defaulted: frozenset[str] = frozenset(),
        *,
        checks_count: bool = True,
    ) -> None:
        self.attempt_id = attempt_id
        self.slot = slot
        self.prompt = prompt
        self.params = params
        self.defaulted = defaulted
        self._control = control
        self._channel = channel
        self._checks_count = checks_count
        self._prompt_tokens: int | None = None
        self._cached_tokens = 0
        self._completion_tokens = 0

    def cancelled(self) -> bool:
        if self._checks_count:
            self._control.bump_progress()
        return self._control.cancel_attempt(self.slot) == self.attempt_id

    def emit(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"call.emit() takes str, not {type(text).__name__}")
        if text:
            if self._checks_count:
                self._control.bump_progress()
            counts = None
            if self._prompt_tokens is not None:
                counts = TokenCounts(
                    self._prompt_tokens, self._completion_tokens, self._cached_tokens
                )
            self._channel.send(("chunk", self.attempt_id, text, counts))

    def delivered(self, tokens: int = 1) -> None:
        self._completion_tokens += tokens
        self._control.deliver(self.slot, tokens)

    def note_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The backend read the prompt: its streamed chunks carry token counts from now."""
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens

    def prefilled(self, tokens: int) -> None:
        self._control.bump_progress(tokens)


class PoolingCall(WorkerCall):
    """An embed or score request admitted into a batch (``pooling_answers``): the call,
    with the request it answers (its prompt is empty)."""

    __slots__ = ("request",)

    def __init__(
        self,
        attempt_id: int,
        slot: int,
        request: EmbedRequest | ScoreRequest,
        control: ControlBlock,
        channel: Channel,
    ) -> None:
        # Its cancel checks count as progress, in either loop: a pooling backend reads
        # the flag between micro-batches, and that is how the stall clock sees it alive.
        super().__init__(attempt_id, slot, "", {}, control, channel)
        self.request = request


def read_attempt(
    handler: Handler,
    message: tuple[Any, ...],
    control: ControlBlock,
    channel: Channel,
    defaults: dict[str, Any],
    *,
    checks_count: bool,
    admit_pooling: bool = False,
) -> WorkerCall | None:
    """The attempt's call, or None once it has been answered (unreadable, invalid, or
    cancelled while in flight to us). ``defaults``: the pool's generation defaults, under
    the request's own parameters. ``admit_pooling``: an embed or score request becomes a
    ``PoolingCall`` for the batch, rather than being answered here and now."""
    _, attempt_id, slot, payload = message
    try:
        prompt, own_params = pickle.loads(payload)
    except Exception as exc:
        # A class the caller defined in its own __main__, say: the request's fault, not ours.
        text = f"the request cannot be read in a worker: {exc!r}"
        channel.send(("error", attempt_id, "invalid", text, "", process_rss_bytes()))
        return None
    if control.cancel_attempt(slot) == attempt_id:
        # Cancelled while the request was in flight to us: do not start it at all. The flag
        # is read directly, not through call.cancelled(), so that progress stays at zero
        # until the backend itself reports some (the stall clock starts there).
        channel.send(
            ("done", attempt_id, Generation("", "cancelled", None, 0), process_rss_bytes())
        )
        return None
    if isinstance(prompt, (TokenizeRequest, DetokenizeRequest)):
        _answer_tokenizer_request(handler, attempt_id, prompt, channel)
        return None
    if isinstance(prompt, (EmbedRequest, ScoreRequest)):
        if admit_pooling:
            try:
                check_task(handler_task(handler), prompt, generation=False)
            except WrongTask as exc:
                send_failure(channel, attempt_id, exc)
                return None
            return PoolingCall(attempt_id, slot, prompt, control, channel)
        # The request goes to the backend beside the call, which carries no prompt; its
        # cancel checks count as progress (see PoolingCall).
        call = WorkerCall(attempt_id, slot, "", {}, control, channel)
        try:
            answer = answer_pooling_request(handler, prompt, call)
        except Exception as exc:
            send_failure(channel, attempt_id, exc, handler)
            return None
        channel.send(("done", attempt_id, answer, process_rss_bytes()))
        return None
    task = handler_task(handler)
    if task != "generate":
        send_failure(channel, attempt_id, wrong_task(task, "generate text"))
        return None
    params = {**defaults, **own_params}
    defaulted = frozenset(defaults.keys() - own_params.keys())
    validate = getattr(handler, "validate", None)
    if validate is not None:
        try:
            validate(params)
        except Exception as exc:
            channel.send(("error", attempt_id, "invalid", str(exc), "", process_rss_bytes()))
            return None
    return WorkerCall(
        attempt_id, slot, prompt, params, control, channel, defaulted, checks_count=checks_count
    )


def _answer_tokenizer_request(
    handler: Handler,
    attempt_id: int,
    request: TokenizeRequest | DetokenizeRequest,
    channel: Channel,
) -> None:
    """Tokenize or detokenize with the backend's own tokenizer (the one its generations
    use), between two generation steps: cheap, and never admitted into a batch."""
    name = "tokenize" if isinstance(request, TokenizeRequest) else "detokenize"
    method = getattr(handler, name, None)
    if method is None:
        text = f"this backend ({type(handler).__name__}) does not {name}"
        channel.send(("error", attempt_id, "invalid", text, "", process_rss_bytes()))
        return
    try:
        if isinstance(request, TokenizeRequest):
            ids = [int(token) for token in method(request.prompt, request.add_generation_prompt)]
            answer = Generation("", "stop", len(ids), 0, token_ids=ids)
        else:
            answer = Generation(str(method(list(request.ids))), "stop", len(request.ids), 0)
    except Exception as exc:
        send_failure(channel, attempt_id, exc, handler)
        return
    channel.send(("done", attempt_id, answer, process_rss_bytes()))


class PrefixCacheReporter:
    """Sends the backend's prefix cache report (``handler.prefix_cache_report()``) after a
    request, when it changed: the pool places requests and shows stats by it."""

    def __init__(self, handler: object, channel: Channel) -> None:
        self._report = getattr(handler, "prefix_cache_report", None)
        self._channel = channel
        self._last: PrefixCacheReport | None = None

    def __call__(self) -> None:
        if self._report is None:
            return
        report = self._report()
        if report is not None and report != self._last:
            self._last = report
            self._channel.send(("prefix_cache", report))


def send_failure(
    channel: Channel,
    attempt_id: int,
    exc: BaseException,
    handler: object = None,
    baseline: cuda_faults.MemoryBaseline | None = None,
) -> None:
    if isinstance(exc, ContextLengthExceeded):
        detail = (exc.prompt_tokens, exc.max_new_tokens, exc.max_model_len)
        channel.send(
            ("error", attempt_id, "context_length", str(exc), "", process_rss_bytes(), detail)
        )
        return
    if isinstance(exc, GrammarError):
        # Typed on the other side too: the pool's caller learns the bound or the keyword.
        grammar_detail = {
            "bound_s": getattr(exc, "bound_s", None),
            "param": exc.param,
            "keyword": exc.keyword,
        }
        channel.send(
            ("error", attempt_id, "grammar", str(exc), "", process_rss_bytes(), grammar_detail)
        )
        return
    if isinstance(exc, WrongTask):
        task_detail = {"task": exc.task}
        channel.send(
            ("error", attempt_id, "invalid", str(exc), "", process_rss_bytes(), task_detail)
        )
        return
    if isinstance(exc, ImageRefused):
        image_detail = {"part": exc.part, "reason": exc.reason}
        channel.send(
            ("error", attempt_id, "invalid", str(exc), "", process_rss_bytes(), image_detail)
        )
        return
    if isinstance(exc, InvalidRequest):
        channel.send(("error", attempt_id, "invalid", str(exc), "", process_rss_bytes()))
        return
    kind, text, remote_traceback, details = describe_failure(exc, handler, baseline)
    channel.send(("error", attempt_id, kind, text, remote_traceback, process_rss_bytes(), details))


def describe_failure(
    exc: BaseException, handler: object, baseline: cuda_faults.MemoryBaseline | None = None
) -> tuple[str, str, str, dict[str, Any]]:
    """A backend's exception as (kind, text, traceback, details) for an error message; an
    out-of-memory's memory is recovered first."""
    fault = None if handler is None else cuda_faults.classify(exc, handler)
    text = f"{type(exc).__name__}: {exc}"
    remote_traceback = "".join(traceback.format_exception(exc))
    # The exception's frames (which hold the request's tensors) are let go before an
    # out-of-memory's cache is emptied, so that the memory can really come back.
    exc.__traceback__ = None
    details: dict[str, Any] = {}
    if fault is not None and fault.kind == "oom" and handler is not None:
        details = (baseline or cuda_faults.MemoryBaseline(None)).recover_after_oom(handler, fault)
    kind = "backend" if fault is None else fault.kind
    return kind, text, remote_traceback, details
