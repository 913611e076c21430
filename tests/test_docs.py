"""The documentation holds together: the README's opening takes a reader from nothing to a
scrape, every link between the pages resolves (anchors included), every metric family the code
defines is in docs/metrics.md and every name there is one the code defines, code blocks parse,
and the synthetic accuracy figures say so wherever they are quoted."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", ROOT / "alerts" / "README.md",
                ROOT / "deploy" / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
METRIC_NAME = re.compile(r"[\"'](gpumon_[a-z0-9_]+)[\"']")
DOCUMENTED_METRIC = re.compile(r"`(gpumon_[a-z0-9_]+)")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_opening_goes_from_install_to_a_scrape() -> None:
    opening = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for needed in ("Python ≥", "pip install", "from gpumon.client import StepMonitor", "mon.step(",
                   "mon.watch(", "gpumon agent", "/metrics", "scripts/agent", "scripts/test"):
        assert needed in opening, f"the README's first 60 lines do not show {needed!r}"
    order = [opening.index(s) for s in ("pip install", "StepMonitor", "gpumon agent", "curl")]
    assert order == sorted(order), "install, hook, agent and scrape should come in that order"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {page_id(linked)}")
    assert not broken, f"{page_id(page)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_parse_and_no_placeholders(page: Path) -> None:
    text = page.read_text()
    assert "TODO" not in text and "FIXME" not in text
    for lang, code in FENCE.findall(text):
        if lang == "python":
            ast.parse(code, filename=page_id(page))


def test_metrics_page_lists_what_the_code_defines() -> None:
    defined = {m for path in (ROOT / "gpumon").rglob("*.py")
               for m in METRIC_NAME.findall(path.read_text())}
    assert len(defined) > 50, "the metric names are no longer found in the code"
    documented = set(DOCUMENTED_METRIC.findall((ROOT / "docs" / "metrics.md").read_text()))

    def forms(name: str) -> set[str]:  # counters gain _total, info families _info
        return {name, f"{name}_total", f"{name}_info"}

    undocumented = sorted(n for n in defined if not forms(n) & documented)
    unknown = sorted(d for d in documented if not any(d in forms(n) for n in defined))
    assert undocumented == [], f"defined in gpumon/ but missing from docs/metrics.md: {undocumented}"
    assert unknown == [], f"in docs/metrics.md but defined nowhere in gpumon/: {unknown}"


def test_synthetic_accuracy_is_labelled_wherever_it_is_quoted() -> None:
    unlabelled = [
        f"{page_id(page)}: {line.strip()}"
        for page in PAGES for line in page.read_text().splitlines()
        if re.search(r"gpu_(communication|compute|memory_bandwidth)\b.*\d+(\.\d+)? ?%", line)
        and "synthetic" not in line
    ]
    assert unlabelled == []


def test_the_readme_install_lists_every_extra_a_command_asks_for() -> None:
    """An extra the product tells a user to install (``gpumon report``: ``[report]``) is
    listed where the README installs, and so is every other one a user may want."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    extras.discard("dev")  # the repository's own tests
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    asked = set(re.findall(r"gpumon\[(\w+)\]", "\n".join(
        p.read_text() for p in (ROOT / "gpumon").rglob("*.py"))))
    assert asked and asked <= extras, asked
    missing = sorted(e for e in extras if f"[{e}]" not in install)
    assert not missing, f"the README's install does not list {missing}"
    # the demo draws the page when it stops: scripts/agent says what the page needs
    assert "'.[report]'" in (ROOT / "scripts" / "agent").read_text()


def test_the_analysis_index_names_every_module_and_every_import_from_outside() -> None:
    """``gpumon/analysis/__init__.py`` is the room's index: a module missing from it, or an
    import from another room it does not admit to, is what a newcomer would not find."""
    room = ROOT / "gpumon" / "analysis"
    index = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
    named = set(re.findall(r"``([\w.]+)``", index))
    modules = {p.stem for p in room.glob("*.py") if p.stem != "__init__"}
    assert modules - named == set()
    outside = set()
    for path in room.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("gpumon.") \
                    and not node.module.startswith("gpumon.analysis"):
                outside.add(node.module)
    assert outside - named == set()
