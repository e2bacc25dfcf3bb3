"""The audit's findings: one row per attack, a plain-language verdict, and a JSON form for scripts.

Recovered tokens are the user's secrets: rows keep them in memory for the caller, and the
printed and JSON forms show them only when asked (`show_tokens`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

COLUMNS = ("attack", "observer knows", "whole prompt", "your own text", "time")


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

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    def metric(self, key: str, name: str, default=None):
        row = self.row(key)
        return row.metrics.get(name, default) if row else default

    # -- forms --------------------------------------------------------------------------------
    def table(self) -> str:
        cells = [COLUMNS] + [(r.attack, r.observer, r.overall, r.user_text, r.time) for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
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

    def text(self, show_tokens: bool = False) -> str:
        head = (f"infemeral audit: {self.prompt_tokens} tokens sent to the pod ({self.user_tokens} of them your own "
                f"text), {self.client_layers} client layer(s), {self.wire_dtype} on the wire; public weights: "
                f"{self.public_weights}")
        parts = [head, "", self.table(), ""]
        parts += [f"note: {n}" for n in self.notes]
        if self.notes:
            parts.append("")
        parts += self.verdict()
        if show_tokens:
            parts.append("")
            parts += [f"{r.attack} recovers: {r.recovered_text!r}" for r in self.rows if r.recovered_text is not None]
        return "\n".join(parts)

    def to_dict(self, show_tokens: bool = False) -> dict:
        out = asdict(self)
        for row in out["rows"]:
            if not show_tokens:
                row.pop("recovered_text")
        out["verdict"] = self.verdict()
        return out

    def to_json(self, show_tokens: bool = False) -> str:
        return json.dumps(self.to_dict(show_tokens), indent=2)
