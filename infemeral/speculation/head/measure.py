"""How well a trained head drafts: measured on held-out answers, drafting exactly as the laptop drafts
(`HeadDrafter`) and stepping through the answers as a session steps."""

from __future__ import annotations

import torch

from infemeral.speculation.head.data import TrainingData
from infemeral.speculation.head.drafter import DraftHead


class TargetTables:
    """The part of a client half a `DraftHead` reads (embedding, LM head), over plain float32 tensors: what a
    head trains against and is measured with, whichever way the model answered."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor, device: torch.device):
        from infemeral.client_half.tables import DenseTokenTable

        self.config = config
        self.dtype, self.device = torch.float32, device
        self.embed = DenseTokenTable(embed.to(device, torch.float32))
        self.head = self.embed if head is embed else DenseTokenTable(head.to(device, torch.float32))


@torch.inference_mode()
def measure(head: DraftHead, data: TrainingData, k: int, limit: int = 1 << 30, progress: bool = True,
            tree_nodes: int = 0) -> tuple[float, float, float]:
    """(first draft right, tokens per step with k drafts, share of answer tokens in the draft vocabulary) over
    the first `limit` answer positions of each of `data`'s conversations, stepped through as a session steps:
    each step drafts k after the last token, keeps the agreeing drafts and the model's own token, and the next
    step starts after them. With `tree_nodes`, each step drafts a tree of that many nodes and k levels instead
    (`propose_tree`) and keeps the path that agrees: tokens per step is then what greedy verification of such a
    tree keeps, whatever a step costs; the first draft is the tree's most probable first-level node.

    Drafting at every position instead overstates what a session gets: its steps start where the head was
    just wrong (or after k right drafts), and a head is right less often there than on average (a head for the
    default model on the benchmark's chat answers: first draft right 25% after a wrong one, 47% after a right
    one, 32% over all positions)."""
    from tqdm import tqdm

    first, tokens, steps, covered, answer = 0, 0, 0, 0, 0
    vocab = None if head.vocab.target_ids is None else set(head.vocab.target_ids.tolist())
    bar = tqdm(total=sum(min(len(x) - 1 - s, limit) for x, s in zip(data.ids, data.answer_starts)),
               desc="held out", unit="tok", disable=not progress)
    for ids, feats, start in zip(data.ids, data.features, data.answer_starts):
        ids = ids.tolist()
        drafter = head.fork()
        drafter.observe(ids[:start], feats[:start])
        answer += len(ids) - start
        covered += sum(1 for t in ids[start:] if vocab is None or t in vocab)
        m, end = start, min(len(ids) - 1, start + limit)  # ids[m]: the step's token, sampled, its feature unknown
        while m < end:
            truth = ids[m + 1:m + 1 + k]
            if tree_nodes:
                tree = drafter.propose_tree(ids[:m + 1], tree_nodes, k)
                accepted = tree.matching(truth) if tree is not None else 0
                path = tree.greedy_path() if tree is not None else []
                top = tree.tokens[path[0]] if path else None
            else:
                drafts = drafter.propose(ids[:m + 1], k)
                accepted = next((i for i, (a, b) in enumerate(zip(drafts, truth)) if a != b), min(len(drafts),
                                                                                                len(truth)))
                top = drafts[0] if drafts else None
            first += top is not None and top == truth[0]
            tokens += 1 + accepted
            steps += 1
            drafter.observe(ids[:m + 1 + accepted], feats[m:m + 1 + accepted])  # the step's verified positions
            bar.update(min(1 + accepted, end - m))
            m += 1 + accepted
    bar.close()
    return first / max(steps, 1), tokens / max(steps, 1), covered / max(answer, 1)

