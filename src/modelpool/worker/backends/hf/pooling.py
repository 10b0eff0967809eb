"""Pooling models on the hf backend: sentence-transformers embedding models and
cross-encoders, read the way sentence-transformers reads them, without it.

A model directory is a pooling model, loaded by :func:`load_pooling` with no setting of
its own (``ModelPool(model=DIR)``; a hub id such as
``sentence-transformers/all-MiniLM-L6-v2`` reads its snapshot in the hub cache, which the
preflight filled), when it holds either

- a sentence-transformers ``modules.json`` (an embedding model, task "embed"): its
  ``Transformer`` module (``AutoModel``; ``max_seq_length`` and ``do_lower_case`` from
  its ``sentence_bert_config.json``), its ``Pooling`` module (``1_Pooling/config.json``:
  the CLS, mean, max, mean-sqrt-len and last-token flags, concatenated in
  sentence-transformers' order when several are set) and an optional ``Normalize``;
  any other module (``Dense``, ...) is refused at load, by name; or
- a ``config.json`` whose ``architectures`` end in ``ForSequenceClassification`` with
  one label (a cross-encoder, task "score"): ``score(query, doc)`` is the sigmoid of its
  logit, or the logit itself with ``raw_scores``.

An embedding model scores by cosine. Texts are stripped (and lower-cased where the
config says) as sentence-transformers does before tokenizing; token ids are fed as they
are. Inputs are packed by tokens, not by count: sorted by length, then cut into
micro-batches whose padded size (rows x longest row) stays under ``batch_tokens``, so one
long text never pads thirty short ones. With ``max_batch_size`` above 1 the handler is
batched (``protocol.BatchedHandler``, ``batches_pooling``): the worker admits every
request that has arrived, and one ``step()`` packs all their rows together, so the
one-text requests of concurrent clients share forward passes. A request is read and
checked (context, vocabulary, dimensions) when admitted, so a bad one fails alone. The
cancel flags are read between micro-batches, and a cancelled request's rows leave the
rest of the step; within a micro-batch they are read before each transformer layer
(``hf.layer_checks.LayerStops``), and once every request with rows in it is cancelled
the pass stops there: a deadline stops an honest worker within one layer's time, where
a whole pass on a loaded CPU can outlast ``cancel_grace_s`` (issue 58).

Load options: ``dtype``, ``torch_threads``, ``max_model_len`` (at most the model's
own), ``trust_remote_code``, ``batch_tokens`` (default ``DEFAULT_BATCH_TOKENS``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from modelpool.shared.context import check_max_model_len
from modelpool.shared.embeddings import check_dimensions
from modelpool.shared.errors import ContextLengthExceeded, InvalidRequest
from modelpool.shared.pooling_answers import PooledBatching
from modelpool.shared.protocol import (
    BatchCall,
    Call,
    EmbedRequest,
    Generation,
    PooledAnswer,
    Prompt,
    ScoreRequest,
    Task,
    TokenIds,
)
from modelpool.worker.backends.common.params import check_load_options, positive_int
from modelpool.worker.backends.hf.layer_checks import ForwardCancelled, LayerStops
from modelpool.worker.backends.hf.options import (
    thread_count,
    torch_device,
    torch_dtype,
    trust_remote_code,
    use_torch_threads,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

POOLING_OPTIONS = frozenset(
    {"dtype", "torch_threads", "max_model_len", "trust_remote_code", "batch_tokens"}
)
DEFAULT_BATCH_TOKENS = 4096
"""Padded tokens per forward pass: 16 rows of 256 tokens, or 256 of 16. A pass is what a
cancel waits for: 16,384 took a small model 2-4 s on two CPU cores, past
``cancel_grace_s``, so a deadline killed the worker (issue 58); 4,096 take a quarter."""

_MODULE_TYPES = {
    "sentence_transformers.models.Transformer": "transformer",
    "sentence_transformers.models.Pooling": "pooling",
    "sentence_transformers.models.Normalize": "normalize",
}
# sentence-transformers' names for the Transformer module's config, model by model.
_ST_CONFIG_NAMES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
PoolingMode = Literal["cls", "max", "mean", "mean_sqrt_len", "lasttoken"]
# The order sentence-transformers concatenates them in (Pooling.forward).
_MODES: tuple[tuple[str, PoolingMode], ...] = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_lasttoken", "lasttoken"),
)


@dataclass(frozen=True)
class EmbeddingLayout:
    """What a sentence-transformers directory's modules say."""

    transformer_dir: Path
    modes: tuple[PoolingMode, ...]
    normalize: bool
    max_seq_length: int | None
    do_lower_case: bool


def model_dir(model: str) -> Path | None:
    """Where ``model``'s files are here: the directory it names, or the hub cache's
    snapshot of the hub id it is (the preflight downloaded it; the hub is not asked);
    None when neither."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # not a hub id (HFValidationError), or no hub client at all
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def pooling_task(model: str) -> Task | None:
    """ "embed" or "score" for a pooling model (a local directory, or a hub id already in
    the hub cache), None for anything else (a generation model). Reads two small JSON
    files."""
    path = model_dir(model)
    if path is None:
        return None
    if (path / "modules.json").is_file():
        return "embed"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") or []
    labels = config.get("num_labels", len(config.get("id2label") or {0: ""}))
    if any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return "score" if labels == 1 else None
    return None


def read_layout(path: Path) -> EmbeddingLayout:
    """The modules of a sentence-transformers directory; ``ValueError`` for one this backend
    does not run (naming the module)."""
    modules = json.loads((path / "modules.json").read_text())
    found: dict[str, Path] = {}
    for module in sorted(modules, key=lambda entry: int(entry.get("idx", 0))):
        kind = _MODULE_TYPES.get(str(module.get("type")))
        if kind is None:
            raise ValueError(
                f"modules.json: module {module.get('name')!r} of type {module.get('type')!r} "
                "is not supported (a Transformer, a Pooling and a Normalize module are)"
            )
        found[kind] = path / str(module.get("path", ""))
    if "transformer" not in found or "pooling" not in found:
        raise ValueError("modules.json needs a Transformer and a Pooling module")
    pooling = json.loads((found["pooling"] / "config.json").read_text())
    modes = tuple(mode for flag, mode in _MODES if pooling.get(flag))
    if not modes:
        raise ValueError(
            f"{found['pooling'] / 'config.json'} sets no pooling mode this backend runs "
            "(CLS, mean, max, mean_sqrt_len, last token)"
        )
    settings: dict[str, Any] = {}
    for name in _ST_CONFIG_NAMES:
        if (found["transformer"] / name).is_file():
            settings = json.loads((found["transformer"] / name).read_text())
            break
    max_seq_length = settings.get("max_seq_length")
    return EmbeddingLayout(
        transformer_dir=found["transformer"],
        modes=modes,
        normalize="normalize" in found,
        max_seq_length=int(max_seq_length) if max_seq_length else None,
        do_lower_case=bool(settings.get("do_lower_case", False)),
    )


def load_pooling(model: str, device: str, task: Task, **options: Any) -> PoolingHandler:
    """The handler of the pooling model in directory ``model`` (``task``: its
    :func:`pooling_task`)."""
    check_load_options(options, POOLING_OPTIONS, "hf (a pooling model)")
    threads = thread_count(options.get("torch_threads"))
    batch_tokens = positive_int("batch_tokens", options.get("batch_tokens", DEFAULT_BATCH_TOKENS))
    max_model_len = check_max_model_len(options.get("max_model_len"))
    trusted = trust_remote_code(options)
    path = model_dir(model) or Path(os.path.expanduser(model))
    layout = read_layout(path) if task == "embed" else None

    started = time.monotonic()
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    use_torch_threads(threads)
    kwargs: dict[str, Any] = {"trust_remote_code": trusted}
    if options.get("dtype") is not None:
        kwargs["dtype"] = torch_dtype(str(options["dtype"]))
    source = path if layout is None else layout.transformer_dir
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trusted)
    loader: Any = AutoModel if layout is not None else AutoModelForSequenceClassification
    network = loader.from_pretrained(source, **kwargs)
    network.to(torch_device(device))
    network.eval()
    limits = [
        getattr(network.config, "max_position_embeddings", None),
        layout.max_seq_length if layout is not None else None,
        max_model_len,
    ]
    if layout is None and 0 < tokenizer.model_max_length < 1_000_000:
        limits.append(tokenizer.model_max_length)
    context = min(int(limit) for limit in limits if limit)
    handler = PoolingHandler(network, tokenizer, task, layout, context, batch_tokens)
    handler.warm_up()
    logger.info(
        "loaded %s (%s, %s) on %s, %d torch threads, context %d tokens, in %.2f s",
        model,
        "embedding model" if layout is not None else "cross-encoder",
        "+".join(layout.modes) if layout is not None else "sequence classification",
        network.device,
        torch.get_num_threads(),
        context,
        time.monotonic() - started,
    )
    return handler


@dataclass(eq=False)
class _Pending:
    """An embed or score request, its rows read, waiting for its forward passes."""

    call: Call
    request: EmbedRequest | ScoreRequest
    features: list[dict[str, list[int]]]
    dimensions: int  # an embedding's, after the cut


class PoolingHandler(PooledBatching):
    """A loaded embedding model or cross-encoder: ``embed`` and ``score`` (see
    ``modelpool.shared.pooling_answers``), in the batched form too (``batches_pooling``: the
    requests a worker holds embedded together), ``tokenize`` and ``detokenize``; no
    generation."""

    def __init__(
        self,
        network: Any,
        tokenizer: Any,
        task: Task,
        layout: EmbeddingLayout | None,
        max_model_len: int,
        batch_tokens: int,
    ) -> None:
        self.network = network
        self.tokenizer = tokenizer
        self.task = task
        self.layout = layout
        self.max_model_len = max_model_len
        self.batch_tokens = batch_tokens
        self.size = int(network.config.hidden_size) * (len(layout.modes) if layout else 1)
        self.vocab_size = int(network.config.vocab_size)
        self._pad_id = int(tokenizer.pad_token_id or 0)
        self._pending: list[tuple[BatchCall, _Pending]] = []
        self._layer_stops = LayerStops(network)

    def warm_up(self) -> None:
        """One forward pass, so that the first request does not pay for torch's first."""
        if self.layout is not None:
            self._forward(self._encode_texts(["warm up"], None, True))
        else:
            self._forward(self._encode_pairs("warm", ["up"], True))

    # ---- the two requests, alone (the one-call loop) -----------------------------------

    def embed(self, request: EmbedRequest, call: Call) -> Generation:
        return self._answers([self._prepare(request, call)])[0]

    def score(self, request: ScoreRequest, call: Call) -> Generation:
        return self._answers([self._prepare(request, call)])[0]

    # ---- batched form: the requests of concurrent clients in shared forward passes -----

    def _prepare(self, request: EmbedRequest | ScoreRequest, call: Call) -> _Pending:
        """``request``'s rows, checked (dimensions, context, vocabulary) before any
        forward pass, so that a bad request fails alone and never in a shared batch."""
        if isinstance(request, EmbedRequest):
            dimensions = check_dimensions(request.dimensions, self.size)
            features = self._features(request.inputs, request.truncate)
            return _Pending(call, request, features, dimensions)
        if self.layout is not None:
            features = self._features((request.query, *request.documents), request.truncate)
        else:
            features = self._encode_pairs(request.query, request.documents, request.truncate)
        return _Pending(call, request, features, self.size)

    def _answers(self, pending: list[_Pending]) -> list[Generation]:
        """Each pending request's answer, in order (``Generation("", "cancelled")`` for one
        whose call was cancelled): every row of every request in micro-batches by tokens;
        the cancel flags are read before each micro-batch, and a cancelled request's rows
        are left out of the ones after; during one, before each layer, and the pass stops
        when every request with rows in it is cancelled."""
        import torch

        rows = [
            (owner, feature) for owner, entry in enumerate(pending) for feature in entry.features
        ]
        width = self.size if self.layout is not None else 1
        out = torch.empty((len(rows), width), dtype=torch.float32)
        cancelled: set[int] = set()
        for batch in self._micro_batches([feature for _, feature in rows]):
            cancelled |= {
                owner for owner, entry in enumerate(pending)
                if owner not in cancelled and entry.call.cancelled()
            }  # fmt: skip
            if len(cancelled) == len(pending):
                break
            batch = [index for index in batch if rows[index][0] not in cancelled]
            if not batch:
                continue
            owners = sorted({rows[index][0] for index in batch})

            def all_cancelled(owners: list[int] = owners) -> bool:
                # Stops at the first request still wanted: one flag read a layer, mostly.
                return all(pending[owner].call.cancelled() for owner in owners)

            try:
                with self._layer_stops.reading(all_cancelled):
                    pooled = self._forward([rows[index][1] for index in batch])
            except ForwardCancelled:
                cancelled |= set(owners)
                continue
            out[torch.tensor(batch)] = pooled.float().cpu().reshape(len(batch), width)
        answers = []
        first = 0
        for owner, entry in enumerate(pending):
            own = out[first : first + len(entry.features)]
            first += len(entry.features)
            if owner in cancelled:
                answers.append(Generation("", "cancelled", 0, 0))
            else:
                answers.append(self._answer(entry, own))
        return answers

    def _answer(self, entry: _Pending, pooled: torch.Tensor) -> Generation:
        """One request's answer from its rows' pooled vectors (logits for a
        cross-encoder)."""
        import torch

        tokens = sum(len(feature["input_ids"]) for feature in entry.features)
        request = entry.request
        if isinstance(request, EmbedRequest):
            assert self.layout is not None
            vectors = pooled
            if self.layout.normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=1)
            if entry.dimensions < self.size:
                vectors = torch.nn.functional.normalize(vectors[:, : entry.dimensions], dim=1)
            answer = PooledAnswer(vectors=vectors.tolist())
        elif self.layout is not None:
            vectors = torch.nn.functional.normalize(pooled, dim=1)
            answer = PooledAnswer(scores=(vectors[1:] @ vectors[0]).tolist(), method="cosine")
        else:
            logits = pooled[:, 0]
            if not request.raw_scores:
                logits = logits.sigmoid()
            answer = PooledAnswer(scores=logits.tolist(), method="cross-encoder")
        return Generation("", "stop", tokens, 0, pooled=answer)

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        if isinstance(prompt, TokenIds):
            return list(prompt.ids)
        if not isinstance(prompt, str):
            raise InvalidRequest("an embedding model tokenizes text, not chat messages")
        return list(self._encode_texts([prompt], None, True)[0]["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    # ---- inputs as features ------------------------------------------------------------

    def _features(
        self, inputs: Sequence[str | tuple[int, ...]], truncate: bool
    ) -> list[dict[str, list[int]]]:
        texts = [(index, item) for index, item in enumerate(inputs) if isinstance(item, str)]
        encoded = self._encode_texts([text for _, text in texts], [i for i, _ in texts], truncate)
        by_index = dict(zip((index for index, _ in texts), encoded, strict=True))
        features = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                features.append(by_index[index])
                continue
            if max(item) >= self.vocab_size:
                raise InvalidRequest(
                    f"input[{index}] has token id {max(item)}, past this model's vocabulary "
                    f"({self.vocab_size} tokens)"
                )
            fits = self._fit(len(item), index, truncate)
            ids = list(item if fits else item[: self.max_model_len])
            features.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
        return features

    def _encode_texts(
        self, texts: list[str], indexes: list[int] | None, truncate: bool
    ) -> list[dict[str, list[int]]]:
        """As sentence-transformers tokenizes a text: stripped, lower-cased if its config
        says so; over the context refused, or (``truncate``) cut as its tokenizer cuts."""
        if not texts:
            return []
        if self.layout is not None and self.layout.do_lower_case:
            texts = [text.lower() for text in texts]
        texts = [text.strip() for text in texts]
        encoded = self.tokenizer(texts, truncation=False, verbose=False)
        rows = _rows(encoded)
        for position, row in enumerate(rows):
            index = position if indexes is None else indexes[position]
            if not self._fit(len(row["input_ids"]), index, truncate):
                cut = self.tokenizer(
                    texts[position], truncation="longest_first", max_length=self.max_model_len
                )
                rows[position] = {key: list(value) for key, value in cut.items()}
        return rows

    def _encode_pairs(
        self, query: str, documents: Sequence[str], truncate: bool
    ) -> list[dict[str, list[int]]]:
        queries = [query.strip()] * len(documents)
        stripped = [document.strip() for document in documents]
        rows = _rows(self.tokenizer(queries, stripped, truncation=False, verbose=False))
        for index, row in enumerate(rows):
            if not self._fit(len(row["input_ids"]), index, truncate, "documents"):
                cut = self.tokenizer(
                    queries[index],
                    stripped[index],
                    truncation="longest_first",
                    max_length=self.max_model_len,
                )
                rows[index] = {key: list(value) for key, value in cut.items()}
        return rows

    def _fit(self, tokens: int, index: int, truncate: bool, field: str = "input") -> bool:
        """True if ``tokens`` fit the context; False if not and ``truncate``; else refused."""
        if tokens <= self.max_model_len:
            return True
        if truncate:
            return False
        raise ContextLengthExceeded(
            f"{field}[{index}] is {tokens} tokens; this model's maximum context length is "
            f"{self.max_model_len} tokens (truncate=True cuts it to fit)",
            prompt_tokens=tokens,
            max_new_tokens=None,
            max_model_len=self.max_model_len,
        )

    # ---- forward passes ----------------------------------------------------------------

    def _micro_batches(self, features: list[dict[str, list[int]]]) -> list[list[int]]:
        """Indexes of ``features`` in micro-batches: longest first, each batch's rows x
        longest row under ``batch_tokens`` (a row longer than that alone)."""
        order = sorted(range(len(features)), key=lambda i: -len(features[i]["input_ids"]))
        batches: list[list[int]] = []
        for index in order:
            # Longest first: a batch's first row is its widest, the width it is padded to.
            if (
                batches
                and len(features[batches[-1][0]]["input_ids"]) * (len(batches[-1]) + 1)
                <= self.batch_tokens
            ):
                batches[-1].append(index)
            else:
                batches.append([index])
        return batches

    def _padded(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        import torch

        width = max(len(row["input_ids"]) for row in rows)
        device = self.network.device
        tensors = {}
        for key in rows[0]:
            pad = self._pad_id if key == "input_ids" else 0
            padded = [row[key] + [pad] * (width - len(row[key])) for row in rows]
            tensors[key] = torch.tensor(padded, dtype=torch.long, device=device)
        return tensors

    def _forward(self, rows: list[dict[str, list[int]]]) -> torch.Tensor:
        """The pooled (not yet normalised) vectors of ``rows``, as sentence-transformers'
        Transformer and Pooling modules compute them; a cross-encoder's logits."""
        import torch

        tensors = self._padded(rows)
        with torch.inference_mode():
            if self.layout is None:
                logits: torch.Tensor = self.network(**tensors).logits
                return logits[:, 0]
            tokens = self.network(**tensors, return_dict=False)[0]
            mask = tensors["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = []
            for mode in self.layout.modes:
                if mode == "cls":
                    pooled.append(tokens[:, 0])
                elif mode == "max":
                    pooled.append(tokens.masked_fill(mask == 0, -1e9).max(dim=1).values)
                elif mode in ("mean", "mean_sqrt_len"):
                    summed = (tokens * mask).sum(dim=1)
                    counts = mask.sum(dim=1).clamp(min=1e-9)
                    pooled.append(summed / (counts if mode == "mean" else counts.sqrt()))
                else:
                    pooled.append(_last_tokens(tokens, tensors["attention_mask"]))
            return torch.cat(pooled, dim=1)


def _last_tokens(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last unpadded token (padding on either side)."""
    import torch

    width = attention_mask.shape[1]
    values, flipped = attention_mask.flip(1).max(dim=1)
    flipped = torch.where(values == 0, width - 1, flipped)
    last = width - flipped - 1
    return tokens[torch.arange(tokens.shape[0], device=tokens.device), last]


def _rows(encoded: Any) -> list[dict[str, list[int]]]:
    """A batch tokenizer output as one feature dict per row."""
    keys = [key for key in ("input_ids", "attention_mask", "token_type_ids") if key in encoded]
    return [
        {key: list(encoded[key][row]) for key in keys} for row in range(len(encoded["input_ids"]))
    ]
