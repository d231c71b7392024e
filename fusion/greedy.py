"""Accuracy-aware knowledge fusion (V-LoRA §4.2.1): greedy packing of domains into adapters.

Packing domains into the fewest adapters that keep every domain above its requirement is a
constrained bin packing whose "weights" (accuracy after fusion) are only known by training, so
the paper's heuristic is greedy with roll-back:

    for d in order(domains):
        S' = train(S, d)                        # S: current adapter's last good state
        if every domain fused so far, and d, meets its requirement on S':  S = S'       (fuse)
        else:  close the adapter with S (roll-back), S = train(new_adapter(), d)  (rollback, open)

Roll-back costs nothing because `Trainer.train` returns a new state and never touches S.

A domain that misses its requirement even alone on a fresh adapter is never dropped; where it
goes depends on `place_missed`:
- "alone" (the paper): it keeps an adapter of its own, flagged `met=False` (event "alone_fails").
- "best" (default): if it was the only domain below its requirement in the adapter it was rolled
  back from, and it scored there at least as high as alone, that joined state is kept instead (event
  "fuse_missed"): the adapter it would have had to itself buys nothing. Its accuracy alone then
  becomes its floor in that adapter: a later domain that pushes it below that floor rolls back,
  as one that pushes a member below its requirement does. Otherwise it keeps its own adapter.
Either way the adapter that was rolled back for it did not lose it to a capacity limit, so that
adapter is reopened and keeps taking domains instead of being closed for nothing.

Where the trainer gives a majority baseline per evaluation (`Trainer.baseline`), a domain holds
only if its adapter beats that baseline too (by the trainer's confidence test, not a point
comparison): a score no better than always answering the most common training label is no
knowledge, whatever the requirement. Fusing a domain that leaves itself or a member at its
baseline rolls back like a missed requirement; a domain at its baseline even alone is refused
(event "reject"): it gets no adapter, so no route serves it as if it had learned something,
and the adapter rolled back for it is reopened.
"""

from __future__ import annotations

import os
import random
from typing import Callable, Iterable

from .journal import Journal, OpenAdapter, Progress, adapter_name
from .spec import Domain, FusedAdapter, FusionEvent, FusionResult, Trainer, below_baseline, check_accuracy

ORDERS = ("size_desc", "given", "seeded")
PLACE_MISSED = ("best", "alone")


def order_domains(domains: Iterable[Domain], order: str = "size_desc", seed: int = 0) -> list[Domain]:
    """The order domains are tried in.

    size_desc: largest first, ties by name (big datasets shape the shared LoRA first);
    given: as passed; seeded: `random.Random(seed)` shuffle of the name-sorted domains, so it
    depends on the seed and the set of domains, not on the order they were passed in.
    """
    domains = list(domains)
    for d in domains:
        if not isinstance(d, Domain):
            raise TypeError(f"fuse: domains must be fusion.Domain, got {type(d).__name__}: {d!r}")
    if not domains:
        raise ValueError("fuse: no domains given")
    names = [d.name for d in domains]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"fuse: domain names must be unique, repeated: {dupes}")
    if order == "size_desc":
        return sorted(domains, key=lambda d: (-d.size, d.name))
    if order == "given":
        return domains
    if order == "seeded":
        shuffled = sorted(domains, key=lambda d: d.name)
        random.Random(seed).shuffle(shuffled)
        return shuffled
    raise ValueError(f"fuse: order must be one of {ORDERS}, got {order!r}")


def _check_trainer(trainer: object, need_io: bool) -> None:
    needed = ["new_adapter", "train", "evaluate"] + (["save", "load"] if need_io else [])
    missing = [m for m in needed if not callable(getattr(trainer, m, None))]
    if missing:
        why = " (save/load are needed because a workdir was given)" if need_io else ""
        raise TypeError(f"fuse: trainer {type(trainer).__name__} lacks {missing}{why}")


def fuse(
    domains: Iterable[Domain],
    trainer: Trainer,
    order: str = "size_desc",
    seed: int = 0,
    workdir: str | os.PathLike | None = None,
    progress: Callable[[FusionEvent], None] | None = None,
    place_missed: str = "best",
    refuse_at_baseline: bool = True,
) -> FusionResult:
    """Pack `domains` into the fewest adapters meeting every requirement (greedy, with roll-back).

    With `workdir`, each step is journaled with the trainer's checkpoints, and a later call with
    the same domains, order and workdir continues from there without training finished steps
    again (a finished journal just returns its result). `progress` gets each new event.
    place_missed: where a domain that misses its requirement even alone goes (module docstring).
    refuse_at_baseline: a domain must beat its majority baseline where the trainer gives one
    (module docstring); False accepts it anyway, its verdict still recorded for the reports.
    """
    if place_missed not in PLACE_MISSED:
        raise ValueError(f"fuse: place_missed must be one of {PLACE_MISSED}, got {place_missed!r}")
    ordered = order_domains(domains, order, seed)
    _check_trainer(trainer, need_io=workdir is not None)
    check = refuse_at_baseline and callable(getattr(trainer, "baseline", None))
    journal = Journal(workdir, ordered, order, seed, trainer, place_missed, check) if workdir is not None else None
    run = (journal.resume() if journal else None) or Progress()
    by_name = {d.name: d for d in ordered}
    while not run.done:
        event = None
        if run.pos < len(ordered):
            event = _step(run, ordered[run.pos], trainer, by_name, place_missed == "best", check)
        else:  # every domain placed: the open adapter is final
            if run.current is not None:
                run.closed.append(run.current.closed(by_name))
            run.current, run.done = None, True
        if journal is not None:
            journal.commit(run)
        if event is not None and progress is not None:
            progress(event)
    return FusionResult(sorted(run.closed, key=lambda a: a.index), list(run.events), ordered)


def _evaluate(trainer: Trainer, state: object, domain: Domain) -> float:
    return check_accuracy(trainer.evaluate(state, domain), domain.name)


def _baselines(trainer: Trainer, state: object, domains: list[Domain]) -> dict[str, dict]:
    """Each domain's baseline verdict on `state`, where the trainer gives one (after `_evaluate`)."""
    baseline = getattr(trainer, "baseline", None)
    if not callable(baseline):
        return {}
    verdicts = {d.name: baseline(state, d) for d in domains}
    return {name: dict(v) for name, v in verdicts.items() if v is not None}


def _step(run: Progress, domain: Domain, trainer: Trainer, by_name: dict[str, Domain],
          keep_joined: bool = True, check: bool = True) -> FusionEvent:
    """One train call and its evaluations; updates `run` in place and returns the decision.
    check: a domain at its majority baseline does not hold (refuse_at_baseline)."""
    def below(bases: dict[str, dict], name: str) -> bool:
        return check and below_baseline(bases.get(name))

    step, name, cur = len(run.events), domain.name, run.current
    if cur is None:
        index = run.next_index
        run.next_index += 1
        state = trainer.train(trainer.new_adapter(index), domain)
        accs = {name: _evaluate(trainer, state, domain)}
        bases = _baselines(trainer, state, [domain])
        run.pos += 1
        joined, run.joined = run.joined, None
        learned = not below(bases, name)
        if learned and domain.met_by(accs[name]):
            if run.parked is not None:  # its violator fits alone, so the rolled-back adapter is done
                run.closed.append(run.parked.closed(by_name))
            run.current, run.parked = OpenAdapter(index, [name], accs, state, baselines=bases), None
            return _log(run, FusionEvent(step, name, index, "open", accs, baselines=bases))
        if (joined is not None and joined.accuracies[name] >= accs[name]
                and not below(joined.baselines, name)):
            # missed alone too, and did no worse beside the members: no adapter of its own
            run.next_index -= 1  # the fresh adapter is dropped, its index unused
            joined.floors[name] = accs[name]
            run.current, run.parked = joined, None
            return _log(run, FusionEvent(step, name, joined.index, "fuse_missed", accs, (name,), bases))
        if not learned:  # no better than its majority answer even alone: no adapter serves it
            run.next_index -= 1
            run.current, run.parked = run.parked, None
            return _log(run, FusionEvent(step, name, index, "reject", accs, (name,), bases))
        run.closed.append(FusedAdapter(index, adapter_name(index), [name], accs, {name: domain.requirement},
                                       False, state, baselines=bases))
        run.current, run.parked = run.parked, None
        return _log(run, FusionEvent(step, name, index, "alone_fails", accs, (name,), bases))

    state = trainer.train(cur.state, domain)
    members = [*cur.domains, name]
    # Every member is evaluated again: fusing d can cost accuracy on an earlier domain (Fig. 10).
    accs = {m: _evaluate(trainer, state, by_name[m]) for m in members}
    bases = _baselines(trainer, state, [by_name[m] for m in members])
    violations = tuple(m for m in members if not cur.holds(by_name[m], accs[m]) or below(bases, m))
    if not violations:
        run.current = OpenAdapter(cur.index, members, accs, state, floors=dict(cur.floors), baselines=bases)
        run.pos += 1
        return _log(run, FusionEvent(step, name, cur.index, "fuse", accs, baselines=bases))
    # Roll back: `cur` (the pre-d state) is parked; pos stays on d, so the next step trains d
    # alone on a fresh adapter. Where d was the only one below, the joined state is kept too,
    # in case d misses alone as well (keep_joined: place_missed="best").
    run.current, run.parked = None, cur
    if keep_joined and violations == (name,):
        run.joined = OpenAdapter(cur.index, members, accs, state, floors=dict(cur.floors), baselines=bases)
    return _log(run, FusionEvent(step, name, cur.index, "rollback", accs, violations, bases))


def _log(run: Progress, event: FusionEvent) -> FusionEvent:
    run.events.append(event)
    return event
