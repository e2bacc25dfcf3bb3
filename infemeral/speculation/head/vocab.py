"""The vocabulary drafts are read over: the client's whole LM head, or only the rows of a head's reduced draft
vocabulary (EAGLE-3's), which is most of a draft token's cost on a laptop."""

from __future__ import annotations

import torch


class DraftVocab:
    """The LM head a head's feature is read by: the client's own (full vocabulary), or only the rows of a
    reduced draft vocabulary, whose argmax is mapped back to the target's ids."""

    def __init__(self, table, target_ids: torch.Tensor | None = None, *, vocab_size: int | None = None):
        self.table = table
        self.target_ids = None if target_ids is None else target_ids.long().cpu()
        self._ids = None if target_ids is None else self.target_ids.tolist()
        self.size = vocab_size if target_ids is None else len(self.target_ids)  # tokens drafts are read over

    @classmethod
    def of(cls, model, target_ids: torch.Tensor | None) -> "DraftVocab":
        """Over `model`'s LM head, restricted to `target_ids` (None: the whole vocabulary)."""
        if target_ids is None:
            return cls(model.head, vocab_size=model.embed.shape[0])  # a packed head keeps no shape of its own
        return cls(model.head.rows(target_ids.to(model.device)), target_ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table.project(hidden)

    def top(self, hidden: torch.Tensor, k: int) -> tuple[list[list[int]], torch.Tensor]:
        """The `k` most likely target ids for each feature [n, d] and their log-probabilities [n, k] under the
        head (over this vocabulary)."""
        logp = torch.log_softmax(self.project(hidden).float(), dim=-1)
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        rows = indices.tolist()
        if self._ids is not None:
            rows = [[self._ids[i] for i in row] for row in rows]
        return rows, values

    def best(self, hidden: torch.Tensor) -> int:
        """The target id of the most likely token for one feature [1, d]."""
        i = int(self.project(hidden)[-1].argmax())
        return i if self._ids is None else self._ids[i]
