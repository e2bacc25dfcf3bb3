"""The audit's findings: one row per attack, a plain-language verdict, and a JSON form for scripts.

Recovered tokens are the user's secrets: rows keep them in memory for the caller, and the
printed and JSON forms show them only when asked (`show_tokens`).
"""

from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import asdict, dataclass, field

COLUMNS = ("attack", "observer knows", "whole prompt", "your own text", "time")
GAP = "  "          # between columns
MIN_COLUMN = 12     # narrower than this a column of prose reads badly: the table becomes one block per attack


def terminal_width() -> int:
    """Columns of the terminal the report is printed to (COLUMNS, then the terminal; 100 for a pipe or file)."""
    return shutil.get_terminal_size((100, 24)).columns


@dataclass
class Row:
    key: str                  # norms_raw, norms, gram, vocabulary, kv, identification
    attack: str
    observer: str             # what the observer knows
    overall: str              # result over the whole templated prompt
    user_text: str            # result over the user's own message
    time: str
    metrics: dict = field(default_factory=dict)
    recovered_text: str | None = None  # the user's text as this observer recovers it
    user_recovered: list[bool] | None = None  # per token of the user's text: does this observer recover it


@dataclass
class AuditReport:
    prompt_tokens: int
    user_tokens: int
    client_layers: int
    wire_dtype: str
    public_weights: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    user_token_text: list[str] | None = None  # the user's text token by token, as the rows' flags are

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    def metric(self, key: str, name: str, default=None):
        row = self.row(key)
        return row.metrics.get(name, default) if row else default

    # -- forms --------------------------------------------------------------------------------
    def table(self, width: int | None = None) -> str:
        """The rows as a table `width` columns wide (default: the terminal's), its cells wrapped to fit; in a
        terminal too narrow for that, one block per attack."""
        width = width or terminal_width()
        cells = [COLUMNS] + [(r.attack, r.observer, r.overall, r.user_text, r.time) for r in self.rows]
        room = width - len(GAP) * (len(COLUMNS) - 1)
        widths = _fit(cells, room)
        if widths is None:
            return "\n\n".join(_block(cell, width) for cell in cells[1:])
        lines = []
        for row, cell in enumerate(cells):
            wrapped = [textwrap.wrap(text, w) or [""] for text, w in zip(cell, widths)]
            for k in range(max(map(len, wrapped))):
                lines.append(GAP.join((parts[k] if k < len(parts) else "").ljust(w)
                                      for parts, w in zip(wrapped, widths)).rstrip())
            if row == 0:
                lines.append(GAP.join("-" * w for w in widths))
        return "\n".join(lines)

    def verdict(self) -> list[str]:
        lines = ["Protected: the network path (TLS; hidden states only, never text, token ids or logits) and "
                 "everything at rest on the pod (disk, volume, Redis, backups, the next tenant, logs): between "
                 "turns the pod holds no plaintext."]
        read = [(self.metric("vocabulary", "user_rate"), "by vocabulary matching after solving Q"),
                (self.metric("kv", "user_rate"), "from the KV cache without solving Q")]
        read = [f"{100 * rate:.0f} % of your text {how}" for rate, how in read if rate is not None]
        if read:
            lines.append("Not protected: whoever controls the pod's GPU during a turn and has (or identifies) this "
                         f"model's public weights reads the prompt: {' and '.join(read)}.")
        auc = self.metric("gram", "auc_across")
        norms = self.metric("norms", "user_rate")
        if auc is not None:
            lines.append(f"Without any weights the same operator learns {100 * norms:.0f} % of your tokens from norms, "
                         f"but sees which tokens repeat, also across your sessions (AUC {auc:.3f}; the basis is fixed "
                         "per bundle), and a public model is identifiable from the server bundle.")
        lines.append("Remedies for a live operator: a confidential-computing GPU, or weights that are not public. "
                     "Running more layers on the client does not stop vocabulary matching.")
        return lines

    def text(self, show_tokens: bool = False, width: int | None = None) -> str:
        """The report for a person: `width` columns wide (default: the terminal's)."""
        width = width or terminal_width()
        head = (f"infemeral audit: {self.prompt_tokens} tokens sent to the pod ({self.user_tokens} of them your own "
                f"text), {self.client_layers} client layer(s), {self.wire_dtype} on the wire; public weights: "
                f"{self.public_weights}")
        parts = [textwrap.fill(head, width), "", self.table(width), ""]
        parts += [textwrap.fill(f"note: {n}", width) for n in self.notes]
        if self.notes:
            parts.append("")
        parts += [textwrap.fill(line, width) for line in self.verdict()]
        if show_tokens:  # as recovered, unwrapped: it is the text itself
            parts.append("")
            parts += [f"{r.attack} recovers: {r.recovered_text!r}" for r in self.rows if r.recovered_text is not None]
        return "\n".join(parts)

    def to_dict(self, show_tokens: bool = False) -> dict:
        out = asdict(self)
        if not show_tokens:
            out.pop("user_token_text")
        for row in out["rows"]:
            if not show_tokens:
                row.pop("recovered_text")
        out["verdict"] = self.verdict()
        return out

    def to_json(self, show_tokens: bool = False) -> str:
        return json.dumps(self.to_dict(show_tokens), indent=2)


def _fit(cells: list[tuple[str, ...]], room: int) -> list[int] | None:
    """Column widths for `cells` that fit `room`, one column narrower at a time: the one whose cells then take the
    fewest more lines (of equals, the widest), none below MIN_COLUMN; None if even that does not fit."""
    columns = list(zip(*cells))
    widths = [max(map(len, column)) for column in columns]

    def lines(i: int, width: int) -> int:
        return sum(len(textwrap.wrap(text, width)) for text in columns[i])

    while sum(widths) > room:
        narrower = [i for i, w in enumerate(widths) if w > MIN_COLUMN]
        if not narrower:
            return None
        i = min(narrower, key=lambda i: (lines(i, widths[i] - 1) - lines(i, widths[i]), -widths[i]))
        widths[i] -= 1
    return widths


def _block(cell: tuple[str, ...], width: int) -> str:
    """One attack as a block: its name, then each column as `name: value`, wrapped and indented."""
    lines = textwrap.wrap(cell[0], width) or [""]
    for name, value in zip(COLUMNS[1:], cell[1:]):
        if value:
            lines += textwrap.wrap(f"{name}: {value}", width, initial_indent="  ",
                                   subsequent_indent="    ")
    return "\n".join(lines)
