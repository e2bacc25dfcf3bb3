"""Store: bytes written per commit over a many-turn session, and cache load time against cache size.

A commit must write the KV of the turn's new tokens, not the whole history: bytes per new token in the
last third of the turns over the first third must stay <= 1.25. Loading a stored cache to open a turn is
compared with recomputing that context from scratch (plain prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import at_most, fmt, log, median, ratio
from bench.instruments import dir_size
from bench.sections import Result

NAME = "store"
TITLE = "Session store"
PROMPT = "Tell me one more short fact about lighthouses (fact {i})."
GROWTH_LIMIT = 1.25


@dataclass
class CommitRow:
    turn: int
    history_tokens: int
    new_tokens: int
    bytes_written: int
    writes: int
    commit_ms: float
    new_tokens_kv_bytes: int

    @property
    def bytes_per_new_token(self) -> float:
        return ratio(self.bytes_written, self.new_tokens)


@dataclass
class LoadRow:
    cache_tokens: int
    stored_bytes: int
    open_ms: float
    plain_reprefill_ms: float


def commits(wb, split) -> list[CommitRow]:
    from infemeral.client.sampling import SamplingParams

    meter, s, rows = split.store_meter, split.client.new_session(), []
    for i in range(wb.params.store_turns):
        before, history, k0 = meter.snapshot(), len(s.history_ids), len(split.recorder.turns)
        r = s.chat(PROMPT.format(i=i + 1), SamplingParams(max_new_tokens=wb.params.store_tokens))
        after = meter.snapshot()
        new = r.cache_length - (history - r.truncated_tokens)
        row = CommitRow(i + 1, history, new, after["bytes"] - before["bytes"], after["writes"] - before["writes"],
                        split.recorder.turns[k0].latency("commit", "committed") * 1000,
                        new * split.kv_bytes_per_token)
        rows.append(row)
        log(f"  turn {row.turn:3d}: history {history:5d}, +{new} tokens, wrote {row.bytes_written / 1024:8.1f} KiB "
            f"in {row.writes} write(s), commit {row.commit_ms:6.1f} ms")
    s.delete()
    return rows


def loads(wb, split) -> list[LoadRow]:
    rows = []
    for length in wb.params.contexts:
        text, ids = split.prompt_of_length(length)
        session = split.client.new_session()
        turn = split.turn(text, 1, session=session, delete=False)
        plain = wb.plain(split.dtype_name).prefill(ids)
        stored = dir_size(split.store_meter.root, session.id.hex()) if split.store_meter.root else 0
        reopen = split.turn("OK.", 1, session=session, delete=False)
        rows.append(LoadRow(turn.cache_length, stored, reopen.open_seconds * 1000, plain["prefill_seconds"] * 1000))
        session.delete()
        log(f"  load {turn.cache_length:5d} tokens ({stored / 2**20:6.1f} MiB stored): open "
            f"{rows[-1].open_ms:7.1f} ms vs plain re-prefill {rows[-1].plain_reprefill_ms:7.0f} ms")
    return rows


def run(wb) -> Result:
    split = wb.split()
    rows = commits(wb, split)
    third = max(1, len(rows) // 3)
    early = median([r.bytes_per_new_token for r in rows[:third]])
    late = median([r.bytes_per_new_token for r in rows[-third:]])
    compactions = [r.turn for r in rows if r.bytes_written > 2 * r.new_tokens_kv_bytes + (1 << 16)]
    facts = {"kv_bytes_per_token": split.kv_bytes_per_token, "early_bytes_per_new_token": early,
             "late_bytes_per_new_token": late, "late_over_early": ratio(late, early), "compactions": compactions,
             "total_over_new_kv": ratio(sum(r.bytes_written for r in rows), sum(r.new_tokens_kv_bytes for r in rows)),
             "loads": loads(wb, split)}
    target = at_most(NAME, "history_independent", "commit bytes per new token independent of history (last/first "
                     f"third of turns <= {GROWTH_LIMIT})", facts["late_over_early"], GROWTH_LIMIT,
                     f"{facts['late_over_early']:.2f}x; {len(compactions)} compaction(s) in {len(rows)} turns")
    method = (f"One session, {len(rows)} short turns ({wb.params.store_tokens} generated tokens each); bytes written "
              f"from {split.store_meter.method}; {split.kv_bytes_per_token:,} B of KV per token in the server's "
              "layers. Commit time is client-observed (commit sent → committed received). Cache load: opening a "
              "turn on a stored session (read, authenticate, decrypt into the engine's pages) against recomputing "
              "that context with a plain prefill; the files were just written, so reads come from the page cache.")
    return Result(NAME, method, rows, [target], facts)


def report(r: Result) -> list[str]:
    f = r.facts
    lines = [r.method + "\n", "| turn | history tokens | new tokens | bytes written | KV of new tokens | writes | "
             "commit ms |", "|---|---|---|---|---|---|---|"]
    pick = sorted({0, 1, len(r.rows) // 2, len(r.rows) - 1} | {t - 1 for t in f["compactions"]})
    for i in pick:
        x = r.rows[i]
        lines.append(f"| {x.turn} | {x.history_tokens} | {x.new_tokens} | {x.bytes_written:,} | "
                     f"{x.new_tokens_kv_bytes:,} | {x.writes} | {fmt(x.commit_ms)} |")
    lines += ["", f"Bytes per new token: first third {fmt(f['early_bytes_per_new_token'], ',.0f')}, last third "
              f"{fmt(f['late_bytes_per_new_token'], ',.0f')} (**{fmt(f['late_over_early'], '.2f')}×**); over all "
              f"turns {fmt(f['total_over_new_kv'], '.2f')}× the KV of the new tokens (compactions: "
              f"{', '.join(map(str, f['compactions'])) or 'none'}).\n",
              "| cache tokens | stored MiB | open turn ms | plain re-prefill ms | re-prefill / open |",
              "|---|---|---|---|---|"]
    lines += [f"| {x.cache_tokens} | {fmt(x.stored_bytes / 2**20)} | {fmt(x.open_ms)} | "
              f"{fmt(x.plain_reprefill_ms, '.0f')} | {fmt(ratio(x.plain_reprefill_ms, x.open_ms), '.1f')}× |"
              for x in f["loads"]]
    return lines + [""]
