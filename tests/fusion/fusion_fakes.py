"""A scripted trainer for fusion tests: the adapter state is the tuple of domains trained into it.

`evaluate` looks accuracies up in a script (members: frozenset of domain names, domain) -> acc,
so each test states exactly how fusing knowledge interferes. The trainer counts train calls
and records every state it was given and returned, to check roll-back and resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fusion import Domain

Script = Callable[[frozenset, str], float]


class Interrupted(RuntimeError):
    """Stands in for a crash (preemption, OOM) in the middle of a fusion."""


@dataclass(frozen=True)
class FakeState:
    adapter: int
    domains: tuple[str, ...] = ()  # in training order; immutable, so train cannot mutate it


class ScriptedTrainer:
    def __init__(self, script: Script, fail_on_train: int | None = None, fail_on_save: int | None = None):
        self.script = script
        self.fail_on_train, self.fail_on_save = fail_on_train, fail_on_save
        self.train_calls = self.save_calls = 0
        self.trained_from: list[FakeState] = []  # the state each train call started from
        self.returned: list[FakeState] = []  # what each train call gave back

    def new_adapter(self, index: int) -> FakeState:
        return FakeState(index)

    def train(self, state: FakeState, domain: Domain) -> FakeState:
        self.train_calls += 1
        if self.train_calls == self.fail_on_train:
            raise Interrupted(f"train call {self.train_calls}")
        self.trained_from.append(state)
        self.returned.append(FakeState(state.adapter, state.domains + (domain.name,)))
        return self.returned[-1]

    def evaluate(self, state: FakeState, domain: Domain) -> float:
        return self.script(frozenset(state.domains), domain.name)

    def save(self, state: FakeState, path: str) -> None:
        self.save_calls += 1
        if self.save_calls == self.fail_on_save:
            Path(path).write_text("{half written")  # a crash mid-save leaves a broken file behind
            raise Interrupted(f"save call {self.save_calls}")
        Path(path).write_text(json.dumps({"adapter": state.adapter, "domains": list(state.domains)}))

    def load(self, path: str) -> FakeState:
        d = json.loads(Path(path).read_text())
        return FakeState(d["adapter"], tuple(d["domains"]))


# Figure 10 of the paper: six one-class detectors. Fusing vegetation into the adapter holding
# plate, sign and car drops plate below 80% and sign below 85%.
FIG10 = [Domain("plate", "detect", 0.80, 600), Domain("sign", "detect", 0.85, 500),
         Domain("car", "detect", 0.70, 400), Domain("vegetation", "detect", 0.70, 300),
         Domain("bicycle", "detect", 0.70, 200), Domain("person", "detect", 0.70, 100)]


def fig10_script(members: frozenset, domain: str) -> float:
    if "vegetation" in members and domain in ("plate", "sign"):
        return {"plate": 0.74, "sign": 0.79}[domain]
    return 0.9


def domains(*names: str, requirement: float = 0.8, task: str = "classify") -> list[Domain]:
    """Domains of decreasing size in the order named, so size_desc keeps that order."""
    return [Domain(n, task, requirement, 100 * (len(names) - i)) for i, n in enumerate(names)]
