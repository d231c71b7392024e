"""`LoraTrainer`: the real trainer behind `fusion.fuse` (the `fusion.Trainer` protocol).

A state is an `AdapterState` (LoRA weights as CPU tensors, a head per domain, domain records).
`train(state, domain)` loads the state's LoRA into the one model this trainer holds, trains it
further on the domain's data together with a new head for that domain, and returns a NEW state;
the argument is never modified, so fusion's roll-back is just keeping the old state.

Training on the new domain alone moves the shared LoRA under the earlier domains' heads (paper,
Fig. 10), which is why fusion re-evaluates every member after each step. Two options keep what
was fused (`train/rehearsal.py`): `rehearsal` (the members' data interleaved with the new
domain's, a share of its size) and `refit_epochs` (every head, the new domain's too, re-trained on the
final LoRA's frozen features before the members are evaluated). Both 0: the domain is trained alone
and earlier heads are left as they were. With `cfg.calibrate_threshold`, every detect head trained
or re-fitted here then gets the score threshold with the best train F1 (`train/calibrate.py`).

Domains map to dataset directories by name: `<datasets_root>/<domain.name>/`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from .adapter_io import AdapterState, HeadState, load_adapter, save_adapter
from .baselines import baseline_note
from .calibrate import calibrate_threshold, describe
from .data import DomainData, load_domain
from .evaluate import at_default_note, evaluate
from .rehearsal import Part, refit_heads, rehearsal_parts, train_mixed
from .trainer import TrainConfig, head_config_for, train_adapter
from .vlm import VisionLM


def domain_record(data: DomainData, steps: int) -> dict:
    info = data.info
    return {"task": info.task, "labels": info.labels, "max_count": info.max_count, "max_boxes": info.max_boxes,
            "media": info.media, "question": info.question, "teacher": info.teacher, "dataset": str(data.path),
            "train_size": data.size("train"), "steps": steps}


def bad_epochs(epochs: dict) -> dict:
    """The entries of a domain -> epochs map that are not ints >= 1."""
    return {d: n for d, n in epochs.items() if isinstance(n, bool) or not isinstance(n, int) or n < 1}


class LoraTrainer:
    """fusion.Trainer over PEFT LoRA + task heads. `head_overrides`: conf/head-style options
    applied to every new head (e.g. {"pooling": "attention"}). `epochs`: domain -> epochs of
    its training when it joins or opens an adapter, for domains that need longer than cfg.epochs
    (a dense detection head, say); its members' rehearsal follows the same count."""

    def __init__(self, vlm: VisionLM, datasets_root: str | Path, cfg: TrainConfig,
                 head_overrides: dict | None = None, log=None, rehearsal: float = 0.0, refit_epochs: int = 0,
                 epochs: dict[str, int] | None = None, zero_shot=None):
        if rehearsal < 0 or isinstance(refit_epochs, bool) or not isinstance(refit_epochs, int) or refit_epochs < 0:
            raise ValueError(f"LoraTrainer: rehearsal ({rehearsal!r}) and refit_epochs ({refit_epochs!r}) "
                             "must be >= 0 (refit_epochs an int)")
        bad = bad_epochs(epochs or {})
        if bad:
            raise ValueError(f"LoraTrainer: epochs per domain must be ints >= 1, got {bad}")
        self.vlm, self.root, self.cfg = vlm, Path(datasets_root), cfg
        self.rehearsal, self.refit_epochs = float(rehearsal), refit_epochs
        self.epochs = dict(epochs or {})
        self.head_overrides = head_overrides or {}
        self.zero_shot = zero_shot  # train.zero_shot.ZeroShot: every evaluation beside the base's answers
        self.log = log or sys.stderr
        self._data: dict[str, DomainData] = {}
        self.train_calls = 0

    def dataset(self, name: str) -> DomainData:
        if name not in self._data:
            path = self.root / name
            if not path.is_dir():
                have = sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
                raise FileNotFoundError(f"no dataset for domain {name!r} at {path}; datasets there: {have}")
            self._data[name] = load_domain(path)
        return self._data[name]

    def _check_task(self, domain, data: DomainData) -> None:
        task = getattr(domain, "task", data.info.task)
        if task != data.info.task:
            raise ValueError(f"domain {data.name!r} is declared with task {task!r} but its dataset "
                             f"{data.path} holds task {data.info.task!r}")

    @property
    def settings(self) -> dict:
        """What decides how a state is trained beyond the domains (the fusion journal records it)."""
        return {"rehearsal": self.rehearsal, "refit_epochs": self.refit_epochs, **(
            {"epochs": dict(sorted(self.epochs.items()))} if self.epochs else {})}  # journals before it still resume

    # -- fusion.Trainer -----------------------------------------------------------------------
    def new_adapter(self, index: int) -> AdapterState:
        """A fresh LoRA (A seeded by the index, B = 0) and no heads."""
        self.vlm.reset_lora(self.cfg.seed * 1000 + index)
        return AdapterState(self.vlm.lora_state(), index=index)

    def train(self, state: AdapterState, domain) -> AdapterState:
        name = getattr(domain, "name", domain)
        data = self.dataset(name)
        self._check_task(domain, data)
        self.train_calls += 1
        self.vlm.load_lora_state(state.lora)  # copies into the model; state.lora stays as it was
        new = Part(data, self._head(state, name, data))
        # Members are the adapter's other domains, each with a copy of its head (the state keeps its
        # own); only rehearsal or a re-fit touches them, so without either none is built.
        members = [Part(self.dataset(m), state.heads[m].build(self.vlm.device) if m in state.heads else None)
                   for m in state.domains if m != name] if self.rehearsal > 0 or self.refit_epochs else []
        # calibration waits for the re-fit below, which changes the heads' scores
        cfg = replace(self.cfg, epochs=self.epochs.get(name, self.cfg.epochs), calibrate_threshold=False)
        if members and self.rehearsal > 0:
            lora, steps = train_mixed(self.vlm, rehearsal_parts(new, members, self.rehearsal), cfg, self.log)
        else:
            result = train_adapter(self.vlm, data, cfg, head=new.head, log=self.log, evaluate_at_end=False)
            lora, steps, new.head = result.lora, result.steps, result.head
        if self.refit_epochs:  # every head fitted to the final LoRA it will be evaluated with
            refit_heads(self.vlm, [new] + members, self.cfg, self.refit_epochs, self.log)
        if self.cfg.calibrate_threshold:
            for p in [new] + members:
                result = calibrate_threshold(self.vlm, p.head, p.data, batch_size=self.cfg.eval_batch_size)
                if result:
                    print(describe(p.data.name, result), file=self.log, flush=True)
        heads = dict(state.heads)
        heads.update({p.data.name: HeadState.of(p.head) for p in [new] + members if p.head is not None})
        domains = {d: dict(r) for d, r in state.domains.items() if d != name}
        domains[name] = domain_record(data, steps)
        return AdapterState(lora, heads, domains, {}, state.index)

    def _head(self, state: AdapterState, name: str, data: DomainData):
        """The domain's head to train: its own if the adapter was trained on it before, else a new one."""
        if data.info.task == "lm":
            return None
        if name in state.heads:
            return state.heads[name].build(self.vlm.device)
        from heads import build_head

        return build_head(head_config_for(data.info, self.vlm.hidden_size, self.head_overrides))

    def evaluate(self, state: AdapterState, domain) -> float:
        name = getattr(domain, "name", domain)
        if name in state.accuracies:  # these exact weights were evaluated on it already
            return float(state.accuracies[name]["accuracy"])
        data = self.dataset(name)
        if data.info.task != "lm" and name not in state.heads:
            raise ValueError(f"adapter has no head for domain {name!r} (it holds {sorted(state.heads)}); "
                             "train it on the domain first")
        self.vlm.load_lora_state(state.lora)
        head = state.heads[name].build(self.vlm.device) if name in state.heads else None
        metrics = evaluate(self.vlm, head, data, "eval", self.cfg.eval_batch_size, self.cfg.max_new_tokens,
                           zero_shot=self.zero_shot)
        state.accuracies[name] = metrics  # a memo of this state's score, not a change of its weights
        print(f"[fusion eval] {name}: {metrics['metric']} {metrics['accuracy']:.3f}{at_default_note(metrics)}"
              f"{baseline_note(metrics)}", file=self.log, flush=True)
        return float(metrics["accuracy"])

    def baseline(self, state: AdapterState, domain) -> dict | None:
        """The domain's majority baseline on the evaluation of `state` (train/baselines.py): fusion
        accepts the domain only where its adapter beats it. None for detect (F1, no share of items)."""
        name = getattr(domain, "name", domain)
        if "baseline" not in state.accuracies.get(name, {}):  # not evaluated, or recorded before baselines
            state.accuracies.pop(name, None)
        self.evaluate(state, domain)
        return state.accuracies[name]["baseline"]

    def save(self, state: AdapterState, path: str) -> None:
        save_adapter(self.vlm, state, path, extra_meta={"index": state.index})

    def load(self, path: str) -> AdapterState:
        return load_adapter(path)
