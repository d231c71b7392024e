"""The `vlora` command: one subcommand per stage, each a Hydra app taking `key=value` overrides.

    vlora zoo    [overrides]   build the offline model zoo (conf/zoo.yaml)
    vlora world  [overrides]   write the synthetic traffic world (conf/world.yaml)
    vlora demo   [overrides]   the main job on the built-in default, end to end (conf/demo.yaml)
    vlora smoke  [overrides]   every tiny zoo model through the transformers Auto classes (conf/smoke.yaml)
    vlora teachers [overrides] train the built-in teachers on the synthetic world (conf/teachers.yaml)
    vlora distill [overrides]  distil teachers into one dataset per domain (conf/distill.yaml)
    vlora pretrain [overrides] world pretraining of a tiny zoo model (conf/pretrain.yaml)
    vlora train  [overrides]   one LoRA adapter + task head on one domain (conf/train.yaml)
    vlora fusion [overrides]   accuracy-aware knowledge fusion into adapters (conf/fusion.yaml)
    vlora offline [overrides]  teachers -> datasets -> fused adapters -> report (conf/offline.yaml)
    vlora tune   [overrides]   search the ATMM tiling table of this GPU (conf/tune.yaml)
    vlora bench  [overrides]   GPU benchmarks (conf/bench.yaml)
    vlora diagnose [overrides] where a trained adapter loses its score, item by item (conf/diagnose.yaml)
    vlora serve  [overrides]   the inference server over RPyC (conf/serve.yaml)
    vlora loadtest [overrides] concurrent clients against a server (conf/loadtest.yaml)
    vlora video_analytics [overrides]  camera streams against the server (conf/video_analytics.yaml)
    vlora visual_retrieval [overrides] image queries: QA, captions, grounding (conf/visual_retrieval.yaml)
    vlora simulate [overrides] scheduling policies over workloads, simulated (conf/simulate.yaml)

Hydra's own flags work after the subcommand, e.g. `vlora zoo --cfg job` prints the config.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with run(cfg), primary config name, one-line help)
COMMANDS = {
    "zoo": ("vlora.commands.zoo", "zoo", "build the offline model zoo"),
    "world": ("vlora.commands.world", "world", "write the synthetic traffic world"),
    "demo": ("vlora.commands.demo", "demo", "the main job on the built-in default, end to end"),
    "smoke": ("vlora.commands.smoke", "smoke", "every tiny zoo model through the Hugging Face Auto classes"),
    "teachers": ("vlora.commands.teachers", "teachers", "train the built-in teachers on the synthetic world"),
    "distill": ("vlora.commands.distill", "distill", "distil teachers into one dataset per knowledge domain"),
    "pretrain": ("vlora.commands.pretrain", "pretrain", "make a random tiny zoo model learnable (world pretraining)"),
    "train": ("vlora.commands.train", "train", "one LoRA adapter plus the task head of one domain"),
    "fusion": ("vlora.commands.fusion", "fusion", "pack the domains into the fewest adapters meeting their requirements"),
    "offline": ("vlora.commands.offline", "offline", "the whole offline stage: teachers, datasets, fusion, report"),
    "tune": ("vlora.commands.tune", "tune", "search the ATMM tiling table of this GPU"),
    "bench": ("vlora.commands.bench", "bench", "GPU benchmarks (kernels, merge, engine, adapters)"),
    "diagnose": ("vlora.commands.diagnose", "diagnose", "where a trained adapter loses its score, item by item"),
    "serve": ("vlora.commands.serve", "serve", "the inference server (RPyC)"),
    "loadtest": ("vlora.commands.loadtest", "loadtest", "many concurrent clients against a server"),
    "video_analytics": ("vlora.commands.video_analytics", "video_analytics", "camera streams against the server"),
    "visual_retrieval": ("vlora.commands.visual_retrieval", "visual_retrieval", "image queries: QA, captions, grounding"),
    "simulate": ("vlora.commands.simulate", "simulate", "scheduling policies over workloads in the simulator (CPU)"),
}


# the long offline commands: where stderr is not a terminal, its progress bars arrive as lines
LINES_ON_STDERR = frozenset({"zoo", "world", "teachers", "distill", "pretrain", "train", "fusion", "offline"})

# plain commands (argparse, no Hydra): subcommand -> (module with main(argv) -> exit status, help)
PLAIN = {"tenants": ("vlora.commands.tenants", "the server's tenants file: add a tenant (prints its token), list")}


def usage() -> str:
    lines = ["usage: vlora <command> [key=value ...]", "", "commands:"]
    lines += [f"  {name:<17} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += [f"  {name:<17} {help_}" for name, (_, help_) in PLAIN.items()]
    lines += ["", "Each command is a Hydra app: `vlora <command> --help` shows its config and overrides."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name in PLAIN:
        raise SystemExit(importlib.import_module(PLAIN[name][0]).main(rest))
    if name not in COMMANDS:
        print(f"vlora: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module_name, config_name, _ = COMMANDS[name]
    from .config import hydra_entry

    run = importlib.import_module(module_name).run
    sys.argv = [f"vlora-{name}", *rest]  # Hydra parses sys.argv
    if name not in LINES_ON_STDERR:
        hydra_entry(config_name, run)()
        return
    from .commands.capture import StderrLines

    with StderrLines():  # stderr to a file: progress bars become lines (a terminal sees them as ever)
        hydra_entry(config_name, run)()


if __name__ == "__main__":
    main()
