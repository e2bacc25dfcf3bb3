"""A draft head's training data: the full model's own greedy answers to chat prompts, and the feature of every
position of prompt and answer.

The full model — the checkpoint `prepare` reads — answers a set of chat prompts
(`prompts.py`) greedily; the features are the top layer's output after the final
norm, what the LM head reads and what the laptop computes from the server's
residual. The answers are cached (`cache_dir`), so training again with other
settings does not ask the model again. The reduced draft vocabulary (EAGLE-3's)
is the most frequent tokens of this data.

Answers are generated in float32 on a CPU unless it computes bfloat16 natively (AVX-512 BF16 / AMX): on
one without, bfloat16 is emulated and slower, and float32 features and answers are exactly the ones the
float32 laptop drafts from (measured: docs/benchmarks/train_head.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infemeral.devices import native_on_cpu
from infemeral.files import write_private
from infemeral.layers.architecture import cache_keyword
from infemeral.speculation.head.settings import TrainSettings
from infemeral.threads import FasterThreads

log = logging.getLogger(__name__)
DATA_FORMAT = 5


@dataclass
class TrainingData:
    """Conversations as the model answered them: tokens, features of every position, where each answer starts."""

    ids: list[torch.Tensor]        # [L] long
    features: list[torch.Tensor]   # [L, d]
    answer_starts: list[int]
    eos_ids: set[int] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.ids)

    @property
    def num_answer_tokens(self) -> int:
        return sum(len(x) - s for x, s in zip(self.ids, self.answer_starts))

    def split(self, held_out: int) -> tuple["TrainingData", "TrainingData"]:
        n = len(self.ids) - held_out
        part = lambda a, b: TrainingData(self.ids[a:b], self.features[a:b], self.answer_starts[a:b],  # noqa: E731
                                         self.eos_ids)
        return part(0, n), part(n, len(self.ids))



def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def eos_ids_of(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def answer(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch: int, dtype: torch.dtype,
           device: torch.device, threads: FasterThreads | None = None,
           progress: bool = True) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The model's greedy answer to each prompt (ending with its end-of-turn token if it ended there), and the
    feature of every position of prompt and answer — the top layer after the final norm, which the decoding
    computes anyway: one pass gives both. In batches of `batch` prompts, left-padded so that every answer starts
    at the same column. `threads` measures each batch's first decode steps on one thread and on all, and
    runs the rest on the faster (a prefill runs on the last batch's choice)."""
    from tqdm import tqdm
    from transformers import DynamicCache

    eos = eos_ids_of(model, tokenizer)
    threads = threads or FasterThreads(device, fixed=torch.get_num_threads())
    runner = model.to(device)
    if next(model.parameters()).dtype != dtype:  # a copy: a model handed in comes back as it was
        runner = copy.deepcopy(model).to(dtype)
    body, lm_head = runner.model, runner.get_output_embeddings()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    features: list[torch.Tensor | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts) * max_new_tokens, desc="answering", unit="tok", disable=not progress)
    for b in range(0, len(order), batch):
        group = order[b:b + batch]
        width = max(len(prompts[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=runner.config)
        threads.restart()  # the load may have changed since the last batch
        hidden, first = threads.run(lambda: _forward(body, lm_head, ids, mask, positions, cache), measured=False)
        steps = [hidden.float().cpu()]
        tokens = [first]
        is_done = torch.tensor([int(t) in eos for t in tokens[0]])
        for _ in range(max_new_tokens - 1):
            if bool(is_done.all()):
                break
            mask = torch.cat([mask, mask.new_ones(len(group), 1)], dim=1)
            positions = positions[:, -1:] + 1
            hidden, token = threads.run(lambda: _forward(body, lm_head, tokens[-1][:, None], mask, positions, cache))
            steps.append(hidden.float().cpu())
            tokens.append(token)
            is_done |= torch.tensor([int(t) in eos for t in tokens[-1]])
            bar.update(len(group))
        bar.update(len(group) * (max_new_tokens - len(tokens) + 1))
        generated = torch.stack(tokens, dim=1).cpu()
        hidden = torch.cat(steps, dim=1)
        for row, i in enumerate(group):
            out = generated[row].tolist()
            for j, token in enumerate(out):
                if token in eos:
                    out = out[:j + 1]
                    break
            answers[i] = out
            # the features of the prompt and of every answer token but the last (which was never run)
            features[i] = hidden[row, width - len(prompts[i]):width + len(out) - 1].clone()
    bar.close()
    return answers, features


def _forward(body, lm_head, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache):
    """One forward pass of a batch over its cache: the top layer's output and the greedy next tokens."""
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **{cache_keyword(body): cache}).last_hidden_state
    return hidden, lm_head(hidden[:, -1]).argmax(-1)


def data_key(description: str, prompts: list[str], settings: TrainSettings, dtype: torch.dtype) -> str:
    blob = json.dumps({"format": DATA_FORMAT, "model": description, "prompts": prompts,
                       "max_new_tokens": settings.max_new_tokens, "dtype": str(dtype)}).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def training_data(model, tokenizer, prompts: list[str], settings: TrainSettings, *, description: str,
                  cache_dir: Path | None, device: torch.device, threads: FasterThreads | None = None,
                  progress: bool = True) -> TrainingData:
    """Prompts and the model's answers with their features; read from `cache_dir` when made before."""
    from safetensors.torch import load_file, save

    dtype = generate_dtype(settings.generate_dtype, model, device)
    eos = eos_ids_of(model, tokenizer)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir).expanduser() / f"{data_key(description, prompts, settings, dtype)}.safetensors"
        if path.exists():
            t = load_file(str(path))
            lengths, starts = t["lengths"].tolist(), t["answer_starts"].tolist()
            ids, features = t["ids"].split(lengths), t["features"].float().split(lengths)
            log.info("training data from %s", path)
            return TrainingData(list(ids), list(features), starts, eos)
    prompt_ids = [chat_ids(tokenizer, p) for p in prompts]
    answers, features = answer(model, tokenizer, prompt_ids, max_new_tokens=settings.max_new_tokens,
                               batch=settings.generate_batch, dtype=dtype, device=device, threads=threads,
                               progress=progress)
    # the answer's last token is only ever a target: the sequence stops before it
    data = TrainingData([torch.tensor(p + a[:-1]) for p, a in zip(prompt_ids, answers)], features,
                        [len(p) for p in prompt_ids], eos)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, save({"ids": torch.cat(data.ids), "features": torch.cat(data.features).to(
            torch.bfloat16 if data.features[0].shape[-1] > 2048 else torch.float32),
            "lengths": torch.tensor([len(x) for x in data.ids]), "answer_starts": torch.tensor(data.answer_starts)}))
    return data


def generate_dtype(name: str, model, device: torch.device) -> torch.dtype:
    """The dtype the model answers in: on a CPU bfloat16 only where it is native (see the module's note)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.bfloat16 if native_on_cpu(torch.bfloat16) else torch.float32
    return next(model.parameters()).dtype


def draft_vocabulary(data: TrainingData, size: int, vocab_size: int) -> torch.Tensor | None:
    """The `size` most frequent tokens of the training data (answers and prompts), most frequent first;
    the end-of-turn tokens always among them. None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.bincount(torch.cat(data.ids), minlength=vocab_size).float()
    counts[sorted(data.eos_ids)] = float("inf")
    seen = int((counts > 0).sum())
    return torch.argsort(counts, descending=True, stable=True)[:min(size, max(seen, 1))]
