"""Where drafts come from: the `DraftSource` protocol, and the sources a session drafts from, in order.

A draft costs one round trip less for every token the model agrees with and
almost nothing when it is wrong (the server verifies k+1 positions in about
the time of one), so the guesses only have to be cheap and sometimes right.
Every source answers one question — `propose(context_ids, max_draft)`: which
tokens probably follow `context_ids`? — and may answer with nothing:

- `PromptLookup` (`prompt_lookup.py`) copies from the conversation itself;
- `AnswerIndex` (`answer_index.py`) from the client's own earlier answers;
- `DraftModel` (`draft_model.py`) asks a small local model;
- `HeadDrafter` (`head/drafter.py`) asks a draft head over the model's own features.

Sources are shared by every session of a client, and sessions run in parallel
threads (the OpenAI endpoint answers requests at once). A source that
remembers the conversation it drafts for — a draft model's or a head's KV cache — therefore
offers `fork()`: the same read-only parts with a state of its own, and each
session drafts through its own fork (`per_session`), so that no draft ever
depends on another session. The answer index is shared on purpose (that is
its point) and is safe under threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from infemeral.errors import InfemeralError
from infemeral.speculation.prompt_lookup import PromptLookup


@runtime_checkable
class DraftSource(Protocol):
    """Proposes up to `max_draft` tokens that may follow `context_ids` (possibly none)."""

    name: str
    is_free: bool  # proposing costs (almost) nothing, so it may be tried on every step

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]: ...


def per_session(source: DraftSource) -> DraftSource:
    """`source` as one session drafts with it: a source with a state of its own per conversation (`fork()`)
    is forked, so that sessions never share that state; a stateless source is shared as it is."""
    fork = getattr(source, "fork", None)
    return fork() if callable(fork) else source


class FirstOf:
    """Several sources in order of preference: the first that proposes anything wins."""

    def __init__(self, *sources: DraftSource):
        self.sources = list(sources)
        self.name = "+".join(s.name for s in sources)
        self.is_free = all(s.is_free for s in sources)
        self.last_seconds: float | None = None  # the answering source's own account of its cost, if it gives one

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        self.last_seconds = None
        for source in self.sources:
            draft = source.propose(context_ids, max_draft)
            if draft:
                self.last_seconds = getattr(source, "last_seconds", None)
                return draft
        return []


SPECULATE = ("auto", "ngram", "draft", "head", "off")


def session_sources(speculate: str, answer_index: DraftSource | None = None, draft_model: DraftSource | None = None,
                    draft_head: DraftSource | None = None) -> list[DraftSource]:
    """Where one session's drafts come from under `speculate` (the draft model and head: the session's own forks):

    - "ngram": the conversation, then the client's earlier answers;
    - "draft": the same, then the draft model;
    - "head": the draft head alone;
    - "auto": each of those available — lookup, head, draft model — as separate sources, for the speculator to
      choose from step by step by measured speed (lookup alone when nothing else is there: "ngram");
    - "off": none."""
    if speculate not in SPECULATE:
        raise ValueError(f"speculate must be one of {', '.join(SPECULATE)}, not {speculate!r}")
    if speculate == "off":
        return []
    lookup: list[DraftSource] = [PromptLookup()]
    if answer_index is not None:
        lookup.append(answer_index)
    lookup_source = lookup[0] if len(lookup) == 1 else FirstOf(*lookup)
    if speculate == "draft":
        if draft_model is None:
            raise InfemeralError("speculate='draft' needs a draft model (a small local model with this model's "
                                 "tokenizer): Client(draft_model=PATH), or --draft-model PATH on the command "
                                 "line; or use speculate='auto'")
        return [FirstOf(*lookup, draft_model)]
    if speculate == "head":
        if draft_head is None:
            raise InfemeralError("speculate='head' needs a draft head for this model: Client(draft_head=PATH), or "
                                 "--draft-head PATH on the command line (`infemeral-client train-drafter` trains "
                                 "one); or use speculate='auto'")
        return [draft_head]
    if speculate == "auto":
        return [lookup_source] + [s for s in (draft_head, draft_model) if s is not None]
    return [lookup_source]
