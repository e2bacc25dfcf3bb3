"""A draft head's training answers from the pod, for a model too big for the laptop (`train-drafter --server`).

The split system answers the training prompts as it answers a chat: the laptop's half and the served layers,
each prompt a turn of a session of its own, `in_flight` of them at once so that the pod batches them. The
head's features are what a session already hands its draft sources (`Speculator.observed`): the server's
residual un-rotated and through the final norm, the LM head's input — the quantity the local path
(`speculation/head/data.py`) keeps. A `FeatureRecorder` stands where a draft head would and keeps them.
Training turns are never committed: the pod keeps nothing of them once their streams close, so there is no
sealed cache to write and no session to delete afterwards.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from infemeral.client.sampling import SamplingParams
from infemeral.client.turn import TurnLoop


class FeatureRecorder:
    """A draft source that drafts nothing and keeps every verified feature a turn observes: the prompt's (all of
    them: `prompt_features`) and each answer token's but the last, which is never run. Each session records
    through its own `fork()`."""

    name = "head"
    is_free = True
    prompt_features = 1 << 62  # every prompt position's

    def __init__(self):
        self.ids: list[int] = []
        self._rows: list[torch.Tensor] = []
        self._length = 0  # positions recorded

    def fork(self) -> "FeatureRecorder":
        return FeatureRecorder()

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        return []

    def observe(self, context_ids: Sequence[int], features: torch.Tensor) -> None:
        """`features` [n, d] of the last n positions of `context_ids`."""
        start = len(context_ids) - features.shape[0]
        if start > self._length:
            raise RuntimeError(f"features of positions {self._length} to {start} were never observed")
        if start < self._length:  # positions given again (after a rewind): the new ones hold
            self._rows = [self.features[:start]]
        self._rows.append(features.detach().float().cpu().clone())
        self._length = len(context_ids)
        self.ids = list(context_ids)

    @property
    def features(self) -> torch.Tensor:
        """[len(ids), d]."""
        if len(self._rows) > 1:
            self._rows = [torch.cat(self._rows)]
        return self._rows[0]


class PodAnswers:
    """The training prompts answered greedily through `client` (its own: its draft head becomes the recorder),
    `in_flight` turns at once; an `Answers` of `speculation/head/data.py`."""

    def __init__(self, client, in_flight: int = 8):
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, not {in_flight}")
        self.client, self.in_flight = client, in_flight
        client.draft_head = FeatureRecorder()
        info = client.server_info()
        self.description = (f"pod {client.bundle.server_fingerprint} serving {info.dtype}, wire "
                            f"{client.wire_mode}, laptop half {client.model.dtype}")

    @property
    def eos_ids(self) -> set[int]:
        return set(self.client.eos_ids)

    def chat_ids(self, prompt: str) -> list[int]:
        return self.client.chat_ids([{"role": "user", "content": prompt}])

    def answer(self, prompts: list[list[int]], max_new_tokens: int, keep, progress: bool = True) -> None:
        """Each prompt's conversation to `keep` (`data.Keep`) as its turn ends, on this thread: one writer. A
        turn's features reach it through a queue and nothing else holds them (a future would, until the last
        one is done), so memory holds the turns in flight, not the answers."""
        from tqdm import tqdm

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, speculate="head", max_draft=0)
        ended: queue.SimpleQueue = queue.SimpleQueue()

        def answer_one(i: int) -> None:
            try:
                ended.put((i, self._answer_one(prompts[i], params), None))
            except BaseException as e:  # raised on the writer's thread
                ended.put((i, None, e))

        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="answer") as pool, \
                tqdm(total=len(prompts), desc="answering", unit="answer", disable=not progress) as bar:
            turns = [pool.submit(answer_one, i) for i in range(len(prompts))]
            try:
                for _ in prompts:
                    i, conversation, error = ended.get()
                    if error is not None:
                        raise error
                    keep(i, *conversation)
                    del conversation
                    bar.update()
            except BaseException:
                for turn in turns:
                    turn.cancel()
                raise

    def _answer_one(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], torch.Tensor]:
        """One prompt's turn (a pod at its limits is asked again as `open_turn` does, within the client's
        timeout); the recorded ids and features. Left uncommitted: the pod drops the turn."""
        session = self.client.new_session()
        with TurnLoop(session, [], params, render=lambda _: prompt_ids, is_whole_transcript=True) as turn:
            for _ in turn.generate():
                pass
            recorder = turn.speculator.sources[0]
            return recorder.ids, recorder.features

    def target_weights(self) -> tuple[object, torch.Tensor, torch.Tensor]:
        """The laptop half's config, embedding and LM head in float32: what the head reads and trains against."""
        model = self.client.model
        embed = model.embed.dense()
        return model.config, embed, embed if model.head is model.embed else model.head.dense()
