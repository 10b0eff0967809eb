"""lm-eval against the daemon serving the embedded model, compared with lm-eval's own
in-process ``hf`` model on the same weights.

The tasks are the repository's (``evals/``, local data files): 20 capital cities by
greedy generation and 20 sums scored by loglikelihood, through ``local-completions``
(token-id prompts, ``echo`` + ``logprobs``) and, for the generation task,
``local-chat-completions``. lm-eval runs as the command a user types, with the hub and
datasets offline and the tokenizer read from the prepared model's directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import REPO, Daemon, prepare_embedded_model, start_daemon

pytestmark = pytest.mark.slow

GENERATE_TASK = "modelpool_capitals"
LOGLIKELIHOOD_TASK = "modelpool_arithmetic_choice"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# OpenMP threads that sleep rather than spin while waiting: on a busy machine the
# in-process model's spinning threads would otherwise starve each other (and the daemon).
QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}
# Both sides run the model in float32 on the CPU, one sequence at a time; what differs
# is the shape of the forward pass (the daemon scores the whole sequence).
LOGPROB_TOLERANCE = 1e-3

Samples = dict[str, list[dict[str, Any]]]


def lm_eval_command() -> list[str]:
    script = Path(sys.executable).parent / "lm-eval"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lm_eval"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    pytest.importorskip("lm_eval")
    return prepare_embedded_model()


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = start_daemon(
        tmp_path_factory.mktemp("lm-eval-daemon"),
        None,
        config_path=REPO / "configs" / "default.toml",
        # hf on the CPU: compared with transformers' own answers on the same float32 weights
        # ("auto" would serve the embedded GGUF, a 4-bit quantization, on llama_cpp).
        args=("--devices", "cpu", "--backend", "hf"),
        cwd=REPO,
        ready_timeout=600.0,
    )
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def run_lm_eval(
    out: Path, model: str, model_args: str, tasks: list[str], *, chat: bool = False
) -> tuple[Samples, float]:
    """Run the lm-eval command; the per-document samples of each task and the wall time."""
    command = [
        *lm_eval_command(),
        "run",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        ",".join(tasks),
        "--include_path",
        "evals",
        "--log_samples",
        "--output_path",
        str(out),
        "--device",
        "cpu",
    ]
    if chat:
        command.append("--apply_chat_template")
    started = time.monotonic()
    finished = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        cwd=REPO,
        env={**os.environ, **OFFLINE, **QUIET_THREADS},
    )
    seconds = time.monotonic() - started
    assert finished.returncode == 0, finished.stderr[-6000:]
    samples: Samples = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        docs = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = sorted(docs, key=lambda doc: doc["doc_id"])
        assert len(samples[task]) == 20, f"{task} did not run to the end"
    return samples, seconds


def api_args(daemon: Daemon, model_dir: Path, route: str) -> str:
    return ",".join(
        [
            "model=smollm2-135m-instruct",
            f"base_url={daemon.url}/v1/{route}",
            f"tokenizer={model_dir}",
            "tokenizer_backend=huggingface",
            "num_concurrent=2",
            "max_retries=1",
            "timeout=600",
        ]
    )


def in_process_args(model_dir: Path) -> str:
    return f"pretrained={model_dir},dtype=float32"


def generations(samples: Samples) -> list[str]:
    return [doc["filtered_resps"][0] for doc in samples[GENERATE_TASK]]


def test_lm_eval_scores_equal_in_process_hf(
    served: Daemon, model_dir: Path, tmp_path: Path
) -> None:
    both = [GENERATE_TASK, LOGLIKELIHOOD_TASK]
    through_daemon, daemon_s = run_lm_eval(
        tmp_path / "served", "local-completions", api_args(served, model_dir, "completions"), both
    )
    in_process, in_process_s = run_lm_eval(tmp_path / "hf", "hf", in_process_args(model_dir), both)
    print(f"lm-eval wall time: daemon {daemon_s:.1f} s, in process {in_process_s:.1f} s")

    assert generations(through_daemon) == generations(in_process)
    assert any(text.strip() for text in generations(through_daemon))  # it generated
    for served_doc, local_doc in zip(
        through_daemon[LOGLIKELIHOOD_TASK], in_process[LOGLIKELIHOOD_TASK], strict=True
    ):
        served_scores = [float(logprob) for logprob, _ in served_doc["filtered_resps"]]
        local_scores = [float(logprob) for logprob, _ in local_doc["filtered_resps"]]
        assert served_scores == pytest.approx(local_scores, abs=LOGPROB_TOLERANCE)
        assert served_doc["acc"] == local_doc["acc"]
        assert all(score < 0 for score in served_scores)


def test_lm_eval_chat_generations_equal_in_process_hf(
    served: Daemon, model_dir: Path, tmp_path: Path
) -> None:
    through_daemon, _ = run_lm_eval(
        tmp_path / "served-chat",
        "local-chat-completions",
        api_args(served, model_dir, "chat/completions"),
        [GENERATE_TASK],
        chat=True,
    )
    in_process, _ = run_lm_eval(
        tmp_path / "hf-chat", "hf", in_process_args(model_dir), [GENERATE_TASK], chat=True
    )
    assert generations(through_daemon) == generations(in_process)
    assert any(text.strip() for text in generations(through_daemon))
