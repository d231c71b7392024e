"""Which adapter, head and output mode serve a task: the fusion manifest's choice, narrowed to
what the server can do.

    manifest entry with a head, adapter served  -> that adapter, output_mode "head"
    adapter served but no head (or heads off)   -> that adapter, output_mode "generate"
    no manifest / nothing accurate enough /
    no domain answering the request's question /
    adapter not on the server                   -> the base model, "generate" (answers parsed)

A domain's head answers the one question its items asked (the manifest records it), so a task
type matches only the domains whose question is the request's: "How many vehicles are there?"
never reaches the head of "How many cars are there?".

A route also degrades at run time: a head request the server rejects falls back to generation
with the same adapter, and a rejected adapter to the base model (`Route.degrade`); each step
is counted as a mode switch in the stream's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from adapters.manifest import domains_for, select_adapter
from adapters.sources import read_sources

from .baselines import NOT_RECORDED, baseline_text, domain_record, expected_text, no_better, recorded_baselines

HEAD_MODES = ("auto", "never", "always")


@dataclass(frozen=True)
class ServerCaps:
    """What the server offers: the adapters it serves now."""

    adapters: frozenset[str] = frozenset()

    @classmethod
    def probe(cls, client) -> "ServerCaps":
        names = set()
        for entry in client.list_adapters():  # names, or dicts that carry one
            name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, dict) else None
            if name:
                names.add(name)
        return cls(frozenset(names))


@dataclass(frozen=True)
class Route:
    key: str  # what was looked up in the manifest (domain or task type)
    adapter: str | None  # what the requests name; None = base model
    head: str | None
    output_mode: str  # "head" | "generate"
    selected: str | None = None  # the manifest's choice, even when the server cannot serve it
    expected_accuracy: float | None = None  # the manifest's accuracy for the selection
    reason: str = ""
    # what the selected domain was trained on ("image" | "clip"; None: unknown or the base model): a
    # video app sends an image domain one frame of its chunk, as the head saw in training
    media: str | None = None
    domain: str | None = None  # the manifest domain selected
    question: str | None = None  # the one question that domain's items asked (its head answers it)
    labels: tuple[str, ...] = ()  # a classify / binary domain's labels (meta.json): what its text answers name
    # the selection's recorded baselines (apps.common.baselines): name -> {"accuracy", ...}; {} = none recorded
    baselines: dict = field(default_factory=dict)
    via: str = ""  # why the app looked up this key (e.g. "question matches domain digits"); "" = the task's own

    @property
    def no_better(self) -> bool:
        """The selected adapter is no better than its majority baseline (as its training recorded)."""
        return self.selected is not None and no_better(self.expected_accuracy, self.baselines)

    def accuracy_text(self) -> str:
        """"expected 0.438 against majority always '2' 0.438: NO BETTER (p=1)"; "" without a selection."""
        return expected_text(self.expected_accuracy, self.baselines) if self.selected else ""

    def cell(self) -> str:
        """The report's route column: where it went, and why the app looked there when it chose."""
        return f"{self.adapter or 'base'}/{self.output_mode}" + (f" ({self.via})" if self.via else "")

    def degrade(self, why: str) -> "Route | None":
        """The next fallback after the server refused this route, or None at the base model."""
        if self.output_mode == "head":
            return replace(self, output_mode="generate", head=None, reason=f"head refused ({why}): generate")
        if self.adapter is not None:
            return replace(self, adapter=None, media=None, reason=f"adapter {self.adapter} refused ({why}): base model")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "adapter": self.adapter, "head": self.head, "output_mode": self.output_mode,
                "selected": self.selected, "expected_accuracy": self.expected_accuracy,
                "baseline": baseline_text(self.expected_accuracy, self.baselines) if self.selected else None,
                "baselines": dict(self.baselines), "no_better": self.no_better, "reason": self.reason,
                "media": self.media, "domain": self.domain, "question": self.question, "labels": list(self.labels),
                "via": self.via}


def route_cell(route: dict[str, Any]) -> str:
    """`Route.cell` of a route as a report holds it (`Route.to_dict`)."""
    return f"{route.get('adapter') or 'base'}/{route.get('output_mode')}" + (f" ({route['via']})" if route.get("via") else "")


def route_worth(route: dict[str, Any]) -> str:
    """A reported route's expected accuracy beside its recorded baseline, "" when it selected
    nothing: "expected 0.438; majority baseline always '2' 0.438: adapter NO BETTER (p=1)"."""
    if not route.get("selected") or route.get("expected_accuracy") is None:
        return ""
    return f"expected {route['expected_accuracy']:.3f}; {route.get('baseline') or NOT_RECORDED}"


def load_manifest(path) -> dict[str, Any] | None:
    """One routing view of `path`: a fusion manifest (file or folder), a single adapter directory
    (`vlora train`'s: its meta.json's domains become a one-adapter manifest) or a list of these
    (adapters.read_sources; clashing adapter names are refused). None when nothing is there yet."""
    return read_sources(path).manifest


def resolve_route(key: str, accuracy_target: float, manifest: dict[str, Any] | None, caps: ServerCaps,
                  heads: str = "auto", load: Callable[[str, str], None] | None = None,
                  question: str | None = None) -> Route:
    """The route of one task. `load(name, path)`, when given, asks the server to load a selected
    adapter it does not serve yet (an error from it means: use the base model).
    heads: "auto" (head mode when the selection has a head and its adapter is served), "never",
    or "always" (head mode even without a manifest head, e.g. to exercise the fallback).
    question: what the requests ask; when `key` is a task type, only domains that answer it
    qualify (a head trained to count cars is not asked how many vehicles there are)."""
    if heads not in HEAD_MODES:
        raise ValueError(f"heads must be one of {HEAD_MODES}, got {heads!r}")
    base = Route(key, None, None, "head" if heads == "always" else "generate")
    if manifest is None:
        return replace(base, reason="no fusion manifest: base model")
    try:
        sel = select_adapter(manifest, key, accuracy_target, question)
    except KeyError:
        return replace(base, reason=f"the manifest knows no domain or task {key!r}: base model")
    missed = _missed(manifest, key, question)
    if sel is None:
        other = _other_questions(manifest, key, question)
        if other:
            return replace(base, reason=f"no domain of {key!r} answers {question!r} (they answer {other}): base model")
        return replace(base, reason=f"no adapter reaches accuracy {accuracy_target} on {key!r}"
                                    + (f" and meets its requirement ({missed} skipped)" if missed else "")
                                    + ": base model")
    skipped = f"; {missed} skipped" if missed else ""
    record = domain_record(sel.path, sel.domain)  # meta.json: the baselines and labels training recorded
    question = manifest["tasks"].get(sel.domain, {}).get("question") or record.get("question")
    labels = tuple(str(v) for v in record.get("labels") or ())
    picked = replace(base, selected=sel.adapter, expected_accuracy=sel.accuracy, domain=sel.domain,
                     question=question, labels=labels, baselines=recorded_baselines(record))
    worth = baseline_text(sel.accuracy, picked.baselines)  # beside the accuracy: what it is worth
    if sel.adapter not in caps.adapters:
        if load is None:
            return replace(picked, reason=f"adapter {sel.adapter} ({sel.domain}) is not served: base model")
        try:
            load(sel.adapter, sel.path)
        except Exception as e:  # unsupported engine, missing files: the base model still answers
            return replace(picked, reason=f"adapter {sel.adapter} ({sel.domain}) could not be loaded ({e}): base model")
    use_head = heads == "always" or (heads == "auto" and bool(sel.head))
    return replace(picked, adapter=sel.adapter, head=sel.head if use_head else None, media=sel.media,
                   output_mode="head" if use_head else "generate",
                   reason=f"manifest: {sel.adapter} ({sel.domain}, accuracy {sel.accuracy}){skipped}; {worth}")


def _other_questions(manifest: dict[str, Any], key: str, question: str | None) -> str:
    """When no domain of task type `key` answers `question`: the questions its domains do answer."""
    tasks = manifest["tasks"]
    if question is None or key in tasks or domains_for(manifest, key, question):
        return ""
    return ", ".join(sorted({repr(t.get("question")) for t in tasks.values() if t["task"] == key}))


def _missed(manifest: dict[str, Any], key: str, question: str | None = None) -> str:
    """The manifest entries for `key` that miss their requirement (select_adapter skips them), for
    the route's reason: "fused_4 on exists_bicycle misses its requirement (0.64 < 0.7)"."""
    tasks = manifest["tasks"]
    domains = domains_for(manifest, key, question)
    return ", ".join(f"{tasks[d]['adapter']} on {d} misses its requirement "
                     f"({tasks[d]['accuracy']} < {tasks[d]['requirement']})"
                     for d in domains if tasks[d]["met"] is False)
