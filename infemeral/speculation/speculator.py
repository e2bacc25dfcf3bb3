"""One decode step's speculation: which source drafts, how many drafts, and what the step taught.

The turn loop asks before each step (`propose`) and reports once the model has
verified it (`verified`); between the two it sends the drafts and keeps what
`accept_drafts` accepts. It also hands over the features of verified positions
(`observed`), which a draft head drafts from. What the adaptive length learns —
acceptance, the shadow check of a free source at k = 0, the step's time, what
drafting costs — is recorded here, so the loop only passes the step through.

With several sources (`--speculate auto` with a draft head or a draft model
besides prompt lookup), each has its own `DraftLength`: its measured acceptance
and its measured cost per draft token on the laptop, over the step cost of this
link (shared). Every step goes to the source and k whose expected tokens per
unit of time are highest, so a source is used only where it beats the others
— a costly head never where prompt lookup drafts for free as well, nor at all
where drafting costs more than it saves. Free sources propose every step
(their guesses not sent are checked against the tokens sampled); a costly
source that is not chosen is probed with one draft now and then, its probes
taking at most a small share of the session's time (catch-ups included).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infemeral.layers.draft_tree import is_chain
from infemeral.speculation.draft_length import DraftLength, SourceHistory, expected_tokens
from infemeral.speculation.source import DraftSource
from infemeral.speculation.step_cost import StepCost
from infemeral.speculation.tree import MAX_TREE_NODES


@dataclass
class Proposal:
    drafts: list[int]  # sent with the step, to be verified
    shadow: list[int]  # proposed by a free source at k = 0 and not sent: checked against the token sampled
    started: float     # when the step began (after drafting, which is measured apart)
    source: str | None = None  # the source of `drafts`
    shadows: dict[str, list[int]] = field(default_factory=dict)  # several sources: each free one's guesses
    drafting: float = 0.0  # the seconds `propose` took
    parents: list[int] | None = None  # a draft tree: the parents of the step's rows (its last token, then `drafts`)
    depth: int = 0          # a draft tree: its deepest draft's depth
    expected: float = 0.0   # a draft tree: the draft probabilities of its nodes beyond the chain, summed
    chain_yield: float = 0.0  # a draft tree: the accepted drafts its chain alone was expected to yield


class Speculator:
    """Drafts for one turn from `sources` (none: never), each with its `DraftLength` in `lengths` (a
    session's, by source name: they outlive the turn, so a session keeps learning across its turns)."""

    def __init__(self, sources: Sequence[DraftSource] | DraftSource | None, lengths: dict[str, DraftLength] |
                 DraftLength, max_draft: int, cost: StepCost | None = None,
                 history: dict[str, SourceHistory] | None = None):
        if sources is None:
            sources = []
        elif not isinstance(sources, Sequence):
            sources = [sources]
        self.sources = list(sources)
        self.history = history  # the client's, by source name: where a new session's lengths start
        cost = cost or StepCost()
        if isinstance(lengths, DraftLength):  # one source, one length
            lengths = {s.name: lengths for s in self.sources}
        for s in self.sources:
            if s.name not in lengths:
                known = history.get(s.name) if history is not None else None
                lengths[s.name] = DraftLength.after(known, cost) if known else DraftLength(cost=cost)
            lengths[s.name].max_draft = max_draft
        self.lengths = {s.name: lengths[s.name] for s in self.sources}
        self._max_draft = max_draft if self.sources else 0
        self.prompt_features = max((getattr(s, "prompt_features", 0) for s in self.sources), default=0)
        self._trees = False  # this step may carry a draft tree

    @property
    def max_draft(self) -> int:
        """Most drafts a step of this turn may carry (they occupy cache pages until verified)."""
        return self._max_draft

    @property
    def length(self) -> DraftLength | None:
        """The draft length of the only source (None unless there is exactly one)."""
        return next(iter(self.lengths.values())) if len(self.lengths) == 1 else None

    # -- the loop's calls -----------------------------------------------------------------------------
    def propose(self, context_ids: Sequence[int], room: int, trees: bool = False) -> Proposal:
        """The drafts to send after `context_ids` (whose last token is sampled, not yet in the caches), at most
        `room` of them; with `trees` (the server verifies them), a source that drafts trees may propose one."""
        self._trees = trees
        if not self.sources:
            return Proposal([], [], time.perf_counter())
        began = time.perf_counter()
        if not next(iter(self.lengths.values())).cost.is_timed(1):
            room = 0  # a plain step first: what every draft length saves is weighed against its time
        if len(self.sources) == 1:
            proposal = self._propose_one(self.sources[0], context_ids, room)
        else:
            proposal = self._propose_best(context_ids, room)
        proposal.drafting = proposal.started - began
        return proposal

    def observed(self, ids: Sequence[int], features: torch.Tensor) -> None:
        """`features` [n, d] of the last n positions of `ids`, all verified: for sources that draft from them."""
        for source in self.sources:
            observe = getattr(source, "observe", None)
            if observe is not None:
                observe(ids, features)

    def verified(self, proposal: Proposal, new: list[int]) -> None:
        """The step carrying `proposal` came back: `new` is the accepted drafts and then the model's own token."""
        if not self.sources:
            return
        drafts = proposal.drafts
        seconds = time.perf_counter() - proposal.started
        next(iter(self.lengths.values())).step_time(len(drafts) + 1, seconds)  # the link's cost: shared by all
        for length in {id(x): x for x in self.lengths.values()}.values():  # one source, one length: once
            length.spent(seconds + proposal.drafting)
        learnt = set()
        if drafts:
            length = self.lengths[proposal.source]
            length.update(proposal.depth or len(drafts), len(new) - 1)  # a tree: acceptance per depth
            if proposal.expected:
                length.tree.update(proposal.expected, len(new) - 1 - proposal.chain_yield)
            learnt.add(proposal.source)
        elif proposal.shadow and len(self.sources) == 1:
            self.lengths[self.sources[0].name].shadow(proposal.shadow[0] == new[0])
            learnt.add(self.sources[0].name)
        for name, guesses in proposal.shadows.items():
            if guesses and name != proposal.source:
                self.lengths[name].shadow(guesses[0] == new[0])
                learnt.add(name)
        if self.history is not None:
            for name in learnt:
                self.history.setdefault(name, SourceHistory()).learn(self.lengths[name])

    # -- choosing ------------------------------------------------------------------------------------
    def _propose_one(self, source: DraftSource, context_ids: Sequence[int], room: int) -> Proposal:
        length = self.lengths[source.name]
        k = min(length.choose(source.is_free), room, self._unmeasured_limit(source)) if room > 0 else 0
        if k > 0:
            if self._drafts_trees(source):
                return self._draft_tree(source, context_ids, k, room)
            drafts = self._draft(source, context_ids, k)
            return Proposal(drafts, [], time.perf_counter(), source.name)
        shadow = source.propose(context_ids, 1) if source.is_free else []
        return Proposal([], shadow, time.perf_counter(), source.name)

    def _propose_best(self, context_ids: Sequence[int], room: int) -> Proposal:
        """The source and k of the highest expected rate; free sources' guesses are had first (they cost
        nothing) and bound their k; a costly source is asked only once chosen."""
        guesses = {s.name: s.propose(context_ids, self._max_draft) for s in self.sources if s.is_free}
        best = None  # (rate, source, k)
        for source in self.sources:
            length = self.lengths[source.name]
            limit = min(room, len(guesses[source.name])) if source.is_free else min(room,
                                                                                    self._unmeasured_limit(source))
            k = length.best_k(limit)
            if k > 0 and (best is None or length.rate(k) > best[0]):
                best = (length.rate(k), source, k)
        if best is None and room > 0:  # nothing pays now: probe a costly source once in a while
            for source in self.sources:
                if not source.is_free and self.lengths[source.name].probe():
                    best = (0.0, source, 1)
                    break
        if best is None:
            return Proposal([], [], time.perf_counter(), None, guesses)
        _, source, k = best
        if self._drafts_trees(source):
            proposal = self._draft_tree(source, context_ids, k, room)
            proposal.shadows = guesses
            return proposal
        drafts = guesses[source.name][:k] if source.is_free else self._draft(source, context_ids, k)
        return Proposal(drafts, [], time.perf_counter(), source.name, guesses)

    def _unmeasured_limit(self, source: DraftSource) -> int:
        """A costly source whose cost per draft token is not known yet drafts one token: that measures it, where
        a first step of many drafts from a source as costly as the served model would be paid whole."""
        if source.is_free or self.lengths[source.name].draft_seconds:
            return self._max_draft
        return 1

    def _drafts_trees(self, source: DraftSource) -> bool:
        """Whether `source` drafts a tree this step: it can (a draft head; lookups stay chains, trees of one
        branch), and the server verifies trees."""
        return self._trees and not source.is_free and hasattr(source, "propose_tree")

    def _draft_tree(self, source: DraftSource, context_ids: Sequence[int], depth: int, room: int) -> Proposal:
        """A tree of `depth` levels (the chain length the measured acceptance and step cost chose), of which the
        step carries as many nodes as pay for their positions (`TreeSize`); charged per level, as a chain is
        per draft."""
        length = self.lengths[source.name]
        started = time.perf_counter()
        tree = source.propose_tree(context_ids, min(room, MAX_TREE_NODES), depth)
        took = time.perf_counter() - started
        length.drafted(depth, took)
        if length.is_probing:
            length.probed(took)
        if tree is None or not tree.tokens:
            return Proposal([], [], time.perf_counter(), source.name)
        chain = tree.greedy_path()[:depth]
        chain_yield = expected_tokens(length.estimated_acceptance, len(chain)) - 1
        extra = length.tree.choose(tree, room, chain, chain_yield)
        extra_probs = sorted((p for i, p in enumerate(tree.probs) if i not in set(chain)), reverse=True)[:extra]
        tree = tree.best(extra, chain)
        parents = tree.step_parents()
        return Proposal(tree.tokens, [], time.perf_counter(), source.name, depth=tree.depth,
                        parents=None if is_chain(parents) else parents, expected=sum(extra_probs),
                        chain_yield=chain_yield)

    def _draft(self, source: DraftSource, context_ids: Sequence[int], k: int) -> list[int]:
        """A costly source's drafts, and what they cost. A source that says what its proposal would have cost
        with its state current (`last_seconds`: a draft model that first caught up on the tokens verified
        while it was idle) is charged that: the catch-up is paid once, after idling, and charged to the one
        draft of a probe it would make drafting look many times dearer than it is, so that it was never
        chosen again. A probe's whole time, catch-up included, goes to the probe budget instead."""
        started = time.perf_counter()
        drafts = source.propose(context_ids, k)[:k]
        if not source.is_free:
            took = time.perf_counter() - started
            length = self.lengths[source.name]
            seconds = getattr(source, "last_seconds", None)
            length.drafted(max(len(drafts), 1), seconds if seconds is not None else took)
            if length.is_probing:
                length.probed(took)  # the catch-up included: what waking it costs
        return drafts
