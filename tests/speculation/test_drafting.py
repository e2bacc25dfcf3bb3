"""Draft sources: prompt lookup over the conversation, the answer index over earlier answers."""

from __future__ import annotations

import logging
import random
import stat
import threading

import numpy as np
import pytest

from infemeral.files import TEMP_PREFIX
from infemeral.speculation.answer_index import AnswerIndex, forget_answers
from infemeral.speculation.matching import SEPARATOR, suffix_matches
from infemeral.speculation.prompt_lookup import PromptLookup
from infemeral.speculation.source import DraftSource, FirstOf


def test_prompt_lookup_copies_what_followed_the_last_tokens():
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    context = [1, 2] + passage + [3, 4] + passage[:3]  # the answer has started to copy the passage
    assert PromptLookup().propose(context, 4) == [13, 14, 15, 16]
    assert PromptLookup().propose(context, 10) == [13, 14, 15, 16, 17, 3, 4, 10, 11, 12]
    assert PromptLookup().propose(context, 0) == []


def test_prompt_lookup_needs_min_match_tokens():
    context = [5, 6, 7, 8, 9, 1, 7]  # only the last token (7) occurred before
    assert PromptLookup(min_match=2).propose(context, 3) == []
    assert PromptLookup(min_match=1).propose(context, 3) == [8, 9, 1]
    assert PromptLookup().propose([], 3) == [] and PromptLookup().propose([4], 3) == []


def test_prompt_lookup_prefers_the_longest_match():
    # "8 2 3" was followed by 50 51, "9 2 3" by 60 61; the context ends with "9 2 3".
    context = [8, 2, 3, 50, 51, 0, 9, 2, 3, 60, 61, 0, 7, 9, 2, 3]
    assert PromptLookup().propose(context, 2) == [60, 61]
    # With only "2 3" to go on, both continuations match; the tie goes to the most recent.
    assert PromptLookup(max_match=2).propose(context[:-3] + [2, 3], 2) == [60, 61]


def test_prompt_lookup_follows_the_majority_and_stops_where_matches_disagree():
    context = [0, 1, 2, 40, 41, 0, 1, 2, 40, 41, 0, 1, 2, 30, 31, 0, 1, 2]
    assert PromptLookup().propose(context, 2) == [40, 41]  # two of three matches go on with 40 41
    # After "0 1 2" both matches go on with 40, then part ways (6 or 7): half the support each.
    split = [1, 2, 40, 5, 0, 1, 2, 40, 6, 0, 1, 2, 40, 7, 0, 1, 2]
    assert PromptLookup(min_support=0.6).propose(split, 3) == [40]
    assert PromptLookup(min_support=0.5).propose(split, 3) == [40, 7, 0]  # a tie goes to the most recent


def test_suffix_matches_reports_positions_and_length():
    corpus = np.array([4, 5, 6, 4, 5, 7, 5, 6])
    ends, length = suffix_matches(corpus, np.array([9, 4, 5]), min_match=1, max_match=3, limit=10)
    assert length == 2 and ends.tolist() == [1, 4]
    ends, length = suffix_matches(corpus, np.array([5]), min_match=1, max_match=3, limit=1)
    assert ends.tolist() == [6]  # only the most recent, and never the last position (nothing follows it)
    assert suffix_matches(corpus, np.array([8, 9]), min_match=1, max_match=3, limit=10)[1] == 0


def test_sources_share_one_interface():
    for source in (PromptLookup(), AnswerIndex(), FirstOf(PromptLookup(), AnswerIndex())):
        assert isinstance(source, DraftSource)
        assert source.is_free


def test_answer_index_drafts_from_earlier_answers(tmp_path):
    index = AnswerIndex(tmp_path / "answers.tokens")
    assert index.propose([1, 2, 3], 4) == []
    index.add([100, 101, 102, 103, 104, 105])
    index.add([7, 8, 9])
    # A new conversation whose answer starts like an earlier one: the rest of that answer is drafted,
    # and the draft stops at the end of that answer (never running into the next one).
    assert index.propose([55, 56, 100, 101, 102], 8) == [103, 104, 105]
    assert index.propose([1, 7, 8, 9], 8) == []  # nothing followed that answer
    assert index.propose([3, 101, 102], 8) == []  # shorter than min_match=3


def test_answer_index_is_an_owner_only_file_and_survives_a_restart(tmp_path):
    path = tmp_path / "index" / "answers.tokens"
    index = AnswerIndex(path)
    index.add([100, 101, 102, 103, 104])
    index.add([200, 201, 202, 203])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = AnswerIndex(path)
    assert again.num_tokens == 9
    assert again.propose([100, 101, 102], 2) == [103, 104]
    again.clear()
    assert not path.exists() and again.propose([100, 101, 102], 2) == []
    assert AnswerIndex(path).num_tokens == 0


def test_answer_index_is_bounded_dropping_the_oldest_answers(tmp_path):
    path = tmp_path / "answers.tokens"
    index = AnswerIndex(path, max_tokens=12)
    index.add([1, 2, 3, 4, 5])        # 6 with the separator
    index.add([11, 12, 13, 14, 15])   # 12
    assert index.num_tokens == 10
    index.add([21, 22, 23])           # 16 > 12: the first answer goes, whole
    assert index.num_tokens == 8
    assert index.propose([1, 2, 3], 2) == []
    assert index.propose([11, 12, 13], 2) == [14, 15]
    assert AnswerIndex(path, max_tokens=12).corpus.tolist() == index.corpus.tolist()
    # The file is appended to, and rewritten only once it has grown to twice the bound.
    assert path.stat().st_size == 4 * 16
    index.add([31, 32, 33, 34, 35, 36, 37, 38, 39])  # 26 > 24: rewritten with what the index keeps
    assert index.corpus.tolist() == [31, 32, 33, 34, 35, 36, 37, 38, 39, -1]
    assert path.stat().st_size == 4 * len(index.corpus)
    assert AnswerIndex(path, max_tokens=12).corpus.tolist() == index.corpus.tolist()
    assert [p.name for p in tmp_path.iterdir()] == ["answers.tokens"]  # no temporary file left behind


def test_answer_index_file_is_per_tokenizer(tmp_path):
    class Vocab:
        def __init__(self, words):
            self.words = words
            self.special_tokens_map = {"eos_token": "</s>"}

        def get_vocab(self):
            return {w: i for i, w in enumerate(self.words)}

    a = AnswerIndex.for_tokenizer(tmp_path, Vocab(["a", "b", "</s>"]))
    b = AnswerIndex.for_tokenizer(tmp_path, Vocab(["b", "a", "</s>"]))
    assert a.path.parent == b.path.parent == tmp_path and a.path != b.path
    assert AnswerIndex.for_tokenizer(tmp_path, Vocab(["a", "b", "</s>"])).path == a.path


def test_first_of_uses_the_first_source_that_drafts(tmp_path):
    index = AnswerIndex()
    index.add([1, 2, 3, 90, 91])
    both = FirstOf(PromptLookup(), index)
    assert both.name == "ngram+answers"
    assert both.propose([1, 2, 3], 2) == [90, 91]  # the conversation has nothing, the index has
    assert both.propose([1, 2, 3, 80, 81, 1, 2, 3], 2) == [80, 81]  # the conversation comes first


def test_answer_index_takes_concurrent_adds_once_full(tmp_path):
    """1,200 adds from 8 threads to a full index: nothing raises, and the index (in memory and reloaded
    from its file) holds whole answers only, the newest ones, each exactly as added."""
    path = tmp_path / "answers.tokens"
    index = AnswerIndex(path, max_tokens=2_000, vocab_size=50_000)
    rng = random.Random(0)
    while len(index.corpus) < index.max_tokens - 50:  # full: every add below drops old answers
        index.add([rng.randrange(50_000) for _ in range(40)])
    answers = {}
    for t in range(8):
        for i in range(150):
            answers[(t, i)] = [7, t, i] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
    errors, start = [], threading.Barrier(8)

    def add(t: int) -> None:
        try:
            start.wait()
            for i in range(150):
                index.add(answers[(t, i)])
                index.propose([7, t, i], 4)  # readers run alongside
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=add, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]

    def whole_answers(corpus) -> list[list[int]]:
        assert corpus[-1] == SEPARATOR and len(corpus) <= index.max_tokens
        cuts = np.flatnonzero(corpus == SEPARATOR)
        return [corpus[a + 1:b].tolist() for a, b in zip([-1, *cuts[:-1]], cuts)]

    kept = whole_answers(index.corpus)
    assert len(kept) > 50 and all(answers[tuple(a[1:3])] == a for a in kept)
    last = {}  # each thread's answers appear in the order it added them, up to its last one
    for a in kept:
        assert last.get(a[1], -1) < a[2]
        last[a[1]] = a[2]
    assert all(i == 149 for i in last.values())
    assert AnswerIndex(path, max_tokens=2_000, vocab_size=50_000).corpus.tolist() == index.corpus.tolist()
    assert [p.name for p in tmp_path.iterdir()] == ["answers.tokens"]


def test_a_damaged_answer_index_file_is_cut_back_to_its_last_whole_answer(tmp_path, caplog):
    path = tmp_path / "answers.tokens"
    index = AnswerIndex(path, vocab_size=1_000)
    index.add([100, 101, 102, 103])
    index.add([200, 201, 202])
    good = path.read_bytes()
    cases = {
        "torn append": good + np.array([300, 301], dtype="<i4").tobytes()[:6],  # half an id
        "unended answer": good + np.array([300, 301], dtype="<i4").tobytes(),
        "out of vocabulary": good + np.array([300, 5_000, SEPARATOR], dtype="<i4").tobytes(),
        "negative id": good + np.array([-7, SEPARATOR], dtype="<i4").tobytes(),
    }
    for name, data in cases.items():
        path.write_bytes(data)
        with caplog.at_level(logging.WARNING, logger="infemeral.speculation.answer_index"):
            loaded = AnswerIndex(path, vocab_size=1_000)
        assert loaded.corpus.tolist() == [100, 101, 102, 103, SEPARATOR, 200, 201, 202, SEPARATOR], name
        assert "was damaged" in caplog.text, name
        assert path.read_bytes() == good, name  # cut back, so later appends do not follow the damage
        caplog.clear()
        loaded.add([400, 401])
        assert AnswerIndex(path, vocab_size=1_000).corpus.tolist()[-3:] == [400, 401, SEPARATOR]
    path.write_bytes(b"\x01\x02\x03")  # not an index at all
    assert AnswerIndex(path, vocab_size=1_000).corpus.tolist() == [] and path.read_bytes() == b""


def test_answer_index_clears_under_threads_and_can_start_again(tmp_path):
    path = tmp_path / "answers.tokens"
    index = AnswerIndex(path)
    index.add([1, 2, 3, 4])
    index.clear()
    index.clear()  # nothing left to remove: still fine
    assert not path.exists() and index.num_tokens == 0
    index.add([5, 6, 7])
    assert AnswerIndex(path).corpus.tolist() == [5, 6, 7, SEPARATOR]


def test_an_index_file_removed_from_outside_is_not_brought_back(tmp_path):
    """A file deleted by hand while an endpoint holds the index: it drafts no more from it, and its next
    answer does not write the deleted ones back."""
    path = tmp_path / "answers.tokens"
    index = AnswerIndex(path)
    index.add([1, 2, 3, 4])
    path.unlink()
    assert index.propose([1, 2, 3], 2) == []
    index.add([5, 6, 7])
    assert index.corpus.tolist() == [5, 6, 7, SEPARATOR]
    assert AnswerIndex(path).corpus.tolist() == [5, 6, 7, SEPARATOR]


FORGOTTEN = [[100, 101, 102, 103, 104], [200, 201, 202, 203]]


@pytest.mark.parametrize("forget", ["forget-answers", "clear"])
@pytest.mark.parametrize("next_write", ["append", "rewrite"])
def test_forgotten_answers_stay_forgotten_in_another_process_that_held_them(tmp_path, forget, next_write):
    """A `serve` (index a) keeps answers in memory; `forget-answers` (or another holder's clear) forgets
    them, and another process writes a new answer. a must not draft from the forgotten answers, nor write
    them back with its next answer: appended, or (a file grown to twice max_tokens) the file rewritten."""
    path = tmp_path / "answers.tokens"
    if next_write == "rewrite":  # older answers in the file: with a's, 23 entries, one answer short of 24
        older = AnswerIndex(path)
        for i in range(3):
            older.add([50 + i] * 3)
    a = AnswerIndex(path, max_tokens=12)
    for answer in FORGOTTEN:
        a.add(answer)
    assert a.propose([100, 101, 102], 2) == [103, 104]
    if forget == "clear":
        AnswerIndex(path).clear()
    else:
        assert forget_answers(tmp_path) == 1
    AnswerIndex(path).add([7, 8, 9])  # another process answers: the file is there again
    assert a.propose([100, 101, 102], 2) == [] and a.propose([200, 201, 202], 2) == []
    a.add([300, 301, 302, 303, 304])
    a.add([400, 401, 402])
    fresh = AnswerIndex(path, max_tokens=12)
    assert not set(fresh.corpus.tolist()) & {t for answer in FORGOTTEN for t in answer}
    assert fresh.propose([300, 301, 302], 2) == [303, 304] and a.propose([300, 301, 302], 2) == [303, 304]
    assert a.corpus.tolist() == fresh.corpus.tolist()  # a holds what the file holds


def test_forget_answers_forgets_every_index_file_and_the_leftovers_of_a_rewrite(tmp_path):
    first, second = AnswerIndex(tmp_path / "a.tokens"), AnswerIndex(tmp_path / "b.tokens")
    first.add([1, 2, 3, 4])
    second.add([5, 6, 7, 8])
    (tmp_path / f"{TEMP_PREFIX}a.tokens.x1y2").write_bytes(np.array([1, 2, SEPARATOR], dtype="<i4").tobytes())
    assert forget_answers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forgotten"]
    assert first.propose([1, 2, 3], 2) == [] and second.propose([5, 6, 7], 2) == []
    assert forget_answers(tmp_path / "never-made") == 0 and not (tmp_path / "never-made").exists()


def test_an_id_equal_to_the_vocabulary_size_is_cut_from_the_index(tmp_path):
    path = tmp_path / "answers.tokens"
    kept = [10, 998, 999, SEPARATOR]  # 999: the last id of a vocabulary of 1,000
    path.write_bytes(np.array(kept + [20, 1_000, SEPARATOR], dtype="<i4").tobytes())
    assert AnswerIndex(path, vocab_size=1_000).corpus.tolist() == kept
    assert path.read_bytes() == np.array(kept, dtype="<i4").tobytes()


def test_a_bound_that_falls_exactly_on_an_answer_boundary_keeps_the_answer_after_it(tmp_path):
    """max_tokens entries end exactly at the start of an answer: that answer is kept whole, and nothing older."""
    index = AnswerIndex(tmp_path / "answers.tokens", max_tokens=8)
    index.add([1, 2, 3])
    index.add([4, 5, 6])
    index.add([7, 8, 9])  # 12 entries; the last 8 are the last two answers
    assert index.corpus.tolist() == [4, 5, 6, SEPARATOR, 7, 8, 9, SEPARATOR]
    index.add([10, 11, 12])  # 12 again, cut at the boundary before [7, 8, 9]
    assert index.corpus.tolist() == [7, 8, 9, SEPARATOR, 10, 11, 12, SEPARATOR]


def test_the_forget_answers_command_forgets_in_a_running_holder_too(tmp_path, capsys):
    from infemeral.cli.main import main

    serving = AnswerIndex(tmp_path / "answers.tokens")
    serving.add(FORGOTTEN[0])
    assert main(["forget-answers", "--answer-index-dir", str(tmp_path)]) == 0
    assert f"forgot 1 answer index file(s) in {tmp_path}" in capsys.readouterr().out
    AnswerIndex(tmp_path / "answers.tokens").add([7, 8, 9])  # another process answers
    assert serving.propose(FORGOTTEN[0][:3], 2) == []


def test_an_index_that_cannot_tell_whether_it_was_forgotten_drafts_nothing(tmp_path, monkeypatch):
    from infemeral.speculation import answer_index

    index = AnswerIndex(tmp_path / "answers.tokens")
    index.add(FORGOTTEN[0])

    def unreadable(directory):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(answer_index, "_forget_mark", unreadable)
    assert index.propose(FORGOTTEN[0][:3], 2) == []  # and the turn goes on
    monkeypatch.undo()
    assert index.propose(FORGOTTEN[0][:3], 2) == FORGOTTEN[0][3:]
