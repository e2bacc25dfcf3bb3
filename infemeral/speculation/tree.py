"""Draft trees (EAGLE-2): what a source proposes when a step may carry several candidates per position, and how
many of them a step carries.

A chain bets every draft on the one before it being right; with a first draft right 40 % of the time it rarely
passes two tokens. A tree keeps the source's most confident candidates at every depth instead: its nodes are
ranked by their cumulative draft probability (the product down their path), which is also about how likely
the model is to accept them, so the best N nodes by that probability are the N most likely to be accepted —
and they form a tree (a child is never more likely than its parent). The server verifies all of them in one
step (layers/draft_tree.py, `acceptance.accept_tree`).

How many nodes a step carries is the same trade as a chain's length (`draft_length.py`): what the nodes are
expected to add, against what the extra positions cost (`StepCost`, measured). On a GPU, 16–64 positions cost
about one step and the tree grows; on a CPU pod each position costs a share of a step and only nodes likely
enough to pay for it are sent. The draft probabilities are a head's own belief, so `TreeSize` scales them by
what verification measured (accepted tokens against those expected).
"""

from __future__ import annotations

from dataclasses import dataclass

from infemeral.speculation.step_cost import StepCost

MAX_TREE_NODES = 63  # drafts per tree step: 64 positions, about one step's cost on a GPU
TREE_TOP_K = 4       # children a node is expanded into (and nodes expanded per depth)


@dataclass
class TreeDraft:
    """Drafted nodes in an order where every parent precedes its children: `tokens[i]`, its parent node
    `parents[i]` (-1: the root, the step's first token), its cumulative draft probability `probs[i]`."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def greedy_path(self) -> list[int]:
        """The nodes a chain would draft: from the root, the most probable child, down to a leaf."""
        path, node = [], -1
        while True:
            children = [i for i, p in enumerate(self.parents) if p == node]
            if not children:
                return path
            node = max(children, key=lambda i: self.probs[i])
            path.append(node)

    def matching(self, tokens: list[int]) -> int:
        """How many of `tokens` the tree spells from the root down one path: the drafts greedy verification
        keeps when `tokens` are what the model decodes (children hold distinct tokens, so there is one path)."""
        node, n = -1, 0
        for token in tokens:
            node = next((i for i, p in enumerate(self.parents) if p == node and self.tokens[i] == token), None)
            if node is None:
                break
            n += 1
        return n

    def best(self, n: int, keep: list[int] = ()) -> "TreeDraft":
        """The nodes of `keep` (a path from the root, or none) and the `n` most probable others (a parent before
        its children on ties), in the same order as here — a tree still, since no child is more probable than
        its parent."""
        depths = self.depths()
        kept = set(keep)
        others = sorted((i for i in range(len(self.tokens)) if i not in kept),
                        key=lambda i: (-self.probs[i], depths[i], i))
        chosen = sorted(kept | set(others[:max(n, 0)]))
        index = {old: new for new, old in enumerate(chosen)}
        return TreeDraft([self.tokens[i] for i in chosen], [index.get(self.parents[i], -1) for i in chosen],
                         [self.probs[i] for i in chosen])

    def step_parents(self) -> list[int]:
        """The parents of a step's rows (layers/draft_tree.py): row 0 the root, node i row i + 1."""
        return [-1] + [p + 1 for p in self.parents]


class TreeSize:
    """How many of a drafted tree's nodes the step carries besides the chain (the greedy path, whose length the
    measured acceptance chose and whose expected yield that acceptance gives): the count n of other nodes, by
    falling probability p_i, maximising expected tokens per unit of time, (1 + chain + c·(p_1 + … + p_n)) /
    s(k + n + 1), where s is the measured relative cost of a step of that many positions and c the calibration
    of the source's probabilities (the drafts accepted beyond the chain's expected yield over the sum of the
    other nodes' probabilities sent, a decaying mean, 1 before any step). A tree is never less than the chain
    it grows from, so it never pays less than the chain (in the model), and the head keeps being measured."""

    def __init__(self, cost: StepCost, decay: float = 0.9, prior_weight: float = 2.0, min_gain: float = 0.02):
        self.cost, self.decay, self.min_gain = cost, decay, min_gain
        self._accepted = self._expected = prior_weight  # calibration 1 to start

    @property
    def calibration(self) -> float:
        return self._accepted / max(self._expected, 1e-9)

    def rate(self, probs_sent: list[float]) -> float:
        return (1 + self.calibration * sum(probs_sent)) / self.cost.relative(len(probs_sent) + 1)

    def choose(self, tree: TreeDraft, limit: int, chain: list[int] = (), chain_yield: float = 0.0) -> int:
        """Nodes of `tree` to send besides the nodes of `chain` (expected to yield `chain_yield` accepted
        drafts), all together at most `limit`."""
        kept = set(chain)
        probs = sorted((p for i, p in enumerate(tree.probs) if i not in kept), reverse=True)
        probs = probs[:max(limit - len(kept), 0)]
        k = len(kept)
        best, best_rate, total = 0, (1 + chain_yield) / self.cost.relative(k + 1), 0.0
        for n, p in enumerate(probs, start=1):
            total += p
            rate = (1 + chain_yield + self.calibration * total) / self.cost.relative(k + n + 1)
            if rate > best_rate * (1 + self.min_gain):
                best, best_rate = n, rate
        return best

    def update(self, expected: float, accepted: float) -> None:
        """A verified tree: the probabilities of its nodes beyond the chain summed to `expected`; `accepted`
        drafts were kept beyond what the chain was expected to yield (clamped at 0)."""
        self._accepted = self._accepted * self.decay + max(accepted, 0.0)
        self._expected = self._expected * self.decay + expected
