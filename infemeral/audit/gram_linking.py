"""Gram linking: an observer with no weights and no Q still sees which states belong to the same token.

Orthogonal Q keeps inner products, so the cosine similarity of two received states is
the same as without the cloak. After the client's first layer a state is still close
to its token's, wherever and in whatever context the token occurs, and Q is fixed per
bundle, so the observer can link repeated tokens within a prompt and across sessions.

Scores: the AUC of same-token pairs against different-token pairs (1.0: every
repeated token is more similar to its twin than any two different tokens are), and
the links an observer would actually make without knowing the answer: pairs with a
cosine of at least LINK_THRESHOLD, a fixed threshold that is not tuned on the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infemeral.audit.observed import Observation

LINK_THRESHOLD = 0.95


@dataclass
class Linking:
    auc_within: float            # pairs inside the first session
    auc_across: float            # pairs across the two sessions (bit-identical pairs left out)
    same_token_pairs: int        # within and across
    linked_pairs: int            # same-token pairs at cosine >= threshold
    false_links: int             # different-token pairs at cosine >= threshold
    user_tokens: int
    user_tokens_linked: int      # user tokens whose nearest state in the other session is the same token
    num_identical: int           # states bit-identical across the two sessions (the shared template header)
    threshold: float = LINK_THRESHOLD


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    num_pos, num_neg = int(labels.sum()), int((~labels).sum())
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = scores.argsort()
    _, inverse, counts = torch.unique(scores[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = torch.empty_like(scores)
    ranks[order] = (ends - (counts.double() - 1) / 2)[inverse]
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def link(first: Observation, second: Observation, threshold: float = LINK_THRESHOLD) -> Linking:
    """Link the states of two sessions of the same bundle by cosine similarity alone."""
    a, b = F.normalize(first.hidden.double(), dim=1), F.normalize(second.hidden.double(), dim=1)
    ids_a, ids_b = torch.tensor(first.token_ids), torch.tensor(second.token_ids)

    within = a @ a.T
    i, j = torch.triu_indices(len(ids_a), len(ids_a), 1)
    w_scores, w_same = within[i, j], ids_a[i] == ids_a[j]

    across = a @ b.T
    identical = _identical(first.hidden, second.hidden, across)
    keep = ~identical
    x_scores, x_same = across[keep], (ids_a.unsqueeze(1) == ids_b.unsqueeze(0))[keep]

    scores, same = torch.cat([w_scores, x_scores]), torch.cat([w_same, x_same])
    linked = scores >= threshold
    user = torch.tensor(list(first.user_positions), dtype=torch.long)
    nearest = across[user].argmax(1) if len(user) else user
    user_linked = (ids_b[nearest] == ids_a[user]) & (across[user, nearest] >= threshold)
    return Linking(auc_within=auc(w_scores, w_same), auc_across=auc(x_scores, x_same),
                   same_token_pairs=int(same.sum()), linked_pairs=int((linked & same).sum()),
                   false_links=int((linked & ~same).sum()), user_tokens=len(user),
                   user_tokens_linked=int(user_linked.sum()), num_identical=int(identical.any(1).sum()),
                   threshold=threshold)


def _identical(a: torch.Tensor, b: torch.Tensor, cosine: torch.Tensor) -> torch.Tensor:
    """[n, m] True where a[i] and b[j] are bit for bit the same (only pairs at cosine ~1 are compared)."""
    same = torch.zeros_like(cosine, dtype=torch.bool)
    for i, j in (cosine > 1 - 1e-9).nonzero().tolist():
        same[i, j] = torch.equal(a[i], b[j])
    return same
