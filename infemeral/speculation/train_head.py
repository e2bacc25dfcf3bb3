"""Train a draft head for any model by self-distillation (`infemeral-client train-drafter`).

The full model — the checkpoint `prepare` reads — answers a set of chat prompts
(`head_prompts.py`) greedily; one more forward pass over each prompt and answer
gives the feature of every position (the top layer's output after the final
norm, what the LM head reads and what the laptop computes from the server's
residual). Those features and tokens are the training data, and the loss is
EAGLE's: regression of the next position's feature (smooth L1) plus the
cross-entropy of the token distribution the frozen LM head reads from the
predicted feature against the one it reads from the true feature. Positions of
the prompt are read as context; only the answer's positions are scored. The
inputs' features carry a little uniform noise (EAGLE's remedy for drafting from
its own, imperfect predictions).

The head is read over a reduced draft vocabulary (EAGLE-3's): the `draft_vocab`
most frequent tokens of the training data; its loss is the target's
distribution restricted to those tokens, and drafting multiplies by only their
rows of the LM head. The answers are cached (`cache_dir`), so training again
with other settings does not ask the model again.

Answers are generated in float32 on a CPU unless it computes bfloat16 natively (AVX-512 BF16 / AMX): on
one without, bfloat16 is emulated and slower, and float32 features and answers are exactly the ones the
float32 laptop drafts from (measured: docs/benchmarks/train_head.md).

Training time is a budget (`minutes`): the learning rate follows a cosine over
it, so a run ends on time with a finished schedule whatever the machine's speed. It ends with a held-out
measurement: tokens a step yields with k drafts, drafted exactly as the
laptop drafts (`HeadDrafter`) and stepped through the answers as a session steps.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from infemeral.speculation.draft_head import DraftHead, HeadModel, layer_config, probe_of, save_head
from infemeral.speculation.head_prompts import chat_prompts
from infemeral.speculation.train_settings import DEFAULT_CACHE, TrainSettings
from infemeral.layers.architecture import cache_keyword

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# -- the data ------------------------------------------------------------------------------------------

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


class ThreadChoice:
    """The faster of one CPU thread and all of them, measured on the work itself and measured again often.

    On a machine whose cores other processes keep busy, every parallel region of a multi-threaded op waits for
    a thread that is not running: one thread is then several times faster (measured here under load: 0.9 s
    against 6.8 s per decode step of 32 answers); on a quiet machine all threads are. The load changes during
    a run of many minutes, so each batch of answers times its first steps both ways and keeps the faster."""

    def __init__(self, device: torch.device, most: int | None = None, fixed: int = 0):
        self.most = most or torch.get_num_threads()
        self.is_fixed = bool(fixed) or device.type != "cpu" or self.most <= 1
        if fixed:
            torch.set_num_threads(fixed)
        self._timings: dict[int, float] = {}

    def before(self, step: int) -> float:
        """Call before decode step `step` of a batch (0, 1, ...); steps 0-3 are the trials."""
        if self.is_fixed or step >= 4:
            return 0.0
        if step == 0:
            self._timings = {}
        torch.set_num_threads(1 if step < 2 else self.most)
        return time.perf_counter()

    def after(self, step: int, started: float) -> None:
        if self.is_fixed or step >= 4:
            return
        threads = torch.get_num_threads()
        seconds = time.perf_counter() - started
        self._timings[threads] = min(seconds, self._timings.get(threads, seconds))
        if step == 3:
            torch.set_num_threads(min(self._timings, key=self._timings.get))


@torch.inference_mode()
def answer(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch: int, dtype: torch.dtype,
           device: torch.device, threads: ThreadChoice | None = None,
           progress: bool = True) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The model's greedy answer to each prompt (ending with its end-of-turn token if it ended there), and the
    feature of every position of prompt and answer — the top layer after the final norm, which the decoding
    computes anyway: one pass gives both. In batches of `batch` prompts, left-padded so that every answer starts
    at the same column."""
    from tqdm import tqdm
    from transformers import DynamicCache

    eos = eos_ids_of(model, tokenizer)
    threads = threads or ThreadChoice(device, fixed=torch.get_num_threads())
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
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      **{cache_keyword(body): cache}).last_hidden_state
        steps = [hidden.float().cpu()]
        tokens = [lm_head(hidden[:, -1]).argmax(-1)]
        is_done = torch.tensor([int(t) in eos for t in tokens[0]])
        for step in range(max_new_tokens - 1):
            if bool(is_done.all()):
                break
            started = threads.before(step)
            mask = torch.cat([mask, mask.new_ones(len(group), 1)], dim=1)
            positions = positions[:, -1:] + 1
            hidden = body(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                          use_cache=True, **{cache_keyword(body): cache}).last_hidden_state
            steps.append(hidden.float().cpu())
            tokens.append(lm_head(hidden[:, -1]).argmax(-1))
            threads.after(step, started)
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


def data_key(description: str, prompts: list[str], settings: TrainSettings, dtype: torch.dtype) -> str:
    blob = json.dumps({"format": DATA_FORMAT, "model": description, "prompts": prompts,
                       "max_new_tokens": settings.max_new_tokens, "dtype": str(dtype)}).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def training_data(model, tokenizer, prompts: list[str], settings: TrainSettings, *, description: str,
                  cache_dir: Path | None, device: torch.device, threads: ThreadChoice | None = None,
                  progress: bool = True) -> TrainingData:
    """Prompts and the model's answers with their features; read from `cache_dir` when made before."""
    from safetensors.torch import load_file, save_file

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
        tmp = path.with_suffix(".tmp")
        save_file({"ids": torch.cat(data.ids), "features": torch.cat(data.features).to(torch.bfloat16
                   if data.features[0].shape[-1] > 2048 else torch.float32),
                   "lengths": torch.tensor([len(x) for x in data.ids]),
                   "answer_starts": torch.tensor(data.answer_starts)}, str(tmp))
        tmp.replace(path)
    return data


def generate_dtype(name: str, model, device: torch.device) -> torch.dtype:
    """The dtype the model answers in: on a CPU bfloat16 only where it is native (see the module's note)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.bfloat16 if native_bf16() else torch.float32
    return next(model.parameters()).dtype


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products natively (oneDNN's check: AVX-512 BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.inference_mode()
def pick_threads(model, device: torch.device, batch: int, most: int) -> int:
    """The faster of one thread and `most` for this model's forward pass on this CPU (see `ThreadChoice`),
    for the training that follows."""
    if device.type != "cpu":
        return torch.get_num_threads()
    body = model.to(device, torch.float32).model
    ids = torch.randint(0, model.config.vocab_size, (batch, 8))
    timings = {}
    for threads in sorted({1, most}):
        torch.set_num_threads(threads)
        body(input_ids=ids)
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            body(input_ids=ids)
            runs.append(time.perf_counter() - t)
        timings[threads] = sorted(runs)[1]
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best


def autocast(device: torch.device):
    """bfloat16 autocast where the device computes it natively (CUDA; CPUs with AVX-512 BF16 / AMX): about
    twice the speed of float32 for the head's training, whose weights and optimiser stay float32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16())


def draft_vocabulary(data: TrainingData, size: int, vocab_size: int) -> torch.Tensor | None:
    """The `size` most frequent tokens of the training data (answers and prompts), most frequent first;
    the end-of-turn tokens always among them. None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.bincount(torch.cat(data.ids), minlength=vocab_size).float()
    counts[sorted(data.eos_ids)] = float("inf")
    seen = int((counts > 0).sum())
    return torch.argsort(counts, descending=True, stable=True)[:min(size, max(seen, 1))]


# -- training -------------------------------------------------------------------------------------------

@dataclass
class Frozen:
    """What the head is trained against and never changes: the embedding table and the LM head's rows."""

    embed: torch.Tensor   # [vocab, d]
    head: torch.Tensor    # [draft vocab, d], rows of the LM head


def frozen_tables(model, draft_ids: torch.Tensor | None, device: torch.device) -> Frozen:
    embed = model.get_input_embeddings().weight.detach().to(device, torch.float32)
    head = model.get_output_embeddings().weight.detach().to(device, torch.float32)
    return Frozen(embed, head if draft_ids is None else head[draft_ids.to(device)].contiguous())


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


# -- measuring ------------------------------------------------------------------------------------------

class _Tables:
    """The part of a client half a `DraftHead` reads (embedding, LM head), over plain float32 tensors."""

    def __init__(self, model, device: torch.device):
        from infemeral.client_half.tables import DenseTokenTable

        self.config = model.config
        self.dtype, self.device = torch.float32, device
        self.embed = DenseTokenTable(model.get_input_embeddings().weight.detach().to(device, torch.float32))
        self.head = DenseTokenTable(model.get_output_embeddings().weight.detach().to(device, torch.float32))


@torch.inference_mode()
def measure(head: DraftHead, data: TrainingData, k: int, limit: int = 1 << 30,
            progress: bool = True) -> tuple[float, float, float]:
    """(first draft right, tokens per step with k drafts, share of answer tokens in the draft vocabulary) over
    the first `limit` answer positions of each of `data`'s conversations, stepped through as a session steps:
    each step drafts k after the last token, keeps the agreeing drafts and the model's own token, and the next
    step starts after them.

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
            drafts = drafter.propose(ids[:m + 1], k)
            truth = ids[m + 1:m + 1 + k]
            accepted = 0
            for a, b in zip(drafts, truth):
                if a != b:
                    break
                accepted += 1
            first += bool(drafts) and drafts[0] == truth[0]
            tokens += 1 + accepted
            steps += 1
            drafter.observe(ids[:m + 1 + accepted], feats[m:m + 1 + accepted])  # the step's verified positions
            bar.update(min(1 + accepted, end - m))
            m += 1 + accepted
    bar.close()
    return first / max(steps, 1), tokens / max(steps, 1), covered / max(answer, 1)


# -- the whole run -------------------------------------------------------------------------------------------

def train_drafter(model: str | Path, output: str | Path, settings: TrainSettings | None = None, *,
                  cache_dir: str | Path | None = DEFAULT_CACHE, progress: bool = True,
                  loaded=None) -> TrainReport:
    """Train a draft head for `model` ('default', a .gguf file or a model directory) and write it to `output`.

    `loaded` (model, tokenizer) skips loading: a model already in memory (tests, benchmarks)."""
    from infemeral.speculation.draft_model import load_model

    settings = settings or TrainSettings()
    device = resolve_device(settings.device)
    torch.manual_seed(settings.seed)
    started = time.perf_counter()
    if loaded is None:
        log.info("loading %s", model)
        target, tokenizer = load_model(model, torch.float32)
    else:
        target, tokenizer = loaded
    config = target.config
    most = torch.get_num_threads()
    prompts = chat_prompts(settings.prompts + settings.held_out, seed=settings.seed)
    data = training_data(target, tokenizer, prompts, settings, description=str(model),
                         cache_dir=None if cache_dir is None else Path(cache_dir), device=device,
                         threads=ThreadChoice(device, most, fixed=settings.threads), progress=progress)
    threads = settings.threads or pick_threads(target, device, settings.generate_batch, most)
    torch.set_num_threads(threads)
    log.info("training on %d CPU thread(s)", threads)
    target.to(device, torch.float32)
    data_seconds = time.perf_counter() - started
    train_data, held = data.split(min(settings.held_out, max(len(data.ids) - 1, 0)))
    draft_ids = draft_vocabulary(train_data, settings.draft_vocab, config.vocab_size)
    frozen = frozen_tables(target, draft_ids, device)
    module = HeadModel(layer_config(config), device=device)
    steps, seconds, loss = train(module, frozen, train_data, settings, device, progress)
    head = DraftHead(module, _Tables(target, device), draft_ids=draft_ids, quant="none")
    first, per_step, coverage = measure(head, held, settings.eval_drafts,
                                                          settings.eval_positions, progress) if held.ids else (
        float("nan"), float("nan"), float("nan"))
    report = TrainReport(settings.prompts, train_data.num_answer_tokens, train_data.num_tokens,
                         len(draft_ids) if draft_ids is not None else config.vocab_size, coverage, steps,
                         data_seconds, seconds, first, per_step, settings.eval_drafts, loss)
    probe_ids, probe_rows = probe_of(lambda ids: target.get_input_embeddings().weight[ids.to(device)].detach(),
                                     config.vocab_size)
    module.to("cpu")
    save_head(output, module, draft_ids=draft_ids, vocab_size=config.vocab_size, probe_ids=probe_ids,
              probe_rows=probe_rows, info={"training": {"model": str(model), **asdict(report),
                                                        "settings": asdict(settings)}})
    return report


def run(args: argparse.Namespace) -> int:
    """`infemeral-client train-drafter`: train with the flags of `add_arguments`, print what was measured."""
    if args.output is None:
        raise ValueError("train-drafter needs --output DIR")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}, but torch sees no CUDA device here (use --device cpu)")
    for flag in ("prompts", "max_new_tokens", "unroll"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be above 0, not {args.minutes} (--max-steps can stop it sooner)")
    logging.getLogger(__name__).setLevel(logging.INFO)
    settings = TrainSettings(prompts=args.prompts, max_new_tokens=args.max_new_tokens, draft_vocab=args.draft_vocab,
                             minutes=args.minutes, unroll=args.unroll, max_steps=args.max_steps, device=args.device,
                             seed=args.seed, threads=args.threads)
    report = train_drafter(args.model, args.output, settings,
                           cache_dir=None if args.cache == "none" else args.cache)
    print(f"wrote {args.output}: {report.describe()}")
    return 0


