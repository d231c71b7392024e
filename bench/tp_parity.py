"""Parity runs of the tensor-parallel benchmark (bench/tp.py): one sequence of greedy runs in every
LoRA mode, with mode switches between them, on one engine or a group; then each run compared with
the same run of a reference (bench/fp8_accuracy.compare_outputs: logits up to the first divergence,
token agreement, the reference's margin where the tokens part).

The sequence (labels are the report's `mode` column):

    unmerge                   adapters mixed with requests of no adapter (a, none, b, c, a, ...)
    mixture(a)                a merged, the others through LoRA, requests as above
    merge(a)                  a merged, every request on a
    unmerge after merge(a)    the switch back: the same requests as `unmerge`
    merge(b) after switch     another adapter merged after that (with two adapters or more)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from serve.engine import Request, SamplingParams
from serve.orchestrator import Mode

from .engine import _prompts
from .fp8_accuracy import _first_divergence, compare_outputs

ADAPTER_NAMES = ("a", "b", "c", "d")


def sequence(names: list[str]) -> list[tuple[str, Mode, str | None]]:
    """(label, mode, adapter of every request or None for the mix) in the order they run."""
    runs = [("unmerge", Mode.unmerge(), None), ("mixture(a)", Mode.mixture("a"), None),
            ("merge(a)", Mode.merge("a"), "a"), ("unmerge after merge(a)", Mode.unmerge(), None)]
    if len(names) > 1:
        runs.append(("merge(b) after switch", Mode.merge("b"), "b"))
    return runs


def mix(names: list[str], n: int) -> list[str | None]:
    """Request i's adapter: the adapters with none among them, in turn."""
    cycle = [names[0], None, *names[1:]]
    return [cycle[i % len(cycle)] for i in range(n)]


def run_sequence(engine, job, names: list[str], log) -> dict[str, list]:
    """label -> outputs (token_ids, host float32 logits [tokens, vocab]) of every run, in order;
    `engine` is an Engine or a LeaderEngine (each call then runs on every rank)."""
    params = SamplingParams(max_tokens=job.output_tokens, ignore_eos=True, keep_logits=True, detokenize=False)
    prompts = _prompts(job, engine.tokenizer, job.prompts, 0)
    out = {}
    for label, mode, only in sequence(names):
        engine.set_mode(mode)
        adapters = [only] * len(prompts) if only else mix(names, len(prompts))
        outs = engine.generate([Request(prompt=text, images=[image], sampling=params, adapter=adapter)
                                for (text, image), adapter in zip(prompts, adapters)])
        # kept on the host: several engines' vocabulary-wide logits
        out[label] = [SimpleNamespace(token_ids=list(o.token_ids), logits=torch.stack(o.logits).float().cpu())
                      for o in outs]
        log(f"  {label}: {len(outs)} requests, {sum(len(o.token_ids) for o in outs)} tokens")
    engine.set_mode(Mode.unmerge())
    return out


def divergences(ref: list, got: list) -> str:
    """'prompt@position (margin)' of every request whose tokens part, the reference's margin being
    its logit of its own token minus its logit of the other side's."""
    parts = []
    for i, (r, g) in enumerate(zip(ref, got)):
        first = _first_divergence(r.token_ids, g.token_ids)
        if first is not None:
            logits = r.logits[first]
            margin = (logits[r.token_ids[first]] - logits[g.token_ids[first]]).item()
            parts.append(f"p{i}@{first} ({margin:.3g})")
    return "; ".join(parts)


def parity_rows(ref: dict[str, list], got: dict[str, list], section: str, tp: int, against: str,
                dtype: str) -> list[dict]:
    """One row per label both sides ran."""
    return [dict(section=section, tp=tp, dtype=dtype, mode=label, against=against,
                 **compare_outputs(ref[label], got[label]), divergences=divergences(ref[label], got[label]))
            for label in ref if label in got]
