"""Train a draft head for any model by self-distillation (`infemeral-client train-drafter`).

The data (`data.py`) are the full model's own answers to chat prompts and the feature of every position.
The loss is EAGLE's: regression of the next position's feature (smooth L1) plus the
cross-entropy of the token distribution the frozen LM head reads from the
predicted feature against the one it reads from the true feature. Positions of
the prompt are read as context; only the answer's positions are scored. The
inputs' features carry a little uniform noise (EAGLE's remedy for drafting from
its own, imperfect predictions).

The head is read over a reduced draft vocabulary (EAGLE-3's): the `draft_vocab`
most frequent tokens of the training data; its loss is the target's
distribution restricted to those tokens, and drafting multiplies by only their
rows of the LM head.

Training time is a budget (`minutes`): the learning rate follows a cosine over
it, so a run ends on time with a finished schedule whatever the machine's speed. It ends with a held-out
measurement (`measure.py`).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from infemeral.devices import is_available, native_on_cpu, resolve_device
from infemeral.speculation.head.checkpoint import probe_of, save_head
from infemeral.speculation.head.data import (Answers, LocalAnswers, TrainingData, draft_vocabulary, generate_dtype,
                                             training_data)
from infemeral.speculation.head.drafter import DraftHead
from infemeral.speculation.head.measure import TargetTables, measure
from infemeral.speculation.head.model import HeadModel, layer_config
from infemeral.speculation.head.prompts import chat_prompts
from infemeral.speculation.head.settings import DEFAULT_CACHE, TrainSettings
from infemeral.threads import FasterThreads

log = logging.getLogger(__name__)


@dataclass
class TrainReport:
    prompts: int
    answer_tokens: int
    total_tokens: int
    draft_vocab: int
    vocab_coverage: float          # of held-out answer tokens, the share inside the draft vocabulary
    steps: int
    data_seconds: float
    train_seconds: float
    first_draft_accuracy: float    # held out: the first draft is the model's next token
    tokens_per_step: float         # held out: 1 + accepted drafts, up to `drafts` of them
    drafts: int
    final_loss: float

    def describe(self) -> str:
        return (f"{self.prompts} prompts, {self.answer_tokens} answer tokens; draft vocabulary {self.draft_vocab} "
                f"(covers {self.vocab_coverage:.1%} of held-out answer tokens); {self.steps} steps in "
                f"{self.train_seconds:.0f} s (data {self.data_seconds:.0f} s); held out: first draft right "
                f"{self.first_draft_accuracy:.1%}, {self.tokens_per_step:.2f} tokens per step with up to "
                f"{self.drafts} drafts")


@torch.inference_mode()
def training_threads(model, device: torch.device, batch: int) -> int:
    """The faster of one thread and all for this model's forward pass on this CPU, for the training that follows
    (whose steps are too long to try both ways)."""
    if device.type != "cpu":
        return torch.get_num_threads()
    body = model.to(device, torch.float32).model
    ids = torch.randint(0, model.config.vocab_size, (batch, 8))
    return FasterThreads(device).choose(lambda: body(input_ids=ids))


def autocast(device: torch.device):
    """bfloat16 autocast where the device computes it natively (CUDA; CPUs with AVX-512 BF16 / AMX): about
    twice the speed of float32 for the head's training, whose weights and optimiser stay float32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_on_cpu(torch.bfloat16))


# -- training -------------------------------------------------------------------------------------------

@dataclass
class Frozen:
    """What the head is trained against and never changes: the embedding table and the LM head's rows."""

    embed: torch.Tensor   # [vocab, d]
    head: torch.Tensor    # [draft vocab, d], rows of the LM head


def frozen_tables(tables: TargetTables, draft_ids: torch.Tensor | None) -> Frozen:
    embed, head = tables.embed.weight, tables.head.weight
    return Frozen(embed, head if draft_ids is None else head[draft_ids.to(head.device)].contiguous())


def batches(data: TrainingData, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices of sequences in batches of about `batch_tokens` positions, similar lengths together."""
    order = sorted(range(len(data.ids)), key=lambda i: (len(data.ids[i]), rng.random()))
    out, group = [], []
    for i in order:
        if group and len(data.ids[i]) * (len(group) + 1) > batch_tokens:
            out.append(group)
            group = []
        group.append(i)
    if group:
        out.append(group)
    rng.shuffle(out)
    return out


def head_loss(module: HeadModel, frozen: Frozen, data: TrainingData, group: list[int], settings: TrainSettings,
              device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """EAGLE's loss over one batch — feature regression + token cross-entropy, answer positions only — summed
    over `settings.unroll` drafts in a row (pass s weighted `unroll_weight`^s), each scored where a session
    would draft it: a chain that starts at the prompt's last position or later."""
    width = max(len(data.ids[i]) for i in group)
    d = frozen.embed.shape[1]
    ids = torch.zeros((len(group), width), dtype=torch.long)
    feats = torch.zeros((len(group), width, d))
    mask = torch.zeros((len(group), width - 1))
    for row, i in enumerate(group):
        n = len(data.ids[i])
        ids[row, :n], feats[row, :n] = data.ids[i], data.features[i]
        mask[row, max(data.answer_starts[i] - 1, 0):n - 1] = 1  # position i predicts position i + 1's feature
    ids, feats, mask = ids.to(device), feats.to(device), mask.to(device)
    inputs = feats[:, :-1]
    if settings.noise > 0:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        inputs = inputs + (torch.rand(inputs.shape, generator=generator, device="cpu").to(device) - 0.5) \
            * settings.noise * rms
    passes = module.unrolled(frozen.embed[ids[:, 1:]], inputs, max(settings.unroll, 1))
    target = feats[:, 1:]
    with torch.no_grad():
        target_p = torch.softmax(target @ frozen.head.T, dim=-1)
    total = 0.0
    for s, predicted in enumerate(passes):
        scored = mask.clone()
        if s:
            scored[:, s:] *= mask[:, :-s]  # the chain's start, j − s, is a position a session drafts from
            scored[:, :s] = 0
        count = scored.sum().clamp(min=1)
        feature_loss = (F.smooth_l1_loss(predicted, target, reduction="none").mean(-1) * scored).sum() / count
        log_p = torch.log_softmax(predicted @ frozen.head.T, dim=-1)
        token_loss = -((target_p * log_p).sum(-1) * scored).sum() / count
        total = total + settings.unroll_weight ** s * (settings.feature_weight * feature_loss
                                                       + settings.token_weight * token_loss)
    return total


def train(module: HeadModel, frozen: Frozen, data: TrainingData, settings: TrainSettings, device: torch.device,
          progress: bool = True) -> tuple[int, float, float]:
    """Train `module` in place within the time budget; (steps, seconds, final loss)."""
    from tqdm import tqdm

    module.train().requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    budget = settings.minutes * 60
    warmup = 0.03
    started = time.perf_counter()
    steps, recent = 0, []
    bar = tqdm(total=int(budget), desc="training", unit="s", disable=not progress)
    shown = 0
    done = False
    while not done:
        for group in batches(data, settings.batch_tokens, rng):
            elapsed = time.perf_counter() - started
            fraction = elapsed / budget if budget > 0 else 1.0
            if settings.max_steps:
                fraction = max(fraction, steps / settings.max_steps)
            if fraction >= 1.0:
                done = True
                break
            scale = fraction / warmup if fraction < warmup else 0.05 + 0.95 * 0.5 * (1 + math.cos(
                math.pi * (fraction - warmup) / (1 - warmup)))
            for g in optimizer.param_groups:
                g["lr"] = settings.lr * scale
            with autocast(device):
                loss = head_loss(module, frozen, data, group, settings, device, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            steps += 1
            recent = (recent + [float(loss.detach())])[-50:]
            now = int(time.perf_counter() - started)
            if now > shown:
                bar.update(min(now, int(budget)) - shown)
                shown = min(now, int(budget))
            bar.set_postfix(step=steps, loss=f"{sum(recent) / len(recent):.3f}", refresh=False)
    bar.close()
    module.eval().requires_grad_(False)
    return steps, time.perf_counter() - started, sum(recent) / max(len(recent), 1)


# -- the whole run -------------------------------------------------------------------------------------------

def train_drafter(model: str | Path, output: str | Path, settings: TrainSettings | None = None, *,
                  cache_dir: str | Path | None = DEFAULT_CACHE, progress: bool = True,
                  loaded=None, answers: Answers | None = None) -> TrainReport:
    """Train a draft head for `model` ('default', a .gguf file or a model directory) and write it to `output`.

    `loaded` (model, tokenizer) skips loading: a model already in memory (tests, benchmarks). `answers` answers
    the prompts instead of the model here: the split system (the SDK's `PodAnswers`) for a model too big for
    this machine; `model` then only names it in the head's record."""
    settings = settings or TrainSettings()
    device = resolve_device(settings.device)
    torch.manual_seed(settings.seed)
    started = time.perf_counter()
    target = None
    if answers is None:
        if loaded is None:
            from infemeral.cloak.sources import load_model

            log.info("loading %s", model)
            target, tokenizer = load_model(model, torch.float32)
        else:
            target, tokenizer = loaded
        answers = local_answers(model, target, tokenizer, settings, device)
    data = answered(answers, settings, cache_dir, progress)
    threads = settings.threads or (training_threads(target, device, settings.generate_batch) if target is not None
                                   else torch.get_num_threads())
    torch.set_num_threads(threads)
    log.info("training on %d CPU thread(s)", threads)
    tables = TargetTables(*answers.target_weights(), device)
    config = tables.config
    data_seconds = time.perf_counter() - started
    train_data, held = split(data, settings)
    draft_ids = draft_vocabulary(train_data, settings.draft_vocab, config.vocab_size)
    frozen = frozen_tables(tables, draft_ids)
    module = HeadModel(layer_config(config), device=device)
    steps, seconds, loss = train(module, frozen, train_data, settings, device, progress)
    head = DraftHead(module, tables, draft_ids=draft_ids, quant="none")
    first, per_step, coverage = measure(head, held, settings.eval_drafts,
                                                          settings.eval_positions, progress) if held.ids else (
        float("nan"), float("nan"), float("nan"))
    report = TrainReport(settings.prompts, train_data.num_answer_tokens, train_data.num_tokens,
                         len(draft_ids) if draft_ids is not None else config.vocab_size, coverage, steps,
                         data_seconds, seconds, first, per_step, settings.eval_drafts, loss)
    probe_ids, probe_rows = probe_of(lambda ids: tables.embed.lookup(ids.to(device)), config.vocab_size)
    module.to("cpu")
    save_head(output, module, draft_ids=draft_ids, vocab_size=config.vocab_size, probe_ids=probe_ids,
              probe_rows=probe_rows, info={"training": {"model": str(model), "answered_by": answers.description,
                                                        **asdict(report), "settings": asdict(settings)}})
    return report


def local_answers(model: str | Path, target, tokenizer, settings: TrainSettings, device: torch.device) -> LocalAnswers:
    """The model here answering as a training run has it answer (the name and dtype key its answers on disk)."""
    answering = FasterThreads(device, trials=2, fixed=settings.threads)  # a batch's first 4 decode steps try
    return LocalAnswers(target, tokenizer, str(model), device, generate_dtype(settings.generate_dtype, target, device),
                        settings.generate_batch, answering)


def answered(answers: Answers, settings: TrainSettings, cache_dir: str | Path | None,
             progress: bool = True) -> TrainingData:
    """The training prompts and the held-out ones as `answers` answered them (from `cache_dir` if made before)."""
    prompts = chat_prompts(settings.prompts + settings.held_out, seed=settings.seed)
    return training_data(answers, prompts, settings, cache_dir=None if cache_dir is None else Path(cache_dir),
                         progress=progress)


def split(data: TrainingData, settings: TrainSettings) -> tuple[TrainingData, TrainingData]:
    """(what the head trains on, the held-out answers it is measured on)."""
    return data.split(min(settings.held_out, max(len(data.ids) - 1, 0)))


def run(args: argparse.Namespace, answers: Answers | None = None) -> int:
    """`infemeral-client train-drafter`: train with the flags of `add_arguments`, print what was measured;
    `answers` (the pod's, with --server) answers instead of the model here."""
    check_arguments(args)
    logging.getLogger(__package__).setLevel(logging.INFO)  # this module's and the data's
    settings = TrainSettings(prompts=args.prompts, max_new_tokens=args.max_new_tokens, draft_vocab=args.draft_vocab,
                             minutes=args.minutes, unroll=args.unroll, max_steps=args.max_steps, device=args.device,
                             seed=args.seed, threads=args.threads, in_flight=args.in_flight)
    report = train_drafter(args.model, args.output, settings,
                           cache_dir=None if args.cache == "none" else args.cache, answers=answers)
    print(f"wrote {args.output}: {report.describe()}")
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse flags a run cannot use, before anything loads or connects."""
    if args.output is None:
        raise ValueError("train-drafter needs --output DIR")
    if args.device.startswith("cuda") and not is_available("cuda"):
        raise ValueError(f"--device {args.device}, but torch sees no CUDA device here (use --device cpu)")
    for flag in ("prompts", "max_new_tokens", "unroll", "in_flight"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be above 0, not {args.minutes} (--max-steps can stop it sooner)")
    available, held_out = len(chat_prompts()), TrainSettings().held_out
    if args.prompts + held_out > available:
        raise ValueError(f"--prompts {args.prompts}: there are {available} chat prompts and a run holds out "
                         f"{held_out} of them, so at most --prompts {available - held_out}")


