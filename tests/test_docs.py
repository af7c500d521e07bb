"""The docs hold together: README's test command is the one `.ci/run` runs, and every relative link in README.md,
ARCHITECTURE.md, docs/, examples/README.md and bench/README.md names a file (and a heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "ARCHITECTURE.md", "examples/README.md", "bench/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / p for p in PAGES] + sorted((ROOT / "docs").glob("*.md"))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readmes_test_command_is_the_one_ci_runs():
    """`.ci/run` says it runs README's test command, kept identical: the line after its comment is in README."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# README's test command (kept identical):") + 1]
    assert command.startswith("pip install") and "pytest" in command
    assert f". .venv/bin/activate && {command}\n" in (ROOT / "README.md").read_text()


def test_readme_links_one_docs_page_per_feature():
    text = (ROOT / "README.md").read_text()
    for name in ["cluster", "groups", "steering", "csv-sae", "cast", "vectors", "sweeps", "troubleshooting"]:
        assert f"](docs/{name}.md)" in text, name
        assert (ROOT / "docs" / f"{name}.md").is_file(), name


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_names_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
