"""Agreement: the split system in bfloat16 and float16 against plain transformers in the same dtype (and float32).

Reduced precision cannot be token-identical (the rotated weights round differently), so it is measured:
the split system's greedy tokens are teacher-forced through the plain model and compared position by
position (infemeral/eval/serving_precision.py): top-1 agreement rate, first divergence, and the largest gap
between the plain model's logits for its own choice and the split system's at a divergence. The targets
are the test suite's thresholds (tests/eval/test_reduced_precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import at_least, at_most, fmt, log
from bench.sections import Result

NAME = "agreement"
TITLE = "Agreement in reduced precision"
PROMPTS = ("Write a long story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how bread is made, step by step, in detail.")


@dataclass
class AgreementRow:
    dtype: str              # the split server's dtype (the client stays float32)
    against: str            # the plain model's dtype
    positions: int
    top1_matches: int
    first_divergence: int | None   # earliest over the prompts
    max_margin: float

    @property
    def top1_rate(self) -> float:
        return self.top1_matches / self.positions if self.positions else float("nan")


def run(wb) -> Result:
    from infemeral.eval.serving_precision import MAX_MARGIN, MIN_TOP1_RATE, teacher_forced_agreement

    rows, targets = [], []
    for dtype in ("bfloat16", "float16"):
        split = wb.split(dtype)
        runs = [(split.template(p), split.turn(p, wb.params.agreement_tokens).token_ids) for p in PROMPTS]
        for against in (dtype, "float32"):
            scored = [teacher_forced_agreement(wb.plain(against).model, ids, tokens) for ids, tokens in runs]
            firsts = [s.first_divergence for s in scored if s.first_divergence is not None]
            row = AgreementRow(dtype, against, sum(s.positions for s in scored), sum(s.top1_matches for s in scored),
                               min(firsts, default=None), max(s.max_margin for s in scored))
            rows.append(row)
            log(f"  split {dtype} vs plain {against}: top-1 {row.top1_rate:.1%} of {row.positions}, first divergence "
                f"{row.first_divergence}, largest margin {row.max_margin:.3f}")
        same = rows[-2]
        targets.append(at_least(NAME, f"{dtype}_top1", f"split {dtype} greedy tokens = plain {dtype} top-1 at >= "
                                f"{MIN_TOP1_RATE[dtype]:.0%} of positions", same.top1_rate, MIN_TOP1_RATE[dtype],
                                f"{same.top1_rate:.1%} of {same.positions}"))
        targets.append(at_most(NAME, f"{dtype}_margin", f"split {dtype} diverges only at near-ties (plain logit gap <= "
                               f"{MAX_MARGIN[dtype]})", same.max_margin, MAX_MARGIN[dtype], f"{same.max_margin:.3f}"))
    method = (f"{len(PROMPTS)} chat prompts, {wb.params.agreement_tokens} greedy tokens each from the split system "
              "(server in the dtype shown, client in float32), teacher-forced through plain transformers. First "
              "divergence: the earliest over the prompts, in tokens of the answer.")
    return Result(NAME, method, rows, targets)


def report(r: Result) -> list[str]:
    lines = [r.method + "\n", "| split server | plain model | positions | top-1 agreement | first divergence | "
             "largest margin at a divergence |", "|---|---|---|---|---|---|"]
    lines += [f"| {x.dtype} | {x.against} | {x.positions} | {fmt(x.top1_rate * 100, '.1f')}% | "
              f"{'none' if x.first_divergence is None else x.first_divergence} | {fmt(x.max_margin, '.3f')} |"
              for x in r.rows]
    return lines + [""]
