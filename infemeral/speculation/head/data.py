"""A draft head's training data: the model's own greedy answers to chat prompts, and the feature of every
position of prompt and answer.

The model answers a set of chat prompts (`prompts.py`) greedily: here (`LocalAnswers`, the checkpoint `prepare`
reads) or, for a model too big for the laptop, through the split system (the SDK's `PodAnswers`), the same
quantity either way. The features are the top layer's output after the final norm, what the LM head reads
and what the laptop computes from the server's residual. Conversations go to disk as they are answered
(`AnswerWriter`) and are read back mapped, a batch at a time, so memory never holds the data set; the files
are kept (`cache_dir`), so training again with other settings does not ask the model again. The reduced
draft vocabulary (EAGLE-3's) is the most frequent tokens of this data.

Answers here are generated in float32 on a CPU unless it computes bfloat16 natively (AVX-512 BF16 / AMX): on
one without, bfloat16 is emulated and slower, and float32 features and answers are exactly the ones the
float32 laptop drafts from (measured: docs/benchmarks/train_head.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from infemeral.devices import native_on_cpu
from infemeral.files import private_file, write_private
from infemeral.layers.architecture import cache_keyword
from infemeral.speculation.head.settings import TrainSettings
from infemeral.threads import FasterThreads

log = logging.getLogger(__name__)
DATA_FORMAT = 6
WIDE_FEATURES = 2048  # features wider than this are kept in bfloat16 on disk (half the bytes), others in float32


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


Keep = Callable[[int, list[int], torch.Tensor], None]
"""`keep(i, ids, features)`: the i-th prompt's conversation as training reads it — the prompt and the answer
but its last token (only ever a target: it was never run), and the feature of each of those positions."""


class Answers(Protocol):
    """Who answers the training prompts: the model here (`LocalAnswers`) or the split system (`PodAnswers`)."""

    description: str   # what answers, and in what dtypes: the key of the answers kept on disk
    eos_ids: set[int]

    def chat_ids(self, prompt: str) -> list[int]: ...

    def answer(self, prompts: list[list[int]], max_new_tokens: int, keep: Keep, progress: bool) -> None: ...

    def target_weights(self) -> tuple[object, torch.Tensor, torch.Tensor]:
        """(the model's config, its embedding table, its LM head): what the head reads and trains against."""


@dataclass
class LocalAnswers:
    """The model answers on this machine, in batches of `batch` prompts, in `dtype` (`generate_dtype`)."""

    model: object
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    threads: FasterThreads | None = None

    @property
    def description(self) -> str:
        return f"{self.name} {self.dtype}"

    @property
    def eos_ids(self) -> set[int]:
        return eos_ids_of(self.model, self.tokenizer)

    def chat_ids(self, prompt: str) -> list[int]:
        return chat_ids(self.tokenizer, prompt)

    def answer(self, prompts: list[list[int]], max_new_tokens: int, keep: Keep, progress: bool = True) -> None:
        answer(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens, batch=self.batch,
               dtype=self.dtype, device=self.device, keep=keep, threads=self.threads, progress=progress)

    def target_weights(self) -> tuple[object, torch.Tensor, torch.Tensor]:
        model = self.model
        return (model.config, model.get_input_embeddings().weight.detach(),
                model.get_output_embeddings().weight.detach())


@torch.inference_mode()
def answer(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch: int, dtype: torch.dtype,
           device: torch.device, keep: Keep, threads: FasterThreads | None = None, progress: bool = True) -> None:
    """The model's greedy answer to each prompt and the feature of every position of prompt and answer — the
    top layer after the final norm, which the decoding computes anyway: one pass gives both — handed to `keep`
    a batch at a time. In batches of `batch` prompts, left-padded so that every answer starts at the same
    column. `threads` measures each batch's first decode steps on one thread and on all, and runs the rest on
    the faster (a prefill runs on the last batch's choice)."""
    from tqdm import tqdm
    from transformers import DynamicCache

    eos = eos_ids_of(model, tokenizer)
    threads = threads or FasterThreads(device, fixed=torch.get_num_threads())
    runner = model.to(device)
    if next(model.parameters()).dtype != dtype:  # a copy: a model handed in comes back as it was
        runner = copy.deepcopy(model).to(dtype)
    body, lm_head = runner.model, runner.get_output_embeddings()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
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
            # the features of the prompt and of every answer token but the last (which was never run)
            keep(i, prompts[i] + out[:-1], hidden[row, width - len(prompts[i]):width + len(out) - 1])
    bar.close()


def _forward(body, lm_head, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache):
    """One forward pass of a batch over its cache: the top layer's output and the greedy next tokens."""
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **{cache_keyword(body): cache}).last_hidden_state
    return hidden, lm_head(hidden[:, -1]).argmax(-1)


def data_key(description: str, prompts: list[str], settings: TrainSettings) -> str:
    blob = json.dumps({"format": DATA_FORMAT, "model": description, "prompts": prompts,
                       "max_new_tokens": settings.max_new_tokens}).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def training_data(answers: Answers, prompts: list[str], settings: TrainSettings, *, cache_dir: Path | None,
                  progress: bool = True) -> TrainingData:
    """Prompts and the answers of `answers` with their features; read from `cache_dir` when made before. Without
    a `cache_dir` the files go to a temporary directory, removed once they are mapped."""
    eos = answers.eos_ids
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="infemeral-answers-") as directory:
            return _made(answers, prompts, settings, Path(directory) / "answers", eos, progress)
    stem = Path(cache_dir).expanduser() / data_key(answers.description, prompts, settings)
    data = read_answers(stem, eos)
    if data is not None:
        log.info("training data from %s", stem.with_suffix(INDEX))
        return data
    stem.parent.mkdir(parents=True, exist_ok=True)
    return _made(answers, prompts, settings, stem, eos, progress)


def _made(answers: Answers, prompts: list[str], settings: TrainSettings, stem: Path, eos: set[int],
          progress: bool) -> TrainingData:
    prompt_ids = [answers.chat_ids(p) for p in prompts]
    with AnswerWriter(stem, [len(p) for p in prompt_ids]) as writer:
        answers.answer(prompt_ids, settings.max_new_tokens, writer.add, progress)
    return read_answers(stem, eos)


INDEX, FEATURES = ".safetensors", ".features"


class AnswerWriter:
    """Conversations written to disk as they are answered, in any order: their features appended through one
    owner-only file (`<stem>.features`, raw rows), then their token ids, lengths and order in the index
    (`<stem>.safetensors`), written last, so an index on disk means whole features. Memory holds one
    conversation at a time, never the data set. `answer_starts`: each prompt's length, by prompt."""

    def __init__(self, stem: Path, answer_starts: list[int]):
        self.stem, self.answer_starts = stem, answer_starts
        self.ids: list[torch.Tensor] = []
        self.order: list[int] = []
        self.dtype: torch.dtype | None = None
        self.hidden_size = 0

    def __enter__(self) -> "AnswerWriter":
        self._opened = private_file(self.stem.with_suffix(FEATURES))
        self._file = self._opened.__enter__()
        return self

    def add(self, index: int, ids: list[int], features: torch.Tensor) -> None:
        """`keep` (`Keep`) for the `index`-th prompt."""
        if len(ids) != features.shape[0] or len(ids) < self.answer_starts[index]:
            raise ValueError(f"conversation {index}: {len(ids)} tokens, {features.shape[0]} features, a prompt of "
                             f"{self.answer_starts[index]}")
        if self.dtype is None:
            self.hidden_size = features.shape[-1]
            self.dtype = torch.bfloat16 if self.hidden_size > WIDE_FEATURES else torch.float32
        rows = features.detach().to("cpu", self.dtype).contiguous()
        self._file.write(rows.view(torch.uint8).numpy().tobytes())
        self.ids.append(torch.tensor(ids, dtype=torch.long))
        self.order.append(index)

    def __exit__(self, *exc) -> None:
        self._opened.__exit__(*exc)
        if exc[0] is not None:
            return
        from safetensors.torch import save

        if len(self.order) != len(self.answer_starts):
            raise RuntimeError(f"{len(self.order)} of {len(self.answer_starts)} prompts were answered")
        write_private(self.stem.with_suffix(INDEX), save({
            "ids": torch.cat(self.ids), "lengths": torch.tensor([len(x) for x in self.ids]),
            "order": torch.tensor(self.order), "answer_starts": torch.tensor(self.answer_starts),
            "hidden_size": torch.tensor(self.hidden_size)}, metadata={"features": str(self.dtype)}))


def read_answers(stem: Path, eos_ids: set[int]) -> TrainingData | None:
    """What an `AnswerWriter` wrote at `stem`, in prompt order, the features mapped from the file rather than
    read (a batch's rows are read as training reaches them); None if nothing whole is there."""
    from safetensors import safe_open

    index = stem.with_suffix(INDEX)
    if not index.exists():
        return None
    with safe_open(str(index), framework="pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
        dtype = getattr(torch, f.metadata()["features"].removeprefix("torch."))
    lengths, order = t["lengths"].tolist(), t["order"].tolist()
    d, total = int(t["hidden_size"]), sum(lengths)
    flat = torch.from_file(str(stem.with_suffix(FEATURES)), shared=False, size=total * d, dtype=dtype)
    ids, features = t["ids"].split(lengths), flat.view(total, d).split(lengths)
    by_prompt = sorted(range(len(order)), key=order.__getitem__)
    return TrainingData([ids[i] for i in by_prompt], [features[i] for i in by_prompt],
                        t["answer_starts"].tolist(), set(eos_ids))


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
