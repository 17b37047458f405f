"""README is for users: short enough to read in two minutes, and every link in it leads somewhere.

A link to a doc's section breaks silently when the section is renamed (results.md's headings name runs), so the
anchors are checked against the headings as GitHub makes them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 120  # what fleet is, the two commands, one table per use, the misses, links
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    headings = [line.lstrip("#") for line in doc.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {github_anchor(h) for h in headings}


def test_github_anchors_are_made_as_github_makes_them():
    assert github_anchor(" `fleet bench testbed`, two seeds per regime") == "fleet-bench-testbed-two-seeds-per-regime"
    assert github_anchor(" The main job: `bash run.sh`") == "the-main-job-bash-runsh"
    assert github_anchor(" 4. Start the SuperNode by hand") == "4-start-the-supernode-by-hand"


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (at most {MAX_LINES})"


def test_every_local_link_in_readme_resolves():
    broken, local = [], [t for t in LINK.findall(README.read_text()) if not t.startswith(("http://", "https://"))]
    assert sum("#" in t for t in local) >= 5, local  # the README links into docs' sections: they are read
    for target in local:
        path, _, anchor = target.partition("#")
        doc = ROOT / path if path else README
        if not doc.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and doc.suffix == ".md" and anchor not in anchors(doc):
            broken.append(f"{target}: no section #{anchor} in {path or 'README.md'}")
    assert not broken, broken
