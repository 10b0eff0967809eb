"""What the OpenAI-compatible routes cost clients, measured side by side in one run.

    scripts/measure-openai [--rounds 8]

- a request whose deadline passes, through the official ``openai`` client with its
  default retries: wall time and the number of POSTs the daemon logged (the client
  obeys ``x-should-retry: false``; before that header it sent 3 and waited ~3 s);
- ``logprobs=5`` against the same 64-token greedy generation without, in the hf
  backend on the embedded SmolLM2 model, interleaved: median seconds and the ratio.

lm-eval's wall time through the daemon vs in process is printed by
``tests/e2e/test_lm_eval.py`` (run it with ``-s``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from e2e_support import daemon_config, free_port, start_daemon  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
TOKENS = 64


class _Call:
    def __init__(self, params: dict[str, Any]) -> None:
        self.prompt = PROMPT
        self.params = params

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        pass


def deadline_through_openai_client(workdir: Path) -> None:
    import openai

    port = free_port()
    daemon = start_daemon(workdir, daemon_config(port), port)
    try:
        with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=30) as client:
            started = time.monotonic()
            try:
                client.completions.create(model="m", prompt="hang", extra_body={"timeout": 0.5})
            except openai.APIStatusError as error:
                status = error.status_code
            seconds = time.monotonic() - started
    finally:
        daemon.stop()
    posts = daemon.log().count("POST /v1/completions 504")
    print(f"deadline 0.5 s via openai client: status {status}, {seconds:.2f} s, {posts} POST(s)")


def logprobs_overhead(rounds: int) -> None:
    from modelpool.shared.embedded import prepare_model
    from modelpool.worker.backends.hf import load

    handler = load(str(prepare_model(progress=False)), dtype="float32")
    plain = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS}
    timings: dict[str, list[float]] = {"without": [], "logprobs=5": []}
    for _ in range(rounds):
        for name, params in (("without", plain), ("logprobs=5", {**plain, "logprobs": 5})):
            started = time.perf_counter()
            generation = handler.generate(_Call(params))  # type: ignore[arg-type]
            timings[name].append(time.perf_counter() - started)
            assert generation.completion_tokens == TOKENS
    base = statistics.median(timings["without"])
    with_logprobs = statistics.median(timings["logprobs=5"])
    print(
        f"{TOKENS} tokens, median of {rounds}: without {base:.3f} s, "
        f"logprobs=5 {with_logprobs:.3f} s, ratio {with_logprobs / base:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        deadline_through_openai_client(Path(scratch))
    logprobs_overhead(args.rounds)


if __name__ == "__main__":
    main()
