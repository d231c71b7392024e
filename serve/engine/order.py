"""Who comes first among sequences: the scheduler's policies (no torch here)."""

from __future__ import annotations

from .sequence import Sequence


class SchedulingPolicy:
    """Priority order of sequences: the first is served first and preempted last. (The
    orchestrator's policies, serve.orchestrator, decide modes and admission above this order.)"""

    name = "base"

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        raise NotImplementedError


class ArrivalOrder(SchedulingPolicy):
    name = "fcfs"

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=lambda s: (s.arrival_time, s.seq_id))


class FairShare(SchedulingPolicy):
    """Owners take turns: each owner's sequences keep their arrival order, and the k-th of every
    owner comes before the (k+1)-th of any (ties by arrival). One client's backlog of hundreds
    therefore waits behind another client's single request instead of ahead of it; with one owner
    (or none set) this is arrival order."""

    name = "fair"

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        turn: dict[str | None, int] = {}
        keyed = []
        for seq in sorted(seqs, key=lambda s: (s.arrival_time, s.seq_id)):
            k = turn.get(seq.owner, 0)
            turn[seq.owner] = k + 1
            keyed.append((k, seq.arrival_time, seq.seq_id, seq))
        return [item[-1] for item in sorted(keyed, key=lambda item: item[:3])]


def fair_interleave(request_ids: list[str], owner_of) -> list[str]:
    """`request_ids` (an order decided elsewhere, e.g. by an orchestrator policy) with owners
    taking turns: each owner's ids keep their relative order."""
    turn: dict = {}
    keyed = []
    for i, rid in enumerate(request_ids):
        owner = owner_of(rid)
        k = turn.get(owner, 0)
        turn[owner] = k + 1
        keyed.append((k, i, rid))
    return [rid for _, _, rid in sorted(keyed)]
