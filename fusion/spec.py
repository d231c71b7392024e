"""The records of knowledge fusion: domains, the trainer interface, events and the result.

Stdlib only: the algorithm sees adapters as opaque states behind `Trainer`, so the real trainer
(PEFT LoRA + task heads) and the scripted fakes of the tests plug in the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

S = TypeVar("S")

ACTIONS = ("open", "fuse", "rollback", "alone_fails", "fuse_missed", "reject")


@dataclass(frozen=True)
class Domain:
    """One knowledge domain: a dataset of one task type and the accuracy an application needs."""

    name: str
    task: str  # head type: "classify", "count", "detect", "binary", "lm", ...
    requirement: float  # minimum accuracy in [0, 1] on this domain's evaluation split
    size: int = 0  # number of examples; the size_desc order tries big domains first

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Domain.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"Domain {self.name!r}: task must be a non-empty string, got {self.task!r}")
        req = self.requirement
        if isinstance(req, bool) or not isinstance(req, (int, float)) or not (0.0 <= req <= 1.0):
            raise ValueError(f"Domain {self.name!r}: requirement must be an accuracy in [0, 1], got {req!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"Domain {self.name!r}: size must be an int >= 0 (examples), got {self.size!r}")
        object.__setattr__(self, "requirement", float(req))

    def met_by(self, accuracy: float) -> bool:
        return accuracy >= self.requirement

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "task": self.task, "requirement": self.requirement, "size": self.size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Domain:
        return cls(d["name"], d["task"], d["requirement"], d.get("size", 0))


@runtime_checkable
class Trainer(Protocol[S]):
    """What fusion needs from training. S is an opaque adapter state (LoRA weights + heads).

    `train` must return a NEW state and leave its argument untouched: roll-back is then just
    keeping the previous state, with no copy or undo on the algorithm's side.

    Optionally, `baseline(state, domain) -> dict | None`: the domain's majority baseline on the
    same evaluation ({"answer", "accuracy", "better", ...}, train/baselines.py). With it, fusion
    accepts a domain only where its adapter beats that baseline (`below_baseline`).
    """

    def new_adapter(self, index: int) -> S: ...  # fresh LoRA, no heads

    def train(self, state: S, domain: Domain) -> S: ...  # trained further on domain, + its head

    def evaluate(self, state: S, domain: Domain) -> float: ...  # accuracy in [0, 1]

    def save(self, state: S, path: str) -> None: ...  # path: one file or directory, trainer-owned

    def load(self, path: str) -> S: ...


@dataclass(frozen=True)
class FusionEvent:
    """One decision. Every event but the final close is one train call plus its evaluations."""

    step: int  # 0-based; equals the number of train calls made before this one
    domain: str  # the domain that was trained
    adapter: int  # index of the adapter it was trained into (fuse_missed: the one it stays in instead)
    action: str  # one of ACTIONS
    accuracies: dict[str, float]  # every domain evaluated at this step
    violations: tuple[str, ...] = ()  # domains below their requirement or baseline (rollback, alone_fails, ...)
    baselines: dict[str, dict] = field(default_factory=dict)  # each evaluated domain's baseline verdict, if any

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"FusionEvent.action must be one of {ACTIONS}, got {self.action!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "domain": self.domain, "adapter": self.adapter, "action": self.action,
                "accuracies": dict(self.accuracies), "violations": list(self.violations),
                "baselines": dict(self.baselines)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FusionEvent:
        return cls(int(d["step"]), d["domain"], int(d["adapter"]), d["action"],
                   {k: float(v) for k, v in d["accuracies"].items()}, tuple(d.get("violations", ())),
                   dict(d.get("baselines") or {}))

    def __str__(self) -> str:
        accs = ", ".join(f"{k}={v:.3f}" for k, v in self.accuracies.items())
        if self.action == "reject":
            return f"step {self.step}: reject {self.domain} ({accs}): {baseline_reason(self.baselines[self.domain])}"
        why = f" below requirement: {', '.join(self.violations)}" if self.violations else ""
        return f"step {self.step}: {self.action} {self.domain} -> adapter {self.adapter} ({accs}){why}"


@dataclass
class FusedAdapter(Generic[S]):
    """A closed adapter: the domains fused into it and the accuracy it reaches on each."""

    index: int
    name: str
    domains: list[str]  # in the order they were fused
    accuracies: dict[str, float]  # measured on the final state of this adapter
    requirements: dict[str, float]
    met: bool  # False where a member misses its requirement (it missed alone too)
    state: S = field(repr=False)
    path: str | None = field(default=None, compare=False)  # checkpoint under workdir, if any
    baselines: dict[str, dict] = field(default_factory=dict)  # each member's baseline verdict, if the trainer gives one

    @property
    def unmet(self) -> list[str]:
        return [d for d in self.domains if self.accuracies[d] < self.requirements[d]]


@dataclass
class FusionResult(Generic[S]):
    adapters: list[FusedAdapter[S]]  # by index
    events: list[FusionEvent]
    order: list[Domain]  # the order the domains were tried in

    @property
    def num_adapters(self) -> int:
        return len(self.adapters)

    @property
    def all_met(self) -> bool:
        return all(a.met for a in self.adapters)

    @property
    def unmet(self) -> list[str]:
        """Domains kept (alone, flagged) although no adapter reaches their requirement."""
        return [d for a in self.adapters for d in a.unmet]

    @property
    def rejected(self) -> dict[str, str]:
        """Domains in no adapter, because even alone theirs was no better than their majority
        baseline -> why, in words."""
        return {e.domain: baseline_reason(e.baselines[e.domain]) for e in self.events if e.action == "reject"}

    def adapter_of(self, domain: str) -> FusedAdapter[S]:
        for a in self.adapters:
            if domain in a.domains:
                return a
        why = f": rejected, {self.rejected[domain]}" if domain in self.rejected else ""
        raise KeyError(f"domain {domain!r} is in no fused adapter{why} (have: {[d.name for d in self.order]})")

    def summary(self) -> str:
        lines = [f"{self.num_adapters} adapter(s) for {len(self.order)} domain(s)"]
        for a in self.adapters:
            accs = ", ".join(f"{d} {a.accuracies[d]:.3f}/{a.requirements[d]:.2f}" for d in a.domains)
            lines.append(f"  {a.name}: {accs}" + ("" if a.met else "  [REQUIREMENT NOT MET]"))
        lines += [f"  rejected {d}: {why}" for d, why in self.rejected.items()]
        return "\n".join(lines)


def check_accuracy(value: Any, domain: str) -> float:
    """A trainer's evaluation, checked: a NaN or a percentage would silently break the packing."""
    try:
        acc = float(value)
    except (TypeError, ValueError):
        acc = math.nan
    if not (0.0 <= acc <= 1.0):
        raise ValueError(f"trainer.evaluate returned {value!r} for domain {domain!r}; "
                         "expected an accuracy in [0, 1]")
    return acc


def below_baseline(verdict: dict | None) -> bool:
    """Whether a baseline verdict says the adapter is no better than always answering the majority
    (None: the trainer gives no baseline for the domain, e.g. detect's F1; nothing to refuse on)."""
    return verdict is not None and not verdict.get("better", True)


def baseline_reason(verdict: dict) -> str:
    """Why a domain was refused, in words, from its baseline verdict."""
    answer = verdict.get("answer")
    answer = repr(answer) if isinstance(answer, str) else answer
    p = verdict.get("p_value")
    return (f"no better than always answering {answer} ({float(verdict.get('accuracy', 0.0)):.3f}"
            + (f", one-sided p={p:.3g}" if isinstance(p, (int, float)) else "") + ")")
