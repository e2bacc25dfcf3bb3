"""Where a study puts its table in a docs page: between two markers of its own, so that running the study again
replaces that table and leaves the page's prose and other tables as they were."""

from __future__ import annotations

from pathlib import Path


def put_block(path: Path, start: str, end: str, body: str, title: str) -> None:
    """`body` between the markers `start` and `end` in `path`: in place of what they held, else appended (a page
    that does not exist yet is made with `title` as its heading)."""
    block = f"{start}\n{body}\n{end}"
    text = path.read_text() if path.exists() else f"# {title}\n"
    begin = text.find(start)
    finish = text.find(end, begin) if begin >= 0 else -1
    if finish >= 0:
        text = text[:begin] + block + text[finish + len(end):]
    else:
        text = text.rstrip() + f"\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
