"""Codex CLI and Claude Code, installed from npm, each running one turn against a local daemon.

    scripts/agents-check [--cache ~/.cache/modelpool/agents] [--timeout 180]

Installs ``@openai/codex`` and ``@anthropic-ai/claude-code`` into the cache folder (once),
starts ``modelpool serve`` on 127.0.0.1 with the ``testing`` backend (it answers any
prompt, however long an agent's system prompt and tools are), then runs

- ``codex exec "say hi"`` with a ``config.toml`` whose model provider has
  ``wire_api = "responses"`` and the daemon as ``base_url``;
- ``claude -p "say hi" --model modelpool-testing`` with ``ANTHROPIC_BASE_URL`` the daemon;

and reports for each: its exit status and last output, the routes it called (from the
daemon's access log), the number of requests, and the fields the daemon accepted and
ignored (its log). Then both again against a daemon whose context is too small for their
prompts (the testing backend's ``max_model_len``, refused as the hf backend refuses a
prompt past the embedded SmolLM2's 8192): each must show the context-length error it
received in its own API's shape. Last, Claude Code against that small context with its
own prompt left out (``--system-prompt``, ``--tools ""``): its prompt fits, and the
``max_tokens: 32000`` it asks of every model is cut to what the context leaves, so it
must answer. Then a thinking model (docs/reasoning.md): Codex against the testing
backend's scripted thinker (``think:5:hi there``: its answer must be "hi there", the
thinking read as a reasoning item) and Claude Code, its prompt left out, against a tiny
random DeepSeek-R1-like model (``tinymodel.build_thinking_model``): every request it
sends, streamed ``thinking`` blocks and all, must be answered (the random answer runs to
the token maximum, which Claude Code reports as its own error). Only loopback traffic:
the agents' own telemetry and update checks are switched off.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "tests"))

from e2e_support import Daemon, daemon_config, start_daemon  # noqa: E402

PACKAGES = ("@openai/codex", "@anthropic-ai/claude-code")
MODEL = "modelpool-testing"
PROMPT = "say hi"
# A context the agents' prompts do not fit. The testing backend counts a word as a token
# and its messages only (not the tool schemas), so it is set below the 8192 tokens of the
# embedded SmolLM2-135M, which the prompts pass in real tokens.
SMALL_CONTEXT = 1024
ACCESS = re.compile(r"modelpool\.access: ((?:GET|POST|DELETE|HEAD) \S+) (\d{3}) request_id=")
IGNORED = re.compile(r"(POST \S+: (?:accepted and ignored|[a-z ]+ the model cannot call)[^\n]*)")
QUIET_ENV = {
    # Nothing but loopback: no telemetry, error reporting, update or feature-flag calls.
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CODEX_DISABLE_TELEMETRY": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}


@dataclass
class Turn:
    agent: str
    exit_status: int
    output: str
    routes: Counter[str]
    ignored: list[str]


def install(cache: Path) -> Path:
    """The agents' bin folder, installed with npm into ``cache`` when missing."""
    bin_dir = cache / "node_modules" / ".bin"
    if not ((bin_dir / "codex").exists() and (bin_dir / "claude").exists()):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(cache), *PACKAGES],
            check=True,
            timeout=900,
        )
    return bin_dir


def serve(workdir: Path, *args: str, **pool: Any) -> Daemon:
    # Agents' bodies are large (a system prompt and a dozen tool schemas): 8 MiB.
    config = daemon_config(
        **{"workers": 2, **pool},
        deadline_s=60.0,
        server={"max_body_bytes": 8 << 20, "max_request_tokens": 4 << 20},
    )
    return start_daemon(workdir, config, args=args)


def run_codex(
    bin_dir: Path, daemon: Daemon, workdir: Path, timeout: float, prompt: str = PROMPT
) -> subprocess.CompletedProcess[str]:
    home = workdir / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "modelpool"\n'
        "[model_providers.modelpool]\n"
        'name = "modelpool"\n'
        f'base_url = "{daemon.url}/v1"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    env = {**os.environ, **QUIET_ENV, "CODEX_HOME": str(home)}
    return subprocess.run(
        [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", prompt],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        check=False,
    )


# Claude Code with its own system prompt and tools left out: a prompt of a few dozen tokens.
TRIMMED = ("--system-prompt", "You are a helpful assistant.", "--tools", "")


def run_claude(
    bin_dir: Path,
    daemon: Daemon,
    workdir: Path,
    timeout: float,
    *extra: str,
    env_extra: dict[str, str] | None = None,
    prompt: str = PROMPT,
) -> subprocess.CompletedProcess[str]:
    config_dir = workdir / "claude-config"
    config_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **QUIET_ENV,
        "ANTHROPIC_BASE_URL": daemon.url,
        "ANTHROPIC_API_KEY": "sk-local",
        "CLAUDE_CONFIG_DIR": str(config_dir),
        "HOME": str(workdir),
        **(env_extra or {}),
    }
    return subprocess.run(
        [str(bin_dir / "claude"), "-p", prompt, "--model", MODEL, "--max-turns", "1", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def turn(agent: str, daemon: Daemon, done: subprocess.CompletedProcess[str], seen: int) -> Turn:
    log = daemon.log()[seen:]
    routes = Counter(f"{route} {status}" for route, status in ACCESS.findall(log))
    ignored = sorted(set(IGNORED.findall(log)))
    output = (done.stdout.strip() + "\n" + done.stderr.strip()).strip()
    return Turn(agent, done.returncode, output, routes, ignored)


def report(title: str, turns: list[Turn]) -> None:
    print(f"\n=== {title}")
    for item in turns:
        print(f"--- {item.agent}: exit status {item.exit_status}")
        print(f"requests: {sum(item.routes.values())}")
        for route, count in sorted(item.routes.items()):
            print(f"  {count:3d} x {route}")
        print("ignored by the daemon:" + ("" if item.ignored else " nothing"))
        for line in item.ignored:
            print(f"  {line[:400]}")
        lines = [line for line in item.output.splitlines() if line.strip()]
        print("output (last lines):")
        for line in lines[-12:]:
            print(f"  | {line[:300]}")


def round_of_turns(bin_dir: Path, daemon: Daemon, workdir: Path, timeout: float) -> list[Turn]:
    turns = []
    for agent, runner in (("codex exec", run_codex), ("claude -p", run_claude)):
        seen = len(daemon.log())
        try:
            done = runner(bin_dir, daemon, workdir / agent.split()[0], timeout)
        except subprocess.TimeoutExpired as exc:
            done = subprocess.CompletedProcess(exc.cmd, 124, str(exc.stdout or ""), "timed out")
        turns.append(turn(agent, daemon, done, seen))
    return turns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/modelpool/agents")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    bin_dir = install(args.cache)
    for name in ("codex", "claude"):
        version = subprocess.run(
            [str(bin_dir / name), "--version"], capture_output=True, text=True, check=False
        )
        print(f"{name}: {version.stdout.strip()}")
    with tempfile.TemporaryDirectory(prefix="modelpool-agents-") as scratch:
        work = Path(scratch)
        daemon = serve(work / "daemon")
        try:
            turns = round_of_turns(bin_dir, daemon, work, args.timeout)
        finally:
            daemon.stop()
        report("one turn each, testing backend (any prompt fits)", turns)
        small = serve(work / "small", "--max-model-len", str(SMALL_CONTEXT))
        try:
            small_turns = round_of_turns(bin_dir, small, work / "small-run", args.timeout)
            seen = len(small.log())
            trimmed = run_claude(bin_dir, small, work / "trimmed", args.timeout, *TRIMMED)
            trimmed_turn = turn("claude -p (its own prompt left out)", small, trimmed, seen)
        finally:
            small.stop()
        report(f"a context of {SMALL_CONTEXT} tokens: the prompts do not fit", small_turns)
        report(
            f"a context of {SMALL_CONTEXT} tokens, Claude Code's prompt left out: "
            "max_tokens 32000 cut to what fits",
            [trimmed_turn],
        )
        thinking = thinking_turns(bin_dir, work / "thinking", args.timeout)
        report("a thinking model: the thinking apart from the answer", thinking)
    codex_thought, claude_thought = thinking
    # Codex shows the answer alone; Claude Code reads every streamed thinking block (its
    # requests all answered: the random model's answer runs to the token maximum, which
    # Claude Code reports as an error of its own).
    thought = "hi there" in codex_thought.output and "w0" not in codex_thought.output
    thought = thought and all(route.endswith(" 200") for route in claude_thought.routes)
    answered = [*turns, trimmed_turn, codex_thought]
    return 0 if thought and all(item.exit_status == 0 for item in answered) else 1


def thinking_turns(bin_dir: Path, work: Path, timeout: float) -> list[Turn]:
    """Codex on the scripted thinker, Claude Code (trimmed) on a tiny thinking model."""
    daemon = serve(work / "testing")
    try:
        seen = len(daemon.log())
        done = run_codex(bin_dir, daemon, work / "codex", timeout, "think:5:hi there")
        turns = [turn("codex exec (scripted thinker)", daemon, done, seen)]
    finally:
        daemon.stop()
    from modelpool.tinymodel import build_thinking_model

    # A context that Claude Code's trimmed prompt fits, in the tiny tokenizer's tokens.
    model = build_thinking_model(work / "tiny-deepseek", "deepseek_r1", context_length=16384)
    daemon = serve(work / "tiny", model=str(model), backend="hf", workers=1)
    try:
        seen = len(daemon.log())
        # A short answer: the random model's answer would otherwise run to its context.
        short = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}
        done = run_claude(bin_dir, daemon, work / "claude", timeout, *TRIMMED, env_extra=short)
        turns.append(turn("claude -p (tiny DeepSeek-R1-like model)", daemon, done, seen))
    finally:
        daemon.stop()
    return turns


if __name__ == "__main__":
    sys.exit(main())
