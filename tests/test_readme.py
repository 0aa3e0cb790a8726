"""The README stays a README (issue #44): at most 250 lines, the exact test line that ``.ci/run``
runs, the fast part's command, and links into ``docs/`` that resolve (files and headings)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FAST = 'python3 -m pytest -q -p no:cacheprovider -m "not slow" tests'


def ci_test_line() -> str:
    """The pytest line of ``.ci/run`` (the one after its "README test command" comment)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("# README test command")]
    return lines[i + 1].strip()


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_short_and_holds_both_test_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    ci = ci_test_line()
    assert ci == "python3 -m pytest -q -p no:cacheprovider tests"
    commands = [line for line in text.splitlines() if "pytest" in line]
    assert any(line.endswith(ci) for line in commands), commands
    assert FAST in commands


def test_readme_examples_fit_a_small_host():
    text = README.read_text()
    assert "--swap-space 32" not in text
    assert "--tensor-parallel-size 3" in text and "3 KV heads" in text


def test_links_in_readme_and_docs_resolve():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif frag:
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
                if frag not in {anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target}")
    assert not broken, broken
