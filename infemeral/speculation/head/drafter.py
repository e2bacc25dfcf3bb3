"""Drafting with a head: `DraftHead` holds the weights, shared and only read; every session drafts through its
own `HeadDrafter` (`fork()`), with a KV cache and a window of recent features of its own.

Verification is the model's own (`acceptance.accept_drafts`), so greedy output stays token-identical and
sampling keeps the target distribution whatever the head proposes. Public EAGLE / EAGLE-2 heads load as they
are (`checkpoint.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from infemeral.errors import FailedPrecondition, InfemeralError
from infemeral.kvcache.cache import KVCache
from infemeral.speculation.head.checkpoint import TRAINING_HINT, read_checkpoint, target_mismatch
from infemeral.speculation.head.model import HeadModel, layer_config
from infemeral.speculation.head.vocab import DraftVocab
from infemeral.speculation.tree import TREE_TOP_K, TreeDraft
from infemeral.threads import FasterThreads

DRAFT_RECHECK = 256  # proposals between two measurements of the faster thread count (the machine's load changes)

# -- the head, shared --------------------------------------------------------------------------------

class DraftHead:
    """A draft head bound to one client half: its weights in the half's dtype, on its device, int8 where the
    half is int8 (`quant` overrides), packed where the half packs; read over a reduced draft vocabulary when
    the head has one (unless `full_vocab`). Sessions draft through `fork()`."""

    name = "head"

    def __init__(self, module: HeadModel, model, *, draft_ids: torch.Tensor | None = None,
                 quant: str | None = None, description: str = "draft head", keep_features: int = 512,
                 max_positions: int = 2048, prompt_features: int = 64):
        from infemeral.client_half import packed

        self.model, self.description = model, description
        self.dtype, self.device = model.dtype, model.device
        self.quant = quant or getattr(getattr(model, "compute", None), "quant", "none")
        module = module.to(self.device, self.dtype).eval().requires_grad_(False)
        module.rotary = module._rotary(self.device)  # RoPE angles stay float32 whatever the weights' dtype
        if self.quant == "int8":
            _to_int8(module, self.dtype)
        elif packed.packs(self.device.type, self.dtype):
            packed.pack_linears(module)
        self.module = module
        self.vocab = DraftVocab.of(model, draft_ids)
        self.keep_features, self.max_positions = keep_features, max_positions
        self.prompt_features = prompt_features  # features of a turn's last prompt positions a session asks for
        self.threads = FasterThreads(self.device, recheck=DRAFT_RECHECK)  # the machine's choice: sessions share it

    @classmethod
    def load(cls, path: str | Path, model, *, full_vocab: bool = False, quant: str | None = None) -> "DraftHead":
        """A head from a directory in the public layout, checked against the client half `model`."""
        config, raw, tensors = read_checkpoint(path)
        problem = target_mismatch(config, tensors, model)
        if problem:
            raise FailedPrecondition(f"{path} is a draft head for another model: {problem}. A head drafts from "
                                     f"this model's own features, so it must be built for it; {TRAINING_HINT}")
        module = HeadModel.from_tensors(layer_config(config, tensors.keys()), tensors)
        draft_ids = None
        if "d2t" in tensors and not full_vocab:
            d2t = tensors["d2t"].long()
            draft_ids = torch.arange(len(d2t)) + d2t
            if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= model.embed.shape[0]:
                raise InfemeralError(f"{path}: its draft vocabulary (d2t) names tokens outside the vocabulary")
        return cls(module, model, draft_ids=draft_ids, quant=quant, description=str(path))

    @property
    def hidden_size(self) -> int:
        return self.module.hidden_size

    def new_cache(self) -> KVCache:
        return self.module.new_cache(self.dtype, self.device)

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model.embed.lookup(torch.tensor(list(ids), dtype=torch.long, device=self.device))

    def memory_bytes(self) -> int:
        from infemeral.client_half import packed

        tensors = [*self.module.parameters(), *self.module.buffers()]
        if self.vocab.target_ids is not None:
            tensors += self.vocab.table.tensors()
        return sum(packed.nbytes(t) for t in tensors)

    def fork(self) -> "HeadDrafter":
        """One session's drafter: these weights, a cache and features of its own."""
        return HeadDrafter(self)


def _to_int8(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every linear of `module` as int8 codes with a scale per row (the client's int8 kernel)."""
    from infemeral.quant.int8 import Int8Linear, aligned, quantize_rows

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                q = Int8Linear(child.in_features, child.out_features, child.bias is not None)
                codes, scales = quantize_rows(child.weight.detach())
                q.weight, q.scale = aligned(codes.to(child.weight.device)), scales.to(child.weight.device, dtype)
                if child.bias is not None:
                    q.bias = child.bias.detach()
                setattr(parent, name, q)


# -- one session's drafter ----------------------------------------------------------------------------

class HeadDrafter:
    """Drafts for one conversation from the features the turn loop hands it (`observe`).

    It keeps the head's KV cache for positions [start, start + cache.length) — position i read the
    embedding of token i+1 and the feature of position i — and the features of the last
    `keep_features` verified positions, so it catches up by itself on steps that drafted from another
    source. A proposal feeds the positions it has not read, then drafts from its own predictions and
    drops them again: only verified positions stay in its cache. When the conversation changes under
    it (a rewind, a rejected draft) it forgets what no longer holds; when it lacks the features it
    needs (the start of a turn whose prompt came without them) it proposes nothing."""

    name = "head"
    is_free = False  # every draft token is a forward pass of the head and a product with the LM head

    def __init__(self, head: DraftHead):
        self.head = head
        self.prompt_features = head.prompt_features
        self.cache = head.new_cache()
        self.start = 0              # the absolute position of the cache's first position
        self.tokens: list[int] = []  # the verified context the features and the cache belong to
        d = head.hidden_size
        self._features = torch.empty(2 * head.keep_features, d, dtype=head.dtype, device=head.device)
        self._feature_start = self._feature_end = 0  # absolute positions held in _features[: end - start]

    # -- what the turn loop reports -------------------------------------------------------------------
    def observe(self, context_ids: Sequence[int], features: torch.Tensor) -> None:
        """`features` [n, d]: the features of the last n positions of `context_ids`, every token of which is
        verified (the model's own output or the prompt)."""
        ids = list(context_ids)
        self._agree(ids)
        self.tokens = ids
        keep = self.head.keep_features
        rows = features[-keep:]
        end = len(ids)
        start = end - len(rows)
        if not len(rows):
            return
        if not self._feature_start <= start <= self._feature_end or self._feature_end == self._feature_start:
            self._feature_start = self._feature_end = start  # not adjacent to what is held: begin again here
        if start - self._feature_start + len(rows) > self._features.shape[0]:  # full: keep the last `keep`
            first = end - keep
            held = self._features[first - self._feature_start:start - self._feature_start].clone()
            self._features[:len(held)] = held
            self._feature_start = first
        offset = start - self._feature_start
        self._features[offset:offset + len(rows)] = rows.to(self._features.dtype)
        self._feature_end = end

    def reset(self) -> None:
        self.cache.truncate(self.cache.length)
        self.tokens, self.start = [], 0
        self._feature_start = self._feature_end = 0

    # -- drafting ------------------------------------------------------------------------------------
    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        """Up to `max_draft` tokens after `context_ids`, whose last token is sampled and not yet verified."""
        return self.head.threads.run(lambda: self._propose(context_ids, max_draft), units=len)  # per draft token

    @torch.inference_mode()
    def _propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        if max_draft <= 0:
            return []
        h = self._read(context_ids)
        if h is None:
            return []
        head = self.head
        verified = self.cache.length
        drafts = [head.vocab.best(h)]
        while len(drafts) < max_draft:
            h = head.module(head.embed(drafts[-1:]).unsqueeze(0), h.unsqueeze(0), self.cache)[0]
            drafts.append(head.vocab.best(h))
        self.cache.truncate(self.cache.length - verified)
        return drafts

    def propose_tree(self, context_ids: Sequence[int], max_nodes: int, max_depth: int,
                     top_k: int = TREE_TOP_K) -> TreeDraft | None:
        """A draft tree after `context_ids` (EAGLE-2): at each depth the `top_k` most probable nodes so far are
        expanded into `top_k` children each, one pass of the head for all of them; the `max_nodes` most
        probable nodes of at most `max_depth` levels are kept. None where the head cannot draft here."""
        return self.head.threads.run(lambda: self._propose_tree(context_ids, max_nodes, max_depth, top_k),
                                     units=lambda tree: tree.depth if tree is not None else 1)  # per pass

    @torch.inference_mode()
    def _propose_tree(self, context_ids: Sequence[int], max_nodes: int, max_depth: int,
                      top_k: int) -> TreeDraft | None:
        if max_nodes <= 0 or max_depth <= 0:
            return None
        h = self._read(context_ids)
        if h is None:
            return None
        head, cache = self.head, self.cache
        verified = cache.length
        tokens, parents, scores = [], [], []  # every candidate node: token, parent node (-1: root), log-probability
        fed: list[int] = []  # nodes run through the head, in cache order (after the verified positions)
        frontier, hidden = [-1], h  # nodes whose children come next, and their predicted features [w, d]
        for depth in range(1, max_depth + 1):
            ids, logp = head.vocab.top(hidden, top_k)
            children = []
            for row, node in enumerate(frontier):
                base = scores[node] if node >= 0 else 0.0
                for token, lp in zip(ids[row], logp[row].tolist()):
                    children.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    scores.append(base + lp)
            if depth == max_depth:
                break
            row_of = {node: row for row, node in enumerate(frontier)}
            frontier = sorted(children, key=lambda i: -scores[i])[:top_k]
            # each fed node reads the verified positions, its fed ancestors and itself, at its depth's position
            mask = torch.zeros(len(frontier), verified + len(fed) + len(frontier), dtype=torch.bool)
            mask[:, :verified] = True
            for row, node in enumerate(frontier):
                mask[row, verified + len(fed) + row] = True
                ancestor = parents[node]
                while ancestor >= 0:
                    mask[row, verified + fed.index(ancestor)] = True
                    ancestor = parents[ancestor]
            positions = torch.full((1, len(frontier)), verified + depth - 1, dtype=torch.long, device=head.device)
            inputs = hidden[[row_of[parents[node]] for node in frontier]]
            hidden = head.module(head.embed([tokens[node] for node in frontier]).unsqueeze(0), inputs.unsqueeze(0),
                                 cache, positions, mask.to(head.device))[0]
            fed += frontier
        cache.truncate(cache.length - verified)
        tree = TreeDraft(tokens, parents, [math.exp(x) for x in scores])
        return tree.best(max_nodes)

    def _read(self, context_ids: Sequence[int]) -> torch.Tensor | None:
        """Run the verified positions the head has not read yet; its predicted feature [1, d] for the token
        after `context_ids` (whose last token is sampled, not verified), or None without the features it needs."""
        m = len(context_ids) - 1
        if m < 1:
            return None
        self._agree(context_ids)
        if self._feature_end < m or self._feature_start > m - 1:
            return None  # the feature of the position before the last token is unknown
        head = self.head
        end = self.start + self.cache.length
        if end > m - 1 and self.cache.length:  # its cache already read position m-1: read it again for its output
            self.cache.truncate(end - (m - 1))
            end = m - 1
        if self.cache.length == 0 or end < self._feature_start or m - self.start > head.max_positions:
            self.cache.truncate(self.cache.length)
            self.start = end = max(self._feature_start, m - head.keep_features, 0)
        feats = self._features[end - self._feature_start:m - self._feature_start]
        return head.module(head.embed(context_ids[end + 1:m + 1]).unsqueeze(0), feats.unsqueeze(0), self.cache)[0, -1:]

    def _agree(self, context_ids: Sequence[int]) -> None:
        """Forget what does not belong to `context_ids`: features of positions past where it leaves the verified
        tokens, and cached positions that read them."""
        tokens = self.tokens
        n = len(tokens)
        if len(context_ids) >= n and list(context_ids[:n]) == tokens:
            return
        q = 0
        for a, b in zip(tokens, context_ids):
            if a != b:
                break
            q += 1
        self.tokens = tokens[:q]
        self._feature_end = min(self._feature_end, q)
        if self._feature_end <= self._feature_start:
            self._feature_start = self._feature_end = 0
        keep = q - 1 - self.start  # position i read token i + 1
        if keep <= 0:
            self.cache.truncate(self.cache.length)
            self.start = 0
        elif keep < self.cache.length:
            self.cache.truncate(self.cache.length - keep)
