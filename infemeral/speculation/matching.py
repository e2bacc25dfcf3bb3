"""Suffix matching over a token array: where the end of a context occurred before, and what followed it.

Shared by the sources that copy (`PromptLookup` over the conversation, `AnswerIndex` over earlier
answers). A vectorised scan (numpy), not a suffix tree: for the sizes a laptop keeps (a few hundred
thousand tokens) a scan per step takes well under a millisecond and needs no index to build or store.
"""

from __future__ import annotations

import numpy as np

SEPARATOR = -1  # between answers in an AnswerIndex; never a token id


def suffix_matches(corpus: np.ndarray, tail: np.ndarray, *, min_match: int, max_match: int,
                   limit: int) -> tuple[np.ndarray, int]:
    """Where the longest suffix of `tail` (between min_match and max_match tokens) ends in `corpus`.

    Returns the positions p of the match's last token (each with at least one token after it, most
    recent `limit` only) and the match length; no positions if even `min_match` tokens do not match."""
    n = min(max_match, len(tail))
    if n < min_match or len(corpus) < 2:
        return np.empty(0, dtype=np.int64), 0
    ends = np.flatnonzero(corpus[:-1] == tail[-1])[-limit:]
    best, length = ends, 1
    for j in range(1, n):
        ends = ends[ends >= j]
        ends = ends[corpus[ends - j] == tail[-1 - j]]
        if len(ends) == 0:
            break
        best, length = ends, j + 1
    if length < min_match or len(best) == 0:
        return np.empty(0, dtype=np.int64), 0
    return best, length


def continuation(corpus: np.ndarray, ends: np.ndarray, max_draft: int, min_support: float) -> list[int]:
    """The most common continuation after the matched positions, token by token.

    Each token is the one most matches continue with (ties: the most recent); matches that
    disagree drop out. Drafting stops when the surviving share of the original matches falls
    below `min_support` — a disputed continuation is a poor guess."""
    draft: list[int] = []
    total = len(ends)
    for i in range(1, max_draft + 1):
        pos = ends + i
        keep = pos < len(corpus)
        ends, pos = ends[keep], pos[keep]
        if len(ends) == 0:
            break
        tokens = corpus[pos]
        keep = tokens != SEPARATOR
        ends, tokens = ends[keep], tokens[keep]
        if len(ends) == 0:
            break
        values, counts = np.unique(tokens, return_counts=True)
        top = counts.max()
        if top / total < min_support:
            break
        tied = values[counts == top]
        token = tied[0] if len(tied) == 1 else tokens[::-1][np.isin(tokens[::-1], tied)][0]
        ends = ends[tokens == token]
        draft.append(int(token))
    return draft
