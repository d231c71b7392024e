"""`vlora fusion`: pack the distilled knowledge domains into the fewest adapters that still meet
every domain's accuracy requirement (greedy, with roll-back), then export the adapters and
`manifest.json` to ${fusion.out_dir}.

    vlora fusion                                        # the default domains and requirements
    vlora fusion fusion.domains.count_vehicles=0.9 "fusion.only=[count_vehicles,color_main]"
    vlora fusion "fusion.only={direction: 0.6}" fusion.out_dir=.vlora/adapters/direction   # a new domain alone

`fusion.only` picks domains by name from fusion.domains, or, as a mapping name -> requirement,
names the domains and their requirements itself, new ones included (so adding a domain is one
override: `fusion.domains` is a struct node that only `+fusion.domains.X=...` could extend).
A requirement is a score, or `{of_teacher: f}`: f times the teacher's agreement with the truth
that the domain's dataset records (`teacher_vs_truth` in domain.json), so one setting reads "as
good as 0.9x the teacher" on any seed's data.

Adapters are named `<fusion.name>_<i>` (default: the out_dir's folder name), so the manifests of
different runs can be served together.

Resumable: each step is journaled under ${fusion.out_dir}/work, so a rerun continues where an
interrupted one stopped and a finished one returns at once.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..config import to_dataclass
from .table import format_table
from .train import model_ref, split_train_node, zero_shot_baseline


@dataclass
class FusionJob:
    domains: dict
    only: list | dict | None = None  # fuse just these domains: names of `domains`, or name -> requirement
    order: str = "size_desc"
    place_missed: str = "best"  # a domain that misses alone too: "best" placement or "alone" (fusion.greedy)
    accept_at_baseline: bool = False  # accept a domain no better than its majority baseline (flagged, not refused)
    seed: int = 0
    datasets_dir: str = ".vlora/datasets"
    out_dir: str = ".vlora/adapters/fused"
    resume: bool = True
    name: str | None = None  # adapter names are <name>_<index>; None: out_dir's folder name
    rehearsal: float = 0.0  # members' rows interleaved per epoch when a domain joins, x its train size
    refit_head_epochs: int = 0  # epochs re-fitting every member's head on the joined adapter
    epochs: dict | None = None  # domain -> training epochs when it joins an adapter (others: train.epochs)

    def selected(self) -> dict:
        """domain -> requirement of the domains to fuse, in the order given."""
        if isinstance(self.only, dict):
            return {d: r if r is not None else self.domains.get(d) for d, r in self.only.items()}
        unknown = sorted(set(self.only or ()) - set(self.domains))
        if unknown:
            raise ValueError(f"fusion.only names {unknown}, which are not in fusion.domains {sorted(self.domains)}; "
                             "give new domains with their requirement: fusion.only={name: requirement}")
        return {d: r for d, r in self.domains.items() if self.only is None or d in self.only}


def resolve_requirement(name: str, value, datasets_dir: str) -> float:
    """A requirement as a score: a number as is, {of_teacher: f} as f x the teacher's agreement."""
    from train.data import teacher_agreement

    if not isinstance(value, dict):
        return float(value)
    if set(value) != {"of_teacher"} or not isinstance(value["of_teacher"], (int, float)):
        raise ValueError(f"requirement of {name!r} is {value}: give a score, or {{of_teacher: <factor>}}")
    agreement = teacher_agreement(Path(datasets_dir) / name)
    if agreement is None:
        raise ValueError(f"requirement of {name!r} is {value}, but {Path(datasets_dir) / name / 'domain.json'} "
                         "records no teacher-vs-truth agreement (distill it first, from a source with ground truth)")
    return float(value["of_teacher"]) * float(agreement)


def build_trainer(cfg: DictConfig, datasets_dir: str, log=None, rehearsal: float = 0.0, refit_epochs: int = 0,
                  epochs: dict | None = None):
    """The model (world-pretrained unless train.base=model) and the LoRA trainer over it
    (`rehearsal`, `refit_epochs`: how a joining domain keeps the members; `epochs`: per domain;
    see LoraTrainer)."""
    from train import LoraSpec, LoraTrainer, VisionLM

    job, tcfg = split_train_node(cfg.train)
    tcfg.seed = cfg.seed
    ref = model_ref(cfg, job, log=log)
    vlm = VisionLM(ref, to_dataclass(LoraSpec, cfg.adapter), job.train_vision_tower, job.mixed_precision,
                   job.device, seed=cfg.seed, gradient_checkpointing=job.gradient_checkpointing)
    return LoraTrainer(vlm, datasets_dir, tcfg, log=log, rehearsal=rehearsal, refit_epochs=refit_epochs,
                       epochs=epochs, zero_shot=zero_shot_baseline(job, log)), ref


def domains_of(requirements: dict[str, float], trainer) -> list:
    """The fusion domains of `requirements` (name -> score, resolved), sized from their datasets."""
    from fusion import Domain

    out = []
    for name, requirement in requirements.items():
        data = trainer.dataset(name)
        # sized by the items the teacher labelled, so augmenting a domain does not move it in the order
        out.append(Domain(name, data.info.task, requirement, data.distinct_train))
    return out


def print_event(event) -> None:
    from fusion.spec import baseline_reason, below_baseline

    accs = ", ".join(f"{k} {v:.2f}" for k, v in event.accuracies.items())
    if event.action == "reject":  # one line: the domain, its score, why it gets no adapter
        print(f"[fusion step {event.step}] reject      {event.domain}: {accs}, "
              f"{baseline_reason(event.baselines[event.domain])}: no adapter serves it", file=sys.stderr, flush=True)
        return
    below = [d for d in event.violations if below_baseline(event.baselines.get(d))]
    why = "; ".join(([f"below requirement: {', '.join(d for d in event.violations if d not in below)}"]
                     if set(event.violations) - set(below) else [])
                    + [f"{d} {baseline_reason(event.baselines[d])}" for d in below])
    print(f"[fusion step {event.step}] {event.action:<11} {event.domain} -> adapter {event.adapter}: {accs}"
          + (f" ({why})" if why else ""), file=sys.stderr, flush=True)


def member_metrics(adapter, domain: str) -> dict:
    """The evaluation a fused adapter's state records for a member (LoraTrainer's memo: score,
    majority and zero-shot verdicts); {} for states that keep none (scripted trainers)."""
    return dict((getattr(adapter.state, "accuracies", None) or {}).get(domain) or {})


def result_lines(result) -> list[str]:
    """The fused adapters, each domain's score beside its requirement, its majority baseline and
    the base model's zero-shot score (train/baselines.py), one line per domain fusion refused for
    being no better than its majority, and one per member no better than the base zero-shot."""
    from train.baselines import baseline_cell, zero_shot_cell, zero_shot_line

    def score(a, d: str) -> str:
        base = baseline_cell(a.baselines.get(d))
        metrics = member_metrics(a, d)
        shot = f"zero-shot {zero_shot_cell(metrics)}" if metrics else None
        teacher = (metrics.get("baselines") or {}).get("teacher_vs_truth")
        teacher = None if teacher is None else f"teacher vs truth {teacher:.2f}"
        extra = "; ".join(x for x in (base, shot, teacher) if x)
        return f"{d} {a.accuracies[d]:.2f} (>= {a.requirements[d]:.2f}" + (f"; {extra})" if extra else ")")

    rows = [{"adapter": a.name, "domains": " + ".join(a.domains),
             "accuracies": ", ".join(score(a, d) for d in a.domains), "met": a.met} for a in result.adapters]
    lines = [format_table(rows)] if rows else []
    lines += [f"REJECTED: {d}, {why}: no adapter serves it" for d, why in result.rejected.items()]
    flags = [zero_shot_line(f"{d} on {a.name}", member_metrics(a, d)) for a in result.adapters for d in a.domains
             if member_metrics(a, d)]
    return lines + [f for f in flags if f]


def run_fusion(cfg: DictConfig, log=None) -> dict:
    from adapters.base import base_identity
    from fusion import export_adapters, fuse, read_manifest

    job = to_dataclass(FusionJob, OmegaConf.to_container(cfg.fusion, resolve=True))
    out = Path(job.out_dir)
    work = out / "work"
    if not job.resume and work.exists():
        shutil.rmtree(work)
    try:  # before the model is built
        missing = [d for d, r in job.selected().items() if r is None]
    except ValueError as e:
        raise SystemExit(f"vlora fusion: {e}") from None
    if missing:
        raise SystemExit(f"vlora fusion: fusion.only names {missing} without a requirement and fusion.domains has "
                         f"none for them; give one: fusion.only={{{missing[0]}: 0.5}}")
    try:  # relative requirements read the datasets' records, also before the model is built
        requirements = {name: resolve_requirement(name, value, job.datasets_dir)
                        for name, value in job.selected().items()}
    except (ValueError, OSError) as e:
        raise SystemExit(f"vlora fusion: {e}") from None
    start = time.perf_counter()
    if job.rehearsal < 0 or job.refit_head_epochs < 0:
        raise SystemExit(f"vlora fusion: fusion.rehearsal ({job.rehearsal}) and fusion.refit_head_epochs "
                         f"({job.refit_head_epochs}) must be >= 0")
    epochs = job.epochs or {}
    from train.fusion_trainer import bad_epochs

    bad = {**bad_epochs(epochs), **{d: n for d, n in epochs.items() if d not in requirements}}
    if bad:
        raise SystemExit(f"vlora fusion: fusion.epochs {bad}: each must name a fused domain "
                         f"({sorted(requirements)}) with an int >= 1")
    trainer, ref = build_trainer(cfg, job.datasets_dir, log or sys.stderr, job.rehearsal, job.refit_head_epochs,
                                 epochs)
    domains = domains_of(requirements, trainer)
    try:
        result = fuse(domains, trainer, order=job.order, seed=job.seed, workdir=work, progress=print_event,
                      place_missed=job.place_missed, refuse_at_baseline=not job.accept_at_baseline)
    except ValueError as e:
        if "journal" in str(e):  # the domains or their requirements changed since the interrupted run
            raise SystemExit(f"vlora fusion: {e}\nrun with fusion.resume=false to start over, or with "
                             f"fusion.out_dir=<another folder> to keep {out} as it is") from None
        raise
    base = base_identity(ref.path, ref.name, arch=trainer.vlm.arch)  # the server loads this base for them
    questions = {d.name: trainer.dataset(d.name).info.question for d in result.order}
    media = {d.name: trainer.dataset(d.name).info.media for d in result.order}
    manifest_path = export_adapters(result, trainer, out, run=job.name,
                                    extra={"model": ref.name, "model_path": str(ref.path), "base": base,
                                           # why a domain has no route: what a reader of the manifest asks
                                           "rejected": result.rejected},
                                    questions=questions, media=media)
    manifest = read_manifest(manifest_path)
    names = {e["index"]: e["name"] for e in manifest["adapters"]}
    seconds = time.perf_counter() - start
    print(f"\n{len(domains)} domains -> {len(result.adapters)} adapters, {trainer.train_calls} training runs, "
          f"{seconds:.0f} s; manifest {manifest_path}\n")
    named = [dataclasses.replace(a, name=names[a.index]) for a in result.adapters]
    print("\n".join(result_lines(dataclasses.replace(result, adapters=named))))
    return {"manifest": str(manifest_path), "adapters": len(result.adapters), "result": result,
            "manifest_data": manifest, "seconds": seconds, "train_calls": trainer.train_calls, "model": ref,
            "trainer": trainer, "order": job.order, "rejected": result.rejected,
            "place_missed": job.place_missed, "accept_at_baseline": job.accept_at_baseline}


def run(cfg: DictConfig) -> dict:
    return run_fusion(cfg)
