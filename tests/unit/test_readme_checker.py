"""tests/readme_check.py: what it runs, what it skips, and a wrong figure failing, on
whichever page of the documentation it is."""

from __future__ import annotations

from pathlib import Path

from readme_check import (
    Figure,
    blocks_to_run,
    code_blocks,
    documentation_pages,
    expected_output,
    figure_problems,
    marker_problems,
    output_problems,
    within,
    within_factor,
)

SAMPLE = """# A project

The whole suite: about 413 tests, and it loads in about 4 s.

```bash
echo runs
```

<!-- readme-check: skip cluster -->
```bash
kubectl apply -f x.yaml
```

<!-- readme-check: in example.py -->
```python
print("hello")
```

```toml
key = 1
```
"""


def test_unmarked_bash_and_python_blocks_run_and_marked_ones_do_not() -> None:
    blocks = code_blocks(SAMPLE)
    assert [(b.line, b.language, b.marker) for b in blocks] == [
        (5, "bash", None),
        (10, "bash", ("skip", "cluster")),
        (15, "python", ("in", "example.py")),
        (19, "toml", None),
    ]
    assert [b.text for b in blocks_to_run(blocks)] == ["echo runs\n"]


def test_markers_must_name_a_known_reason_and_a_file_holding_the_block(tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text('import sys\nprint("hello")\n')
    assert marker_problems(code_blocks(SAMPLE), tmp_path) == []

    (tmp_path / "example.py").write_text('print("hello, world")\n')
    wrong = SAMPLE.replace("skip cluster", "skip later")
    assert marker_problems(code_blocks(wrong), tmp_path) == [
        "README.md line 10: skip reason 'later' is none of "
        "gpu, cluster, network, daemon, slow, root, fragment",
        "README.md line 15: the block is not, as written, in example.py",
    ]
    missing = SAMPLE.replace("in example.py", "in gone.py").replace("skip cluster", "run x")
    assert marker_problems(code_blocks(missing), tmp_path) == [
        "README.md line 10: unknown marker verb 'run' (skip, in or output)",
        "README.md line 15: gone.py does not exist",
    ]


TEST_COUNT = Figure(
    "test count",
    r"The whole suite: about (?P<value>[\d,]+) tests",
    lambda: 788.0,
    "pytest --collect-only",
    within(0.15),
)


def test_a_deliberately_wrong_figure_fails_with_where_and_what() -> None:
    # The README's old figure (413) against what the suite collected (788).
    assert figure_problems({"README.md": SAMPLE}, TEST_COUNT, 788.0) == [
        "README.md line 3: test count: says 413, pytest --collect-only gives 788"
    ]
    assert figure_problems({"README.md": SAMPLE.replace("413", "800")}, TEST_COUNT, 788.0) == []


def test_a_figure_the_readme_no_longer_quotes_fails_too() -> None:
    gone = SAMPLE.replace("about 413 tests", "many tests")
    assert figure_problems({"README.md": gone}, TEST_COUNT, 788.0) == [
        "test count: no page quotes it any more "
        "(pattern 'The whole suite: about (?P<value>[\\\\d,]+) tests')"
    ]


def test_a_figure_is_checked_on_every_page_that_quotes_it(tmp_path: Path) -> None:
    # Moved from the README to a page of the site, it is still checked; quoted on both,
    # each quote is.
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# A project\n\nSee the docs.\n")
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    (tmp_path / "docs" / "guide" / "testing.md").write_text(SAMPLE)
    pages = documentation_pages(tmp_path)
    assert list(pages) == ["README.md", "docs/guide/testing.md", "docs/index.md"]
    assert figure_problems(pages, TEST_COUNT, 788.0) == [
        "docs/guide/testing.md line 3: test count: says 413, pytest --collect-only gives 788"
    ]
    pages["README.md"] = "The whole suite: about 790 tests.\n"
    assert figure_problems(pages, TEST_COUNT, 788.0) == [
        "docs/guide/testing.md line 3: test count: says 413, pytest --collect-only gives 788"
    ]
    pages["docs/guide/testing.md"] = SAMPLE.replace("413", "800")
    assert figure_problems(pages, TEST_COUNT, 788.0) == []


def test_a_block_on_a_page_is_reported_by_its_page(tmp_path: Path) -> None:
    blocks = code_blocks(SAMPLE.replace("skip cluster", "skip later"), "docs/deploy.md")
    assert blocks[0].where == "docs/deploy.md line 5"
    (tmp_path / "example.py").write_text('print("hello")\n')
    assert marker_problems(blocks, tmp_path) == [
        "docs/deploy.md line 10: skip reason 'later' is none of "
        "gpu, cluster, network, daemon, slow, root, fragment"
    ]


def test_exact_and_timed_figures() -> None:
    version = Figure("pin", r"torch==(?P<value>[\d.]+)", lambda: "2.13.0", "the pin")
    assert figure_problems({"README.md": "torch==2.13.0"}, version, "2.13.0") == []
    assert figure_problems({"README.md": "torch==2.12.0"}, version, "2.13.0") == [
        "README.md line 1: pin: says 2.12.0, the pin gives 2.13.0"
    ]
    load = Figure(
        "load", r"loads in about (?P<value>[\d.]+) s", lambda: 4.3, "a load", within_factor(4)
    )
    assert figure_problems({"README.md": SAMPLE}, load, 4.3) == []
    readme = {"README.md": SAMPLE}
    assert figure_problems(readme, load, 17.0) != []  # four times slower than quoted, and more
    faster = {"README.md": SAMPLE.replace("about 4 s", "about 0.5 s")}
    assert figure_problems(faster, load, 4.3) != []


SHOWN = """```bash
printf 'a\\nb\\nc\\n'
```

<!-- readme-check: output previous -->
```
a
c
```
"""


def test_an_output_block_is_what_the_block_before_it_prints() -> None:
    blocks = code_blocks(SHOWN)
    assert marker_problems(blocks, Path(".")) == []
    assert expected_output(blocks, blocks[0]) == ["a", "c"]
    assert output_problems(["a", "c"], "a\nb\nc\n") == []
    assert output_problems(["a", "c"], "c\na\n") == ["c"]  # in order
    assert output_problems(["a", "d"], "a\nb\nc\n") == ["d"]
    skipped = "<!-- readme-check: skip slow -->\n" + SHOWN
    assert marker_problems(code_blocks(skipped), Path(".")) == [
        "README.md line 7: output of a block that is not run"
    ]
