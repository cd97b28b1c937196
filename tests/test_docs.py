"""The method guide (docs/methods.md): its sections, the references to them, and the paths it cites.

Code, configs, tutorials and benchmarks cite the guide as ``docs/methods.md §N``; every such reference must
name a section heading of the guide (``## §N. Title``). The guide is the project's own: nothing may point at
the engineers' reference notes it replaced (cited as ``METHODS.md`` or ``METHODS §N``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "methods.md"
#: What is scanned for references: the package, its tests, configs, tutorials, benchmarks and top-level docs.
SCANNED_DIRS = ("lightning_llm", "tests", "configs", "tutorials", "benchmarks", "docs", "tools")
SCANNED_FILES = ("README.md", "pyproject.toml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".ipynb", ".toml", ".txt", ".json"}
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints", "results"}

SECTION_HEADING = re.compile(r"^## §(\d+)\. \S", re.MULTILINE)
REFERENCE = re.compile(r"docs/methods\.md[ \t]*§[ \t]*(\d+)")
# The retired reference file, as cited in prose: "<name>.md", "<name> §N", "<name> marks ...", "(<name>: ...".
# A bare upper-case identifier of the same name (a constant such as ``pruning.METHODS``) is not a reference.
RETIRED_NAME = "METHODS"
RETIRED_REFERENCE = re.compile(rf"\b{RETIRED_NAME}(?:\.md|[ \t]*§|[ \t]+(?:marks|notes|says)\b|: [a-z])")
# Repository paths cited in backticks: rooted ones, and package-relative ones such as `eviction/memory.py`.
ROOTS = "lightning_llm|tests|tutorials|configs|benchmarks|docs|tools|experiments"
ROOTED_PATH = re.compile(rf"`((?:{ROOTS})/[^`\s*]+)`")
PACKAGE_PATH = re.compile(rf"`(?!(?:{ROOTS})/)([a-z_]+/[a-z_/]*[a-z_]+\.py)`")


def _scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for directory in SCANNED_DIRS:
        for path in sorted((ROOT / directory).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and not SKIPPED_PARTS.intersection(path.parts):
                files.append(path)
    return files


def _sections() -> list[int]:
    return [int(n) for n in SECTION_HEADING.findall(GUIDE.read_text(encoding="utf-8"))]


def _exists(relative: str) -> bool:
    """A cited path exists as given, or (for ``x.py``) as the package ``x/`` it was split into."""
    path = ROOT / relative
    return path.exists() or (path.suffix == ".py" and (path.with_suffix("") / "__init__.py").is_file())


def test_guide_has_sections_0_to_19_once_each_in_order():
    assert _sections() == list(range(20))


def test_every_methods_reference_resolves_to_a_section():
    sections = set(_sections())
    dangling = [
        f"{path.relative_to(ROOT)}: §{number}"
        for path in _scanned_files()
        for number in REFERENCE.findall(path.read_text(encoding="utf-8", errors="replace"))
        if int(number) not in sections
    ]
    assert not dangling, "references to sections docs/methods.md does not have:\n" + "\n".join(dangling)


def test_nothing_cites_the_retired_reference_file():
    offenders = []
    for path in _scanned_files():
        if path == Path(__file__):  # this file names what it forbids
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in RETIRED_REFERENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not offenders, "cite docs/methods.md §N instead:\n" + "\n".join(offenders)


def test_guide_links_to_its_own_headings_resolve():
    text = GUIDE.read_text(encoding="utf-8")
    # GitHub's anchors: the heading lower-cased, punctuation other than "-" and "_" dropped, spaces to "-".
    anchors = {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{2,3} (.+)$", text, re.MULTILINE)
    }
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    assert not broken, f"links to anchors no heading of docs/methods.md has: {broken}"


def test_paths_cited_by_the_guide_exist():
    text = GUIDE.read_text(encoding="utf-8")
    cited = set(ROOTED_PATH.findall(text)) | {f"lightning_llm/{path}" for path in PACKAGE_PATH.findall(text)}
    missing = sorted(path for path in cited if not _exists(path))
    assert not missing, "docs/methods.md cites paths that do not exist:\n" + "\n".join(missing)
