"""The attacker's precomputed tables: what the client's layers output for every vocabulary token.

With an empty prefix this is the classic table of tokens in isolation. It is a good
guide when the client runs one layer, but after several layers a token's state depends
more on its context; a table of every token placed after the first few tokens of the
prompt (in a chat: the template's public header) guides much better (docs/privacy_audit.md).
Tables are kept by prefix, so attacks that recover the same prefix share them, and a
table after a chat header serves every prompt that starts with that header.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from infemeral.audit.public_weights import PublicWeights

CHUNK = 4096


class VocabularyTables:
    def __init__(self, weights: PublicWeights, progress: bool = False):
        self.weights = weights
        self.progress = progress
        self.seconds = 0.0  # spent building tables
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def after(self, prefix_ids: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Front-layer outputs [vocab, d] of every token placed right after `prefix_ids`."""
        key = tuple(prefix_ids)
        if key not in self._tables:
            started = time.perf_counter()
            prefix = self.weights.new_prefix(len(key) + 1)
            for token in key:
                self.weights.extend(prefix, token)
            ids = torch.arange(self.weights.vocab_size)
            chunks = tqdm(range(0, len(ids), CHUNK), desc=f"vocabulary table (after {len(key)} tokens)", unit="chunk",
                          disable=not self.progress, leave=False)
            self._tables[key] = torch.cat([self.weights.continuations(prefix, ids[i:i + CHUNK]) for i in chunks])
            self.seconds += time.perf_counter() - started
        return self._tables[key]
