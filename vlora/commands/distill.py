"""`vlora distill`: distil the default knowledge domains (or `distill.only=[...]`) into datasets.

Each domain (conf/dataset/<name>.yaml, or one added from the command line or a user's config
dir: `+distill.domains.people={...}`) names its teacher (a built-in, `<kind>:<path>`, an entry
point, or `{_target_: mypkg.Class, ...}`) and its source (the synthetic world by default, or a
video, images or labelled data; conf/dataset/user_video.yaml shows every field); missing
built-in teachers are trained first (as `vlora teachers` would). Outputs
${paths.datasets}/<domain>/ (DatasetDict + domain.json), world frames / clips under
${paths.world}/distill-* and a recording's chunks under ${paths.world}/video-*. Finished domains
are kept on a re-run while their key matches (config, data, model, and the teacher: its arguments,
a plug-in's own code and the content of the checkpoints its config names); otherwise the run says
why it rebuilds ("rebuilding ...: the teacher's code changed (my_models/people.py)").
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from train.distill import DistillJob, DistillResult, DomainError, DomainSpec, distill

from .table import format_table
from .teachers import teacher_settings


def domain_specs(cfg: DictConfig) -> list[DomainSpec]:
    domains = OmegaConf.to_container(cfg.distill.domains, resolve=True) or {}
    specs = []
    for key, values in domains.items():
        spec = DomainSpec.from_dict(values)
        if spec.name != key:
            raise DomainError(f"distill.domains.{key} holds domain {spec.name!r}; the key must be its name")
        specs.append(spec)
    only = cfg.distill.only
    if only is not None:
        only = [only] if isinstance(only, str) else list(only)
        unknown = [n for n in only if n not in domains]
        if unknown:
            raise DomainError(f"distill.only names unknown domains {unknown}; domains: {list(domains)}")
        specs = [s for s in specs if s.name in only]
    return specs


def run(cfg: DictConfig) -> dict[str, DistillResult]:
    specs = domain_specs(cfg)
    job = DistillJob(datasets_dir=cfg.distill.datasets_dir, world_dir=cfg.distill.world_dir,
                     model=cfg.model.name, model_path=cfg.model.path, zoo_seed=cfg.seed,
                     overwrite=bool(cfg.distill.overwrite), world_workers=cfg.distill.world_workers,
                     label_workers=cfg.distill.label_workers)
    results = distill(specs, teacher_settings(cfg), job, sys.stderr)
    rows = [{"domain": r.name, "task": s.task,
             "teacher": s.teacher if isinstance(s.teacher, str) else
             s.teacher.get("_name_") or s.teacher.get("name") or s.teacher.get("_target_") or s.teacher.get("target"),
             "source": s.source.get("kind", "world"), "train": r.sizes["train"],
             "eval": r.sizes["eval"],
             "teacher_vs_truth": f"{r.agreement['value']:.3f} ({r.agreement['metric']})" if r.agreement else "-",
             "status": r.status, "seconds": round(r.seconds, 1)} for s, r in zip(specs, results.values())]
    print(f"\nDistilled knowledge domains ({job.datasets_dir})\n")
    print(format_table(rows))
    return results
