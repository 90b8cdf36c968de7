"""What speculation did, for /stats: verify steps, rounds, tokens proposed and accepted, acceptance by position."""
from __future__ import annotations

from collections import Counter


class SpecStats:
    """Rounds (a row speculating in a verify step), tokens proposed and accepted, and how often the proposal at
    each position was accepted. Recorded by the OutputProcessor as it applies each verify step."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens
        self.rounds = 0
        self.proposed = 0
        self.accepted = 0
        self.accepted_at: Counter = Counter()       # position (1-based) -> rounds that accepted it
        self.verify_steps = 0
        self.other_branch_rounds = 0                # token trees: rounds that kept a path off the first branch

    def record(self, proposed: int, accepted: int, other_branch: bool = False) -> None:
        self.rounds += 1
        self.other_branch_rounds += other_branch
        self.proposed += proposed
        self.accepted += accepted
        for j in range(1, accepted + 1):
            self.accepted_at[j] += 1

    def as_dict(self) -> dict:
        rounds = max(self.rounds, 1)
        return {
            "verify_steps": self.verify_steps,
            "rounds": self.rounds,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "other_branch_rounds": self.other_branch_rounds,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            # tokens a speculating row gained per verify step: its accepted proposals plus the target's own
            "mean_tokens_per_round": round((self.accepted + self.rounds) / rounds, 4) if self.rounds else None,
            "acceptance_by_position": {str(j): round(self.accepted_at[j] / rounds, 4)
                                       for j in range(1, self.num_tokens + 1)} if self.rounds else {},
        }
