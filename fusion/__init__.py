"""Offline stage: accuracy-aware knowledge fusion, packing knowledge domains into the fewest adapters.

Stdlib only (and the adapters package, whose manifest it writes); training is behind the `Trainer` protocol (the real one lives in `train/`). The API:

    result = fuse(domains, trainer, order="size_desc", workdir=...)   # greedy with roll-back, resumable
    result.adapters        # [FusedAdapter(index, name, domains, accuracies, requirements, met, state)]
    result.events          # [FusionEvent(step, domain, adapter, action, accuracies, violations)]
    export_adapters(result, trainer, out_dir)   # trainer.save each adapter as <run>_<index> + manifest.json
    write_manifest(result, out_dir, adapter_paths) / read_manifest(path)
    select_adapter(manifest, "plate" or "detect", 0.8)   # cheapest adapter accurate enough, or None
"""

from adapters.manifest import (CREATED_BY, MANIFEST, ManifestError, Selection, read_manifest, select_adapter,
                               write_manifest)

from .export import export_adapters
from .greedy import ORDERS, fuse, order_domains
from .journal import JOURNAL, adapter_name
from .spec import ACTIONS, Domain, FusedAdapter, FusionEvent, FusionResult, Trainer

__all__ = [
    "fuse", "order_domains", "ORDERS", "ACTIONS", "JOURNAL", "adapter_name",
    "Domain", "Trainer", "FusionEvent", "FusedAdapter", "FusionResult",
    "write_manifest", "read_manifest", "select_adapter", "export_adapters", "Selection", "ManifestError",
    "MANIFEST", "CREATED_BY",
]
