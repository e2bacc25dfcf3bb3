"""Vocabulary matching: un-rotate what the pod received, then find the tokens that produce it.

An operator who has the public weights and has solved Q (procrustes.py) holds the plain
hidden states after the client's layers. Every vocabulary token run through those public
layers in context gives a candidate state; the one that matches is the token. Running more
layers on the client does not stop this: the operator runs the same public layers.
"""

from __future__ import annotations

import torch

from infemeral.audit.context_matching import ContextMatcher, Recovery
from infemeral.audit.public_weights import PublicWeights
from infemeral.audit.tables import VocabularyTables


def unrotate(received: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """States in the secret basis (x·Q) back in the model's basis, given an estimate of Q."""
    return (received.double() @ basis.double().T).float()


def match_vocabulary(weights: PublicWeights, tables: VocabularyTables, received: torch.Tensor, basis: torch.Tensor,
                     progress: bool = False, **matcher) -> Recovery:
    """Recover the tokens behind `received` [n, d] (as sent) with the estimate `basis` of Q."""
    states = unrotate(received, basis)
    return ContextMatcher(weights, tables, **matcher).recover(states, states, progress, "vocabulary matching")
