"""Recover tokens position by position from what the pod saw, given the public weights.

Each position is solved in two moves, the way a practical attacker would do it:
1. prefilter: nearest neighbours (cosine) in a precomputed table (tables.py) pick
   candidates: the table of tokens in isolation for the first CONTEXT_TOKENS
   positions, then the table of tokens placed after those recovered tokens;
2. verify: each candidate is run through the layers *in context* — as the next
   token after the tokens already recovered — and compared exactly with what was
   observed. A candidate within `tolerance` (relative error) is taken.
Stages widen the candidate list; when even the widest stage has no match, the whole
vocabulary is run in context (a full scan) and the closest token is taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from infemeral.audit.public_weights import PublicWeights
from infemeral.audit.tables import VocabularyTables

STAGES = (16, 256, 4096)  # candidates verified in context before a full scan
TOLERANCE = 0.02          # relative error of a match: the true token is within 2e-3 even with bf16 on the wire,
                          # the closest wrong one was 8e-2 off (default model, docs/privacy_audit.md)
CONTEXT_TOKENS = 8        # after this many recovered tokens, prefilter with a table in their context
CHUNK_ELEMENTS = 1 << 25  # bounds the memory of one batch of continuations (prefix keys repeated per candidate)
MAX_CHUNK = 4096


@dataclass
class Recovery:
    token_ids: list[int]
    num_verified: int     # positions matched within tolerance
    num_full_scans: int
    seconds: float        # matching, without building tables
    table_seconds: float  # tables this recovery had to build (0 when another attack built them)

    def num_correct(self, truth: list[int], positions: range | None = None) -> int:
        positions = range(len(truth)) if positions is None else positions
        return sum(self.token_ids[i] == truth[i] for i in positions)


def _identity(hidden: torch.Tensor, position: int | None = None) -> torch.Tensor:
    return hidden


class ContextMatcher:
    """Prefilter by a table, verify in context.

    `features(hidden, position)` maps front-layer outputs at a position to what the pod holds
    there; `table_features(hidden)` maps a table to what the prefilter compares."""

    def __init__(self, weights: PublicWeights, tables: VocabularyTables,
                 features: Callable[[torch.Tensor, int], torch.Tensor] = _identity,
                 table_features: Callable[[torch.Tensor], torch.Tensor] = _identity,
                 tolerance: float = TOLERANCE, stages: tuple[int, ...] = STAGES, full_scan: bool = True,
                 context_tokens: int = CONTEXT_TOKENS):
        self.weights = weights
        self.tables = tables
        self.features = features
        self.table_features = table_features
        self.tolerance = tolerance
        self.stages = stages
        self.full_scan = full_scan
        self.context_tokens = context_tokens

    @torch.inference_mode()
    def recover(self, observed: torch.Tensor, prefilter: torch.Tensor, progress: bool = False,
                desc: str = "matching") -> Recovery:
        """observed [n, f]: what the pod holds per position; prefilter [n, p]: its part comparable with a table."""
        started, built_before = time.perf_counter(), self.tables.seconds
        n = observed.shape[0]
        prefix = self.weights.new_prefix(n)
        guesses, verified, scans = [], 0, 0
        switch = min(self.context_tokens, n) if self.context_tokens else n
        ranked = self._prefilter(prefilter[:switch], ())
        for t in tqdm(range(n), desc=desc, unit="token", disable=not progress, leave=False):
            if t == switch:
                ranked = self._prefilter(prefilter[switch:], guesses)
            token, err, scanned = self._solve(prefix, observed[t].float(), ranked[t if t < switch else t - switch])
            guesses.append(token)
            verified += err <= self.tolerance
            scans += scanned
            self.weights.extend(prefix, token)
        table_seconds = self.tables.seconds - built_before
        return Recovery(guesses, verified, scans, time.perf_counter() - started - table_seconds, table_seconds)

    def _prefilter(self, keys: torch.Tensor, prefix_ids, rows: int = 256) -> torch.Tensor:
        """Nearest neighbours [n, widest stage] of each position in the table after `prefix_ids`, best first."""
        table = self.tables.after(prefix_ids)
        table = F.normalize(torch.cat([self.table_features(table[i:i + MAX_CHUNK])
                                       for i in range(0, len(table), MAX_CHUNK)]).float(), dim=1)
        k = min(max(self.stages), len(table))
        return torch.cat([(F.normalize(keys[i:i + rows].float(), dim=1) @ table.T).topk(k, dim=1).indices
                          for i in range(0, len(keys), rows)])

    def _solve(self, prefix, target: torch.Tensor, ranked: torch.Tensor) -> tuple[int, float, bool]:
        best, best_err, done = -1, float("inf"), 0
        for k in self.stages:
            cands = ranked[done:k]
            done = k
            if len(cands):
                err = self._errors(prefix, cands, target)
                i = int(err.argmin())
                if err[i] < best_err:
                    best, best_err = int(cands[i]), float(err[i])
            if best_err <= self.tolerance:
                return best, best_err, False
        if not self.full_scan:
            return best, best_err, False
        err = self._errors(prefix, torch.arange(self.weights.vocab_size), target)
        i = int(err.argmin())
        return i, float(err[i]), True

    def _errors(self, prefix, cands: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Relative error of each candidate's in-context features against the target."""
        per_candidate = 2 * (prefix.length + 1) * prefix.kv_heads * prefix.head_dim
        chunk = max(1, min(MAX_CHUNK, CHUNK_ELEMENTS // per_candidate))
        errs = []
        for i in range(0, len(cands), chunk):
            feats = self.features(self.weights.continuations(prefix, cands[i:i + chunk]), prefix.length)
            errs.append((feats.float() - target).norm(dim=1))
        return torch.cat(errs) / target.norm().clamp_min(1e-30)
