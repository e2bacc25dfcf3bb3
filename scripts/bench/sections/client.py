"""Client: what the laptop's half costs per decode step, per verification step, and in memory, by mode.

The client half alone, in-process (no server, no network): one decode step is `cloak` of one token
(embedding, local layer, rotation) plus `logits` of one row (un-rotation, final norm, LM head) over a
cache of `CONTEXT` tokens that is rolled back after each step. Verifying k positions (speculation) is
the same with k tokens and k rows. The server is left out on purpose: its returned residual is
stood in for by the client's own rotated hidden state, which costs the client exactly what a real
one would.

Two models: the default (the workbench's client bundle) and a Llama-3-8B-shaped client half with
random float32 weights built in memory (vocabulary 128,256, hidden 4,096, MLP 14,336, 32/8 heads,
untied head), where the LM head dominates as it does in real deployments. Modes: float32 (the
bundle), bfloat16 (weights packed for oneDNN where the CPU has bf16 kernels, `client_half/packed.py`), and
int8 weight-only (bf16 activations). All modes of one model are timed in
rotation, one step each, so a burst of load from other processes hits them alike. Targets apply at
the 8B shape; agreement of the reduced modes with float32 is measured separately
(`python scripts/studies/client_precision.py`, docs/benchmarks/client_agreement.md).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from bench.harness import at_most, fmt, log, median, now, ratio
from bench.sections import Result

NAME = "client"
TITLE = "The laptop's half: cost per step and memory, float32 / bfloat16 / int8"
CONTEXT = 128
POSITIONS = (1, 3, 5, 9)
MODES = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"), "int8": dict(quant="int8")}
BF16_TARGET, INT8_TARGET, VERIFY_TARGET = 0.45, 0.25, 1.3


@dataclass
class ClientStepRow:
    model: str       # "default" or "8b-shape"
    mode: str        # float32, bfloat16, int8
    positions: int   # tokens in the step (1 = plain decode; k+1 = verifying k drafts)
    cloak_ms: float  # embedding + local layer + rotation
    logits_ms: float  # un-rotation + final norm + LM head

    @property
    def step_ms(self) -> float:
        return self.cloak_ms + self.logits_ms


@dataclass
class ClientMemoryRow:
    model: str
    mode: str
    weights_mb: float  # every tensor the client half holds, each storage once (a tied table once)
    streamed_mb: float  # what one decode step reads whole: all of it but an untied embedding (looked up by row)


def _gb_per_s(streamed_mb: float, step_ms: float) -> float:
    return streamed_mb * 2**20 / step_ms / 1e6


def _streamed_bytes(client) -> int:
    untied_embedding = 0 if client.head is client.embed else sum(t.nbytes for t in client.embed.tensors())
    return client.memory_bytes() - untied_embedding


def _step_timer(client, positions: int):
    """A closure timing one step of `positions` tokens on a cache of CONTEXT tokens, rolled back afterwards."""
    cache = client.new_cache()
    vocab = client.config.vocab_size
    client.cloak([i % vocab for i in range(CONTEXT)], cache)
    ids = [(7 * i + 3) % vocab for i in range(positions)]

    def step() -> tuple[float, float]:
        t0 = now()
        hidden = client.cloak(ids, cache)
        t1 = now()
        client.logits(hidden)
        t2 = now()
        cache.truncate(positions)
        return t1 - t0, t2 - t1

    return step


def _measure(model: str, clients: dict, reps: int) -> list[ClientStepRow]:
    rows = []
    for positions in POSITIONS:
        timers = {mode: _step_timer(c, positions) for mode, c in clients.items()}
        for timer in timers.values():  # warm-up: first calls allocate and pick kernels
            timer()
        samples = {mode: [] for mode in timers}
        order = list(timers)
        for rep in range(reps):
            for mode in order[rep % len(order):] + order[:rep % len(order)]:
                samples[mode].append(timers[mode]())
        for mode, xs in samples.items():
            row = ClientStepRow(model, mode, positions, median([a for a, _ in xs]) * 1000,
                                median([b for _, b in xs]) * 1000)
            rows.append(row)
            log(f"  {model:9s} {mode:8s} {positions} position(s): {row.step_ms:7.1f} ms "
                f"(local layer {row.cloak_ms:.1f}, head {row.logits_ms:.1f})")
    return rows


def _default_clients(wb) -> dict:
    from infemeral.client_half.half import ClientModel
    from infemeral.cloak.bundle import ClientBundle

    bundle = ClientBundle.open(wb.client_dir)
    return {mode: ClientModel(bundle, device="cpu", **kw) for mode, kw in MODES.items()}


def _8b_clients() -> dict:
    from transformers import LlamaConfig

    from infemeral.client_half.half import ClientModel
    from infemeral.cloak.basis import random_orthogonal
    from infemeral.eval.client_precision import RANDOM_8B, random_client_tensors

    config = LlamaConfig(**RANDOM_8B, rope_theta=500000.0, rms_norm_eps=1e-5)
    tensors = random_client_tensors(config)
    basis = random_orthogonal(config.hidden_size, bytes(32)).float()
    # the float32 client shares the float32 tensors; the others hold their own converted copies
    return {mode: ClientModel.from_tensors(config, 1, tensors, basis, device="cpu", **kw) for mode, kw in MODES.items()}


def run(wb) -> Result:
    reps = 5 if wb.quick else 15
    rows, memory = [], []
    for model, build in (("default", lambda: _default_clients(wb)), ("8b-shape", _8b_clients)):
        log(f"building the {model} client half in {', '.join(MODES)}")
        t = now()
        clients = build()
        log(f"  built in {now() - t:.0f} s")
        memory += [ClientMemoryRow(model, mode, c.memory_bytes() / 2**20, _streamed_bytes(c) / 2**20)
                   for mode, c in clients.items()]
        rows += _measure(model, clients, reps)
        del clients
        gc.collect()

    def ms(model, mode, positions=1):
        return next(r.step_ms for r in rows if (r.model, r.mode, r.positions) == (model, mode, positions))

    facts = {f"{model}_{mode}_ratio": ratio(ms(model, mode), ms(model, "float32"))
             for model in ("default", "8b-shape") for mode in ("bfloat16", "int8")}
    facts.update({f"8b-shape_{mode}_verify5": ratio(ms("8b-shape", mode, 5), ms("8b-shape", mode, 1))
                  for mode in MODES})
    streamed = {x.mode: x.streamed_mb * 2**20 for x in memory if x.model == "8b-shape"}
    facts.update({f"8b-shape_{x.mode}_gb_per_s": _gb_per_s(x.streamed_mb, ms("8b-shape", x.mode))
                  for x in memory if x.model == "8b-shape"})
    targets = []
    for mode, name, goal in (("bfloat16", "8b_bf16_step", BF16_TARGET), ("int8", "8b_int8_step", INT8_TARGET)):
        value = facts[f"8b-shape_{mode}_ratio"]
        targets.append(at_most(NAME, name, f"8B shape: {mode} decode step ≤ {goal}× float32", value, goal,
                               f"{fmt(value, '.2f')}x", _rate_note(facts, streamed, mode, goal) if value > goal else ""))
    for mode in ("bfloat16", "int8"):
        value = facts[f"8b-shape_{mode}_verify5"]
        note = ("torch's int8 kernel decodes the weights again for every block of 4 rows, so its cost grows "
                "with the number of positions" if mode == "int8" else "")
        targets.append(at_most(NAME, f"8b_{mode}_verify5", f"8B shape, {mode}: verifying 5 positions ≤ "
                               f"{VERIFY_TARGET}× one position", value, VERIFY_TARGET, f"{fmt(value, '.2f')}x",
                               note if value > VERIFY_TARGET else ""))
    method = (f"In-process, client half only; a cache of {CONTEXT} tokens; medians of {reps} steps per cell, all "
              f"modes of a model in rotation. Step = `cloak` (embedding, local layer, rotation) + `logits` "
              "(un-rotation, final norm, LM head); the server's residual is stood in for by the client's own "
              "rotated hidden state. Weights: bytes of every tensor the client half holds. Streamed: the bytes one "
              "decode step reads whole (all but an untied embedding, which it reads by row) over the step's time.")
    return Result(NAME, method, rows + memory, targets, facts)


def _rate_note(facts: dict, streamed: dict, mode: str, goal: float) -> str:
    """Why a reduced mode misses its ratio: a decode step streams its weights, and float32 already streams fast."""
    base, rate = facts["8b-shape_float32_gb_per_s"], facts[f"8b-shape_{mode}_gb_per_s"]
    needed = base * streamed[mode] / streamed["float32"] / goal
    return (f"a step streams its weights: float32 reads {streamed['float32'] / 1e9:.2f} GB at {base:.1f} GB/s, "
            f"{mode} {streamed[mode] / 1e9:.2f} GB at {rate:.1f} GB/s; {goal}x needs {needed:.1f} GB/s, "
            f"{needed / base:.2f}x float32's rate, from torch's {mode} CPU kernel")


def report(r: Result) -> list[str]:
    steps = [x for x in r.rows if isinstance(x, ClientStepRow)]
    memory = {(x.model, x.mode): x for x in r.rows if isinstance(x, ClientMemoryRow)}
    lines = [r.method + "\n", "| model | mode | weights MB | " + " | ".join(f"{k} pos. ms" for k in POSITIONS)
             + " | local layer ms (1 pos.) | head ms (1 pos.) | step / float32 | weights streamed, GB/s |",
             "|---|---|---:|" + "---:|" * len(POSITIONS) + "---:|---:|---:|---:|"]
    for model in ("default", "8b-shape"):
        base = next((x.step_ms for x in steps if (x.model, x.mode, x.positions) == (model, "float32", 1)), None)
        for mode in MODES:
            cells = {x.positions: x for x in steps if (x.model, x.mode) == (model, mode)}
            if not cells:
                continue
            one, mem = cells[1], memory.get((model, mode))
            rate = _gb_per_s(mem.streamed_mb, one.step_ms) if mem else None
            lines.append(f"| {model} | {mode} | {fmt(mem and mem.weights_mb, '.0f')} | "
                         + " | ".join(fmt(cells[k].step_ms) if k in cells else "–" for k in POSITIONS)
                         + f" | {fmt(one.cloak_ms)} | {fmt(one.logits_ms)} | {fmt(ratio(one.step_ms, base), '.2f')}× "
                         f"| {fmt(rate)} |")
    return lines + [""]
