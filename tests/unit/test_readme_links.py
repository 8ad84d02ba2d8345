"""Every relative link in the repository's Markdown resolves inside a fresh clone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked_markdown() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in names]


def test_relative_markdown_links_point_at_files_in_the_repository() -> None:
    tracked = {p.resolve() for p in tracked_markdown()}
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    in_repo = {(ROOT / n).resolve() for n in files.stdout.split()}
    in_repo |= {p.parent for p in in_repo}  # a link to a folder
    broken = []
    for doc in tracked:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if path not in in_repo:
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "links to files not in the repository: " + ", ".join(broken)
