"""The README's code layout section draws the tree as it is."""

from __future__ import annotations

import re

from tests.helpers import REPO


def layout_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Code layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_layout_section_names_every_module_and_only_modules_that_exist():
    block = layout_block()
    named = set(re.findall(r"([a-z_]+\.py)", block))
    modules = {p.name for p in (REPO / "unet3d").rglob("*.py") if p.name != "__init__.py"}
    top = {p.name for p in REPO.glob("*.py")}
    data = {p.name for p in (REPO / "data").glob("*.py")}
    assert modules <= named, f"not in the README's layout: {sorted(modules - named)}"
    extra = named - modules - top - data
    assert not extra, f"named in the README but not in the tree: {sorted(extra)}"
    for folder in ("training/", "inference/", "data/", "benchmarks/", "slurm/", "tests/"):
        assert folder in block


def test_each_module_is_drawn_under_its_package():
    current, seen = None, {}
    for line in layout_block().splitlines():
        match = re.match(r"(\s*)(\S+)", line)
        if not match:
            continue
        indent, word = len(match.group(1)), match.group(2)
        if word in ("training/", "inference/"):
            current = word.rstrip("/")
        elif indent <= 2:
            current = None
        for name in re.findall(r"([a-z_]+\.py)", line):
            seen[name] = current
    for path in (REPO / "unet3d").rglob("*.py"):
        if path.name == "__init__.py":
            continue
        package = path.parent.name if path.parent.name != "unet3d" else None
        assert seen[path.name] == package, f"{path.relative_to(REPO)} is drawn under {seen[path.name]}"
