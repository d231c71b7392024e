"""Which manifest key a retrieval query is routed by, and why.

A question that a manifest domain's items asked (its recorded question, up to case, spacing and
the closing punctuation) goes to that domain, whatever kind its wording suggests: "Which digit is
this?" reads as qa, but the `digits` classify domain asked it, so its adapter and head answer it
and its answer is scored as a label. Domains of these task types are matched so:

    classify -> query kind classify (an explicitly given color or direction kind keeps its own)
    count    -> count
    binary   -> exists

A query whose kind was given explicitly is matched only by a domain whose head answers that kind
(a caption request is never answered by a count head). Every other query goes by its kind through
`routes` (kind -> domain or task type): where that names a domain of these task types
(`routes.qa=digits`), the query is asked as that domain's kind, with its head; where it names a task
type whose domains each record the one question they answer, queries of one kind and question
share a route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.manifest import same_question

# manifest task type -> the query kind its head answers (what a guessed kind becomes)
DOMAIN_KINDS = {"classify": "classify", "count": "count", "binary": "exists"}
# query kinds a domain of each task type may answer when the kind is given explicitly
SERVES = {"classify": ("classify", "color", "direction"), "count": ("count",), "binary": ("exists",)}
# kinds answered in text: their domains are lm domains, which carry no task head
GENERATED = ("caption", "qa")


class RouteRefused(Exception):
    """A query that its route cannot answer as configured (heads=always without a head)."""


@dataclass(frozen=True)
class Plan:
    name: str  # queries with one name share a route: "count", or "<kind>: <question>"
    kind: str  # the kind the query is answered and scored as
    key: str  # the manifest domain or task type looked up
    question: str | None  # what routing matches domains' questions against (None: any domain of `key`)
    generated: bool  # answered in text whatever `heads` says: captions, QA, lm domains
    via: str  # why this key, for the report's route column


def matching_domains(manifest: dict[str, Any] | None, question: str, kind: str | None = None) -> list[str]:
    """The domains (of the task types in DOMAIN_KINDS) whose recorded question is `question`; given
    `kind` (an explicit query kind), only those whose head answers it."""
    tasks = (manifest or {}).get("tasks") or {}
    return [d for d, t in tasks.items()
            if t.get("task") in DOMAIN_KINDS and t.get("question") and same_question(t["question"], question)
            and (kind is None or kind in SERVES[t["task"]])]


def _spoken(question: str) -> str:
    return " ".join(question.split())


def plan_query(query, routes: dict[str, str], manifest: dict[str, Any] | None) -> Plan:
    """The route plan of one query (queries.Query) under `routes` (kind -> domain or task type)."""
    tasks = (manifest or {}).get("tasks") or {}
    domains = matching_domains(manifest, query.question, None if query.guessed else query.kind)
    if domains:
        task = tasks[domains[0]]["task"]
        kind = DOMAIN_KINDS[task] if query.guessed else query.kind
        return Plan(f"{kind}: {_spoken(query.question)}", kind, task, query.question, False,
                    f"question matches domain {', '.join(domains)}")
    key = routes[query.kind]
    via = f"routes.{query.kind}={key}"
    if tasks.get(key, {}).get("task") in DOMAIN_KINDS:  # `routes` names a domain with a head: asked as its kind
        task = tasks[key]["task"]
        kind = query.kind if query.kind in SERVES[task] else DOMAIN_KINDS[task]
        return Plan(query.kind if kind == query.kind else f"{kind}: {via}", kind, key, None, False, via)
    lm = (tasks[key].get("task") if key in tasks else key) == "lm"
    generated = query.kind in GENERATED or lm
    if not generated and key not in tasks and any(t.get("question") for t in tasks.values() if t["task"] == key):
        # the task type's heads each answer one question: this one's domain, if any, serves it
        return Plan(f"{query.kind}: {_spoken(query.question)}", query.kind, key, query.question, False, via)
    return Plan(query.kind, query.kind, key, None, generated, via)


def always_refusal(route, plan: Plan) -> str | None:
    """Why heads=always cannot answer on `route` (apps.common.routing.Route), or None when a head
    answers; captions and QA, whose lm domains carry no head, are generated in every mode."""
    if (route.output_mode == "head" and route.head) or plan.generated:
        return None
    return f"heads=always: no task head serves this query ({route.reason})"
