"""What one turn did, for display and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TurnResult:
    """What one turn did; token counts and timings only, for display and benchmarks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # sampled ids, stays on the client
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str = ""  # "eos", "stop", "length" or "context"
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0
    version: int = 0
    cache_length: int = 0
    truncated_tokens: int = 0
    evicted_tokens: int = 0  # tokens the sliding window dropped during this turn
    round_trips: int = 0     # steps that produced tokens: the prompt's last step and every decode step
    drafted_tokens: int = 0  # drafts sent for verification (speculative decoding)
    accepted_drafts: int = 0  # drafts the model agreed with: tokens that cost no round trip of their own

    def add_step(self, num_drafted: int, num_accepted: int) -> None:
        """A decode step: one round trip that verified `num_drafted` drafts and kept `num_accepted`."""
        self.round_trips += 1
        self.drafted_tokens += num_drafted
        self.accepted_drafts += num_accepted

    @property
    def tokens_per_second(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_round_trip(self) -> float:
        """1.0 without speculation; more when drafts are accepted. The end-of-sequence token counts: its round trip
        brought it back like any other, though the answer leaves it out (else a short answer reads as 0.9)."""
        returned = self.generated_tokens + (self.finish_reason == "eos")
        return returned / self.round_trips if self.round_trips else 0.0
