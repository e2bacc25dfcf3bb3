"""Tensor parallelism: what each rank holds, what a step costs, and that 2 ranks answer as 1 does.

A correctness run on this machine, not a speed claim: on a CPU the ranks are processes that share the same
cores and memory bandwidth and talk over gloo on loopback, so two ranks are not expected to step faster
than one; on a pod they are GPUs with NVLink (scripts/gpu_check.py measures that). The model is a
random-weight Llama built in memory with an even head count (the packaged default model's 9 heads do not
divide by 2), prepared into bundles as any model is. The engines are driven directly (no gRPC): one rank
and two ranks side by side in this process, the second rank a process of its own.

* resident weight bytes per rank: the served layers each rank holds (norms are replicated, so a little
  over 1/N), and its share of the KV page pool (exactly 1/N);
* step time: a decode step of 1 and of 8 sessions at a 256-token context, interleaved between the rank
  counts, medians; one rank uses every core, each of two ranks half of them;
* agreement: a 512-token prompt through both (every position's logits through the client's head), then
  greedy tokens.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch

from bench.harness import at_least, at_most, fmt, log, now
from bench.sections import Result

NAME = "tensor_parallel"
TITLE = "Tensor parallelism (CPU ranks: a correctness run)"
SHAPE = dict(hidden_size=512, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1536, vocab_size=4096)
CONTEXT = 256
SESSIONS = (1, 8)
PROMPT_TOKENS = 512
GREEDY_TOKENS = 32


@dataclass
class TensorParallelRow:
    ranks: int
    sessions: int
    step_ms: float                 # median decode step, all sessions in one forward pass
    weight_bytes_per_rank: int     # the largest rank's served-layer weights
    pool_bytes_per_rank: int
    threads_per_rank: int

    @property
    def tokens_per_second(self) -> float:
        return self.sessions * 1000 / self.step_ms if self.step_ms else float("nan")


def build(tmp):
    from transformers import LlamaConfig, LlamaForCausalLM

    from infemeral.cloak.bundle import ClientBundle, ServerBundle
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource
    from infemeral.client_half.half import ClientModel

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.05)
    model = LlamaForCausalLM(config).eval()
    b = prepare(output=tmp / "tp-bundles", source=ModelSource(model, description="random Llama"), progress=False)
    return ServerBundle.open(b.server_dir), ClientModel(ClientBundle.open(b.client_dir), device="cpu")


def engine_config(device: str):
    from infemeral.kvcache.window import WindowPolicy
    from infemeral.server.config import EngineConfig

    return EngineConfig(device=device, dtype="float32", window=WindowPolicy(2048), kv_pool_tokens=16384,
                        max_step_tokens=PROMPT_TOKENS)


class Threads:
    """Torch threads of this process for one side of the comparison (the other rank copied its count)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def step_times(engine, client, sessions: int, steps: int, threads: int) -> list[float]:
    """Open `sessions` turns at CONTEXT tokens, then time `steps` decode steps of all of them together."""
    turns = []
    gen = torch.Generator().manual_seed(sessions)
    d = client.hidden_size
    with Threads(threads):
        for _ in range(sessions):
            turn = engine.open_turn(os.urandom(16), os.urandom(32), 0, engine.bundle.fingerprint,
                                    reserve_tokens=CONTEXT + steps + 4)
            engine.step(turn, torch.randn(CONTEXT, d, generator=gen), 0)
            turns.append(turn)
        times = []
        for _ in range(steps + 2):
            t = now()
            futures = [engine.submit_step(turn, torch.randn(1, d, generator=gen), turn.cache.length) for turn in turns]
            for f in futures:
                f.result()
            times.append((now() - t) * 1000)
        for turn in turns:
            engine.close_turn(turn)
    return times[2:]  # after a warm-up


def run(wb) -> Result:
    from infemeral.server.engine import Engine
    from infemeral.server.parallel.driver import TensorParallel
    from infemeral.server.parallel.shard import parameter_bytes
    from infemeral.storage.directory import DirectoryStore

    device = "cuda" if wb.device == "cuda" and torch.cuda.device_count() >= 2 else "cpu"
    cores = os.cpu_count() or 1
    split_threads = max(1, cores // 2)
    steps = 8 if wb.quick else 24
    bundle, client = build(wb.tmp)
    config = engine_config(device)
    log(f"  random Llama {SHAPE}; 1 rank with {cores} threads, 2 ranks with {split_threads} each, on {device}")
    one = Engine(bundle, DirectoryStore(wb.tmp / "tp-one"), config)
    with Threads(split_threads):
        tp = TensorParallel.start(bundle, config, 2)
    two = Engine(bundle, DirectoryStore(wb.tmp / "tp-two"), config, runner=tp.runner)
    try:
        single_bytes = parameter_bytes(one.runner.layers)
        single_pool = one.kv.nbytes
        rank_weights = max(w for w, _ in tp.rank_bytes)
        rank_pool = max(p for _, p in tp.rank_bytes)
        rows = []
        for sessions in SESSIONS:
            a, b = [], []
            for rep in range(2):  # AB BA
                sides = [(one, cores, a), (two, split_threads, b)]
                for engine, threads, out in (sides if rep == 0 else sides[::-1]):
                    out += step_times(engine, client, sessions, steps // 2, threads)
            rows.append(TensorParallelRow(1, sessions, statistics.median(a), single_bytes, single_pool, cores))
            rows.append(TensorParallelRow(2, sessions, statistics.median(b), rank_weights, rank_pool, split_threads))
            log(f"  {sessions} session(s): step {rows[-2].step_ms:.1f} ms on 1 rank, {rows[-1].step_ms:.1f} ms on 2")
        top1, logit_diff, greedy_same = agreement(one, two, client, split_threads)
    finally:
        one.stop()
        two.stop()
        tp.close()
    share = rank_weights / single_bytes
    log(f"  weights per rank {share:.3f}x of one rank's; top-1 {top1:.4f}, largest logit difference {logit_diff:.2e}; "
        f"greedy identical for {greedy_same} of {GREEDY_TOKENS}")
    facts = {"weight_share": share, "pool_share": rank_pool / single_pool, "top1": top1, "logit_diff": logit_diff,
             "greedy_identical": greedy_same, "device": device, "cores": cores}
    targets = [
        at_most(NAME, "weights_per_rank", "each of 2 ranks holds at most 0.55x of the served weights (norms are "
                "replicated)", share, 0.55, f"{share:.3f}x of one rank's"),
        at_least(NAME, "top1_agreement", f"2 ranks' logits pick 1 rank's top-1 token at every one of {PROMPT_TOKENS} "
                 "positions", top1, 1.0, f"{top1:.4f}"),
        at_most(NAME, "logit_difference", "largest logit difference between 2 ranks and 1 <= 1e-3 (fp32; the "
                "all-reduce sums in another order)", logit_diff, 1e-3, f"{logit_diff:.2e}"),
        at_least(NAME, "greedy_identical", "2 ranks' greedy tokens identical to 1 rank's", greedy_same, GREEDY_TOKENS,
                 f"{greedy_same} of {GREEDY_TOKENS}"),
    ]
    method = (f"A random-weight Llama ({SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
              f"{SHAPE['num_attention_heads']} heads, {SHAPE['num_key_value_heads']} KV heads, MLP "
              f"{SHAPE['intermediate_size']}) in float32 on {device}, engines driven directly: 1 rank with {cores} "
              f"torch threads against 2 ranks (gloo) with {split_threads} each. Step: a decode step of every session "
              f"at a {CONTEXT}-token context, medians of {steps} interleaved steps. Agreement: a {PROMPT_TOKENS}-token "
              f"prompt's logits at every position, then {GREEDY_TOKENS} greedy tokens. On a CPU this is a correctness "
              "run, not a speed claim: the ranks share the same cores and memory bandwidth.")
    return Result(NAME, method, rows, targets, facts)


def agreement(one, two, client, split_threads: int) -> tuple[float, float, int]:
    """(top-1 agreement and largest logit difference over a prompt's positions, greedy tokens identical)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (PROMPT_TOKENS,), generator=gen).tolist()
    logits, greedy = [], []
    for engine, threads in ((one, os.cpu_count() or 1), (two, split_threads)):
        with Threads(threads):
            cache = client.new_cache()
            turn = engine.open_turn(os.urandom(16), os.urandom(32), 0, engine.bundle.fingerprint,
                                    reserve_tokens=PROMPT_TOKENS + GREEDY_TOKENS)
            out = engine.step(turn, client.cloak(ids, cache), 0, PROMPT_TOKENS).hidden
            logits.append(client.logits(out))
            tokens = [int(logits[-1][-1].argmax())]
            for _ in range(GREEDY_TOKENS - 1):
                out = engine.step(turn, client.cloak(tokens[-1:], cache), turn.cache.length).hidden
                tokens.append(int(client.logits(out)[-1].argmax()))
            engine.close_turn(turn)
            greedy.append(tokens)
    a, b = logits
    same = next((i for i, (x, y) in enumerate(zip(*greedy)) if x != y), GREEDY_TOKENS)
    return float((a.argmax(-1) == b.argmax(-1)).float().mean()), float((a - b).abs().max()), same


def report(r: Result) -> list[str]:
    f = r.facts
    lines = [r.method + "\n", "| ranks | sessions | step (ms) | tokens/s | served weights per rank (MB) | KV pool per "
             "rank (MB) | threads per rank |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {x.ranks} | {x.sessions} | {fmt(x.step_ms)} | {fmt(x.tokens_per_second)} | "
              f"{x.weight_bytes_per_rank / 2**20:.1f} | {x.pool_bytes_per_rank / 2**20:.1f} | {x.threads_per_rank} |"
              for x in r.rows]
    lines += ["", f"Each of 2 ranks holds {fmt(f['weight_share'], '.3f')}x of the served weights and "
              f"{fmt(f['pool_share'], '.3f')}x of the KV pool. Over {PROMPT_TOKENS} positions: top-1 agreement "
              f"{fmt(f['top1'], '.4f')}, largest logit difference {fmt(f['logit_diff'], '.2e')}; greedy tokens "
              f"identical for {f['greedy_identical']} of {GREEDY_TOKENS}.\n"]
    return lines
