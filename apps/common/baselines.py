"""What a routed adapter's expected accuracy is worth: the baselines its training recorded.

`vlora train` writes, per domain of an adapter's meta.json, the majority baseline of its eval score
(train/baselines.py: {"answer", "accuracy", "n", "wins", "losses", "p_value", "better", ...}) under
`baseline` (or `baselines.majority`); the base model's zero-shot score on the same items may sit
beside it under `baselines.zero_shot` (absent or null where it was not measured). A route carries them, so that every place that shows an expected accuracy
shows what always answering the most common label scores beside it, and flags an adapter that is no
better:

    expected 0.438; majority baseline always '2' 0.438: adapter NO BETTER (p=1)
    expected 0.910; baseline: not recorded

Only the adapter's own files are read (meta.json beside its weights): no torch, no server.
"""

from __future__ import annotations

from typing import Any

from adapters.meta import read_meta

NOT_RECORDED = "baseline: not recorded"
# the baselines of `baselines.<name>` shown beside the majority's (teacher_vs_truth, also recorded
# there, is the labels' quality, no score an adapter must beat)
OTHERS = ("zero_shot",)


def _accuracy(record: Any) -> float | None:
    if isinstance(record, dict):
        record = record.get("accuracy")
    ok = isinstance(record, (int, float)) and not isinstance(record, bool)
    return float(record) if ok else None


def recorded_baselines(record: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """name -> baseline record of one meta.json domain entry ("majority" first); {} when none is
    recorded (an adapter trained before baselines, a detect domain, a PEFT directory without meta)."""
    if not isinstance(record, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    if isinstance(record.get("baseline"), dict):
        out["majority"] = record["baseline"]
    others = record.get("baselines") if isinstance(record.get("baselines"), dict) else {}
    if isinstance(others.get("majority"), dict) and "majority" not in out:
        out["majority"] = others["majority"]
    for name in OTHERS:
        value = others.get(name)
        if isinstance(value, (dict, int, float)) and not isinstance(value, bool):
            out[name] = value if isinstance(value, dict) else {"accuracy": value}
    return {name: b for name, b in out.items() if _accuracy(b) is not None}


def domain_record(adapter_path: str | None, domain: str | None) -> dict[str, Any]:
    """The meta.json entry of `domain` in the adapter directory at `adapter_path`; {} when the
    directory, its meta.json or the domain is missing or unreadable (routing still works)."""
    if not adapter_path or not domain:
        return {}
    try:
        meta = read_meta(adapter_path, required=False)
    except (OSError, ValueError):
        return {}
    domains = meta.get("domains")
    entry = domains.get(domain) if isinstance(domains, dict) else None
    return entry if isinstance(entry, dict) else {}


def no_better(expected: float | None, baselines: dict[str, dict[str, Any]]) -> bool:
    """Whether the adapter is no better than its majority baseline: the recorded paired test's
    verdict where there is one (`better`), else its expected accuracy not above the baseline's."""
    majority = baselines.get("majority")
    if not majority:
        return False
    if isinstance(majority.get("better"), bool):
        return not majority["better"]
    return expected is not None and expected <= (_accuracy(majority) or 0.0)


def _answer(record: dict[str, Any]) -> str:
    answer = record.get("answer")
    if answer is None:
        return ""
    return f"always {answer!r} " if isinstance(answer, str) else f"always {answer} "


def baseline_text(expected: float | None, baselines: dict[str, dict[str, Any]]) -> str:
    """"majority baseline always '2' 0.438: adapter NO BETTER (p=1)", with any other recorded
    baseline after it; "baseline: not recorded" when the adapter's meta.json records none."""
    if not baselines:
        return NOT_RECORDED
    parts = []
    for name, record in baselines.items():
        text = f"{name} baseline {_answer(record)}{_accuracy(record):.3f}"
        if name == "majority":
            p = record.get("p_value")
            flag = "NO BETTER" if no_better(expected, baselines) else "better"
            text += f": adapter {flag}" + (f" (p={p:.3g})" if isinstance(p, (int, float)) else "")
        parts.append(text)
    return ", ".join(parts)


def expected_text(expected: float | None, baselines: dict[str, dict[str, Any]]) -> str:
    """An expected accuracy with its baseline beside it, for logs and reports; "" without one."""
    if expected is None:
        return ""
    return f"expected {expected:.3f}; {baseline_text(expected, baselines)}"
