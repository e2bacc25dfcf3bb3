"""The design notes live in the repository (docs/design.md), and every reference to them names a section that
exists there, so a renumbering or a reference to notes kept elsewhere shows up here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
OUTSIDE_NOTES = "DESIGN" + ".md"  # notes that were never in the repository (spelled apart: this file cites none)
SEARCHED = ("infemeral", "scripts", "tests", "docs", "docker", "protos")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".proto", ".sh", ".cfg", ".yml", ".yaml", ".json"}
REFERENCE = re.compile(r"design\.md(?: §(\d+)|#([a-z0-9-]+))")


def project_texts() -> dict[Path, str]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder in SEARCHED:
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "Dockerfile")
                  and "__pycache__" not in p.parts and "data" not in p.relative_to(ROOT).parts[:2]]
    return {p: p.read_text(errors="replace") for p in files if p.exists() and p != Path(__file__).resolve()}


def sections(design: str) -> tuple[set[str], set[str]]:
    """The section numbers ("## 3. ...") and the fixed anchors (<a id="...">) of the design notes."""
    return set(re.findall(r"^## (\d+)\. ", design, re.MULTILINE)), set(re.findall(r'<a id="([a-z0-9-]+)"></a>', design))


def dangling(text: str, design: str) -> list[str]:
    """The references in `text` to a section or anchor the design notes lack."""
    numbers, anchors = sections(design)
    return [match.group(0) for match in REFERENCE.finditer(text)
            if (match.group(1) or match.group(2)) not in (numbers if match.group(1) else anchors)]


def test_the_design_notes_have_their_numbered_sections_and_anchors():
    numbers, anchors = sections(DESIGN.read_text())
    assert numbers == {str(n) for n in range(1, len(numbers) + 1)} and len(numbers) >= 15
    assert len(anchors) == len(numbers)
    assert dangling("see docs/design.md §1 and design.md#cloak", DESIGN.read_text()) == []
    assert dangling("see docs/design.md §99 and design.md#nowhere", DESIGN.read_text()) == \
        ["design.md §99", "design.md#nowhere"]


def test_no_file_cites_notes_outside_the_repository():
    citing = sorted(str(p.relative_to(ROOT)) for p, text in project_texts().items() if OUTSIDE_NOTES in text)
    assert not citing, f"cite docs/design.md instead of {OUTSIDE_NOTES} in: {', '.join(citing)}"


def test_every_reference_to_the_design_notes_names_a_section_there():
    design = DESIGN.read_text()
    texts = project_texts()
    references = sum(len(REFERENCE.findall(text)) for text in texts.values())
    assert references >= 20, "the references to the design notes were not found"
    wrong = {str(p.relative_to(ROOT)): refs for p, text in texts.items() if (refs := dangling(text, design))}
    assert not wrong, f"references to sections docs/design.md does not have: {wrong}"


def test_the_design_notes_refer_to_their_own_sections_correctly():
    design = DESIGN.read_text()
    numbers, _ = sections(design)
    assert set(re.findall(r"§(\d+)", design)) <= numbers
