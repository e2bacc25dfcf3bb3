"""One decode step's speculation: how many drafts, which ones, and what the step taught.

The turn loop asks before each step (`propose`) and reports once the model has
verified it (`verified`); between the two it sends the drafts and keeps what
`accept_drafts` accepts. What the adaptive length learns — acceptance, the
shadow check of a free source at k = 0, the step's time — is recorded here, so
the loop only passes the step through.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from infemeral.speculation.draft_length import DraftLength
from infemeral.speculation.source import DraftSource


@dataclass
class Proposal:
    drafts: list[int]  # sent with the step, to be verified
    shadow: list[int]  # proposed by a free source at k = 0 and not sent: checked against the token sampled
    started: float     # when drafting began: a step's time includes it (a draft model's is real)


class Speculator:
    """Drafts for one turn from `source` (None: never), `length` choosing how many; `length` outlives the
    turn (a session keeps learning across its turns)."""

    def __init__(self, source: DraftSource | None, length: DraftLength, max_draft: int):
        self.source, self.length = source, length
        length.max_draft = max_draft if source is not None else 0

    @property
    def max_draft(self) -> int:
        """Most drafts a step of this turn may carry (they occupy cache pages until verified)."""
        return self.length.max_draft

    def propose(self, context_ids: Sequence[int], room: int) -> Proposal:
        """The drafts to send after `context_ids` (whose last token is sampled, not yet in the caches), at most
        `room` of them."""
        started = time.perf_counter()
        source = self.source
        if source is None:
            return Proposal([], [], started)
        k = min(self.length.choose(source.is_free), room)
        if k > 0:
            return Proposal(source.propose(context_ids, k)[:k], [], started)
        shadow = source.propose(context_ids, 1) if source.is_free else []
        return Proposal([], shadow, started)

    def verified(self, proposal: Proposal, new: list[int]) -> None:
        """The step carrying `proposal` came back: `new` is the accepted drafts and then the model's own token."""
        drafts = proposal.drafts
        self.length.step_time(len(drafts) + 1, time.perf_counter() - proposal.started)
        if drafts:
            self.length.update(len(drafts), len(new) - 1)
        elif proposal.shadow:
            self.length.shadow(proposal.shadow[0] == new[0])
