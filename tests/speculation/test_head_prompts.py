"""The draft head's training prompts: the first 766 never change (heads and their cached answers are keyed by
them), the list goes on well past ten times what a CPU run answers, any prefix is balanced by kind, asking for
more than there are is refused, and the comparison set is in no training run."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter

import pytest

from infemeral.speculation.head import prompts as head_prompts
from infemeral.speculation.head.prompts import chat_prompts, held_out_prompts
from infemeral.speculation.head.settings import TrainSettings, add_arguments

PLAIN = 766
PLAIN_SHA256 = "0bc4693cb9382ebed1c25afca90d470e13ad35b0442a5d8eaa81ba014d0ca1df"  # json.dumps of the 766, seed 0


def kind_of(prompt: str) -> int:
    """Which kind (template family) a training prompt is, by the template it was written from."""
    families = (head_prompts.EXPLAIN, head_prompts.HOW_TO, head_prompts.TIPS, head_prompts.CREATIVE,
                head_prompts.COMPARE, head_prompts.FACTS, head_prompts.PROS_CONS, head_prompts.CODE,
                head_prompts.WRITE, head_prompts.PLAN)
    for n, templates in enumerate(families):
        for template in templates:
            head, _, tail = template.partition("{}")
            if prompt.startswith(head) and tail.split("{}")[-1] in prompt:
                return n
    raise AssertionError(f"no kind for {prompt!r}")


def test_the_first_766_are_the_prompts_heads_were_trained_on():
    plain = chat_prompts(PLAIN)
    assert hashlib.sha256(json.dumps(plain).encode()).hexdigest() == PLAIN_SHA256
    assert chat_prompts()[:PLAIN] == plain and chat_prompts(528) == plain[:528]


def test_there_are_ten_times_a_cpu_runs_prompts_all_distinct():
    prompts = chat_prompts()
    assert len(prompts) >= 6200 and len(set(prompts)) == len(prompts)
    assert len(prompts) >= 10 * (TrainSettings().prompts + TrainSettings().held_out)


def test_any_prefix_of_the_styled_prompts_holds_every_kind_in_proportion():
    styled = chat_prompts()[PLAIN:]
    totals = Counter(kind_of(p) for p in styled)
    assert len(totals) == 10
    seen: Counter = Counter()
    for n, prompt in enumerate(styled, 1):
        seen[kind_of(prompt)] += 1
        if n % 97 == 0 or n == len(styled):
            for kind, total in totals.items():
                assert abs(seen[kind] - n * total / len(styled)) <= 2, (n, kind)
    for style in head_prompts.STYLES:  # each plain prompt comes back with every style once
        assert sorted(p.removesuffix(" " + style) for p in styled if p.endswith(" " + style)) \
            == sorted(chat_prompts(PLAIN))


def test_asking_for_more_prompts_than_there_are_is_refused_naming_how_many():
    there_are = len(chat_prompts())
    assert len(chat_prompts(there_are)) == there_are
    with pytest.raises(ValueError, match=f"there are {there_are}"):
        chat_prompts(there_are + 1)


def test_train_drafter_refuses_too_many_prompts_before_loading_anything(monkeypatch):
    from infemeral.speculation.head import train

    def no_training(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(train, "train_drafter", no_training)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    most = len(chat_prompts()) - TrainSettings().held_out
    with pytest.raises(ValueError, match=f"at most --prompts {most}"):
        train.run(parser.parse_args(["--output", "head", "--device", "cpu", "--prompts", str(most + 1)]))
    train.check_arguments(parser.parse_args(["--output", "head", "--device", "cpu", "--prompts", str(most)]))


def test_the_comparison_set_is_in_no_training_run_and_covers_every_kind():
    held = held_out_prompts()
    assert len(held) == len(set(held)) == 20
    assert not set(held) & set(chat_prompts())
    assert Counter(kind_of(p) for p in held) == {n: 2 for n in range(10)}
    subjects = [s for _, items in head_prompts.HELD_OUT_ITEMS for item in items
                for s in (item if isinstance(item, tuple) else (item,))]
    training = " ".join(chat_prompts(PLAIN))
    assert not [s for s in subjects if f" {s} " in training or f" {s}." in training or f" {s}?" in training]
