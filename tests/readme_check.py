"""The documentation's promises made executable: its code blocks, and the figures it quotes.

The documentation is README.md and every page of the site under docs/
(:func:`documentation_pages`): a block or a figure is checked on whichever page it is.

Code blocks. Every ``bash`` and ``python`` block runs as written (from the repository
root, on the CPU), unless an HTML comment on the line just before its fence says
otherwise, which neither GitHub nor the site shows::

    <!-- readme-check: skip daemon -->          not run, for the reason named
    <!-- readme-check: in examples/library.py -->  its text is in that file, which
                                                   tests/e2e/test_examples.py runs
    <!-- readme-check: output previous -->         (before a block right after one that
                                                   runs) its lines, in order, are lines
                                                   that block prints

A skip names one of :data:`SKIP_REASONS`; any other word is an error, so that every
block left unrun says why.

Figures. Each :class:`Figure` finds a number (or a version) in the pages by a
pattern and compares every quote with what the code says or a fast measurement gives;
a figure that no page quotes any more fails too, so that a figure cannot drift and a
check cannot outlive its figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^<!--\s*readme-check:\s*(?P<verb>\S+)\s+(?P<argument>\S+)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<language>[\w+-]*)\s*$")
RUNNABLE = ("bash", "python")
SKIP_REASONS = {
    "gpu": "needs an NVIDIA GPU",
    "cluster": "needs Docker or a Kubernetes cluster",
    "network": "downloads from the internet",
    "daemon": "needs a running daemon, or runs one until stopped",
    "slow": "takes minutes (the scripts each have a test of their own)",
    "root": "changes the system (sudo)",
    "fragment": "part of a program (a pool named pool), not a program",
}


def documentation_pages(root: Path) -> dict[str, str]:
    """README.md and every Markdown page under docs/, by path relative to ``root``."""
    paths = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8") for path in paths}


@dataclass(frozen=True)
class Block:
    """One fenced code block: the page it is on, where it starts there (1-based line of
    the fence), its language, its text, and the marker before it as (verb, argument), if
    any."""

    page: str
    line: int
    language: str
    text: str
    marker: tuple[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def code_blocks(markdown: str, page: str = "README.md") -> list[Block]:
    blocks = []
    lines = markdown.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index].rstrip() != "```":
            index += 1
        previous = lines[start - 1] if start > 0 else ""
        found = MARKER.match(previous)
        blocks.append(
            Block(
                page=page,
                line=start + 1,
                language=opening.group("language"),
                text="\n".join(lines[start + 1 : index]) + "\n",
                marker=(found.group("verb"), found.group("argument")) if found else None,
            )
        )
        index += 1
    return blocks


def marker_problems(blocks: list[Block], root: Path) -> list[str]:
    """Markers that say nothing checkable: an unknown verb or reason, a missing file, a
    block that is not in the file it names. ``blocks`` are one page's."""
    problems = []
    for block in blocks:
        if block.marker is None:
            continue
        verb, argument = block.marker
        where = block.where
        if verb == "skip":
            if argument not in SKIP_REASONS:
                problems.append(
                    f"{where}: skip reason {argument!r} is none of {', '.join(SKIP_REASONS)}"
                )
        elif verb == "output":
            shown_for = _previous(blocks, block)
            if argument != "previous":
                problems.append(f"{where}: output of {argument!r}? (output previous)")
            elif shown_for is None or shown_for not in blocks_to_run(blocks):
                problems.append(f"{where}: output of a block that is not run")
        elif verb == "in":
            path = root / argument
            if not path.is_file():
                problems.append(f"{where}: {argument} does not exist")
            elif block.text not in path.read_text(encoding="utf-8"):
                problems.append(f"{where}: the block is not, as written, in {argument}")
        else:
            problems.append(f"{where}: unknown marker verb {verb!r} (skip, in or output)")
    return problems


def blocks_to_run(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.language in RUNNABLE and b.marker is None]


def _previous(blocks: list[Block], block: Block) -> Block | None:
    index = blocks.index(block)
    return blocks[index - 1] if index > 0 else None


def expected_output(blocks: list[Block], block: Block) -> list[str] | None:
    """The lines the page shows ``block`` printing (an ``output previous`` block right
    after it), or None when it shows none."""
    index = blocks.index(block)
    if index + 1 < len(blocks) and blocks[index + 1].marker == ("output", "previous"):
        return blocks[index + 1].text.splitlines()
    return None


def output_problems(expected: list[str], printed: str) -> list[str]:
    """The expected lines that the output does not have, in that order."""
    lines = iter(printed.splitlines())
    return [line for line in expected if not any(line == got for got in lines)]


Measured = float | str | None


@dataclass(frozen=True)
class Figure:
    """A figure the documentation quotes: ``pattern`` finds it (group ``value``), ``measure``
    says what it is now (None: cannot be measured here), ``agrees(quoted, measured)``
    whether the quote still holds, and ``source`` says where the truth comes from."""

    name: str
    pattern: str
    measure: Callable[[], Measured]
    source: str
    agrees: Callable[[str, Measured], bool] = lambda quoted, measured: quoted == str(measured)


def within(ratio: float) -> Callable[[str, Measured], bool]:
    """A quote within ``ratio`` (relative) of the measurement."""

    def agrees(quoted: str, measured: Measured) -> bool:
        assert isinstance(measured, float)
        return abs(number(quoted) - measured) <= ratio * measured

    return agrees


def within_factor(factor: float) -> Callable[[str, Measured], bool]:
    """A time quoted for a quiet machine: the measurement on this one may be up to
    ``factor`` times slower, or as many times faster, and no more."""

    def agrees(quoted: str, measured: Measured) -> bool:
        assert isinstance(measured, float)
        return number(quoted) / factor <= measured <= number(quoted) * factor

    return agrees


def number(text: str) -> float:
    return float(text.replace(",", ""))


def figure_problems(pages: Mapping[str, str], figure: Figure, measured: Measured) -> list[str]:
    """Where the quotes of ``figure`` on any of ``pages`` (path: Markdown) disagree with
    ``measured``, or that none quotes it."""
    problems = []
    quotes = 0
    for page, markdown in pages.items():
        for match in re.finditer(figure.pattern, markdown):
            quotes += 1
            quoted = match.group("value")
            if not figure.agrees(quoted, measured):
                line = markdown.count("\n", 0, match.start()) + 1
                shown = f"{measured:.3g}" if isinstance(measured, float) else measured
                problems.append(
                    f"{page} line {line}: {figure.name}: says {quoted}, "
                    f"{figure.source} gives {shown}"
                )
    if quotes == 0:
        return [f"{figure.name}: no page quotes it any more (pattern {figure.pattern!r})"]
    return problems
