"""Drafts copied from the conversation itself (prompt lookup decoding, n-gram matching).

If the last few tokens appeared before in the prompt or the answer so far, what
followed them then is the draft. Free, and very good when the answer quotes,
copies or edits the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from infemeral.speculation.matching import continuation, suffix_matches


class PromptLookup:
    """Drafts by copying from the conversation's own tokens (prompt lookup decoding, n-gram matching).

    The longest suffix of the context (up to `max_match` tokens, at least `min_match`) that occurred
    earlier in the context is looked up; the tokens that followed it are the draft."""

    name = "ngram"
    is_free = True

    def __init__(self, *, min_match: int = 2, max_match: int = 8, min_support: float = 0.5, limit: int = 64):
        self.min_match, self.max_match, self.min_support, self.limit = min_match, max_match, min_support, limit

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        if max_draft <= 0 or len(context_ids) < 2:
            return []
        corpus = np.asarray(context_ids, dtype=np.int64)
        ends, _ = suffix_matches(corpus, corpus[-self.max_match:], min_match=self.min_match,
                                 max_match=self.max_match, limit=self.limit)
        return continuation(corpus, ends, max_draft, self.min_support) if len(ends) else []
