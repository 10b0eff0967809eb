"""Codex CLI and Claude Code against a thinking model, as people run them: installed from
npm (once, into ``~/.cache/modelpool/agents``, by ``scripts/agents_check.py``'s
``install``), pointed at a daemon on 127.0.0.1 by the same script's ``run_codex`` and
``run_claude``. Codex on the testing backend's scripted thinker must print the answer,
its thinking read as reasoning (never as the answer); Claude Code, with its own prompt
left out, must have every request answered with the thinking streamed as ``thinking``
blocks, on the scripted thinker and on a tiny random DeepSeek-R1-like hf model. Skipped
only where npm is missing or its registry cannot be reached for the first install."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import Daemon

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import agents_check  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def agents_bin() -> Path:
    """The agents' bin folder; the npm install runs here when the cache lacks them."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm are needed to install Codex CLI and Claude Code")
    cache = Path.home() / ".cache" / "modelpool" / "agents"
    try:
        return agents_check.install(cache)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as failed:
        ping = subprocess.run(
            [npm, "ping"], capture_output=True, text=True, timeout=60, check=False
        )
        if ping.returncode != 0:
            pytest.skip(f"the npm registry is unreachable ({ping.stderr.strip()[-200:]})")
        raise AssertionError(f"npm could not install the agents: {failed}") from failed


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = agents_check.serve(tmp_path_factory.mktemp("scripted"))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def _routes(daemon: Daemon, seen: int) -> list[tuple[str, str]]:
    return agents_check.ACCESS.findall(daemon.log()[seen:])


def _messages(output: str) -> list[dict[str, object]]:
    """Claude Code's ``stream-json`` lines."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]


def _thinking_blocks(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    blocks = []
    for message in messages:
        inner = message.get("message")
        if message.get("type") == "assistant" and isinstance(inner, dict):
            blocks += [b for b in inner.get("content", []) if b.get("type") == "thinking"]
    return blocks


def test_codex_prints_the_answer_and_reads_the_thinking_as_reasoning(
    agents_bin: Path, scripted: Daemon, tmp_path: Path
) -> None:
    seen = len(scripted.log())
    done = agents_check.run_codex(
        agents_bin, scripted, tmp_path / "codex", TIMEOUT_S, "think:5:hi there"
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "hi there" in done.stdout
    assert "w0 w1" not in done.stdout  # the thinking is not the answer
    routes = _routes(scripted, seen)
    assert ("POST /v1/responses", "200") in routes
    assert all(status == "200" for _, status in routes), routes


def _claude(bin_dir: Path, daemon: Daemon, work: Path, prompt: str) -> list[dict[str, object]]:
    done = agents_check.run_claude(
        bin_dir,
        daemon,
        work,
        TIMEOUT_S,
        *agents_check.TRIMMED,
        "--output-format",
        "stream-json",
        "--verbose",
        env_extra={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"},
        prompt=prompt,
    )
    assert done.stdout, done.stderr[-3000:]
    return _messages(done.stdout)


def test_claude_code_gets_thinking_blocks_from_the_scripted_thinker(
    agents_bin: Path, scripted: Daemon, tmp_path: Path
) -> None:
    seen = len(scripted.log())
    messages = _claude(agents_bin, scripted, tmp_path / "claude", "think:5:hi there")
    routes = _routes(scripted, seen)
    assert ("POST /v1/messages", "200") in routes
    assert all(status == "200" for _, status in routes), routes
    thinking = _thinking_blocks(messages)
    assert thinking and thinking[0]["thinking"] == "w0 w1 w2 w3 w4"
    (result,) = [m for m in messages if m.get("type") == "result"]
    assert result.get("result") == "hi there", result


def test_claude_code_on_a_tiny_deepseek_r1_like_model(agents_bin: Path, tmp_path: Path) -> None:
    from modelpool.tinymodel import build_thinking_model

    # A context that Claude Code's trimmed prompt fits, in the tiny tokenizer's tokens.
    model = build_thinking_model(tmp_path / "tiny-r1", "deepseek_r1", context_length=16384)
    daemon = agents_check.serve(tmp_path / "daemon", model=str(model), backend="hf", workers=1)
    try:
        seen = len(daemon.log())
        messages = _claude(agents_bin, daemon, tmp_path / "claude", agents_check.PROMPT)
        routes = _routes(daemon, seen)
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]
    # Every request answered (the random answer runs to the token maximum, which Claude
    # Code reports as its own error), its thinking streamed as a thinking block.
    assert ("POST /v1/messages", "200") in routes
    assert all(status == "200" for _, status in routes), routes
    assert _thinking_blocks(messages)
