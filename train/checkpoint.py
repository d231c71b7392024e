"""Resumable training checkpoints: `<dir>/checkpoint/` holds the latest one.

    lora.safetensors       LoRA weights (PEFT keys)
    head.safetensors/.json the head being trained (heads.save_head), if any
    trainer_state.pt       step, history, optimiser and scheduler state, torch RNG state, domain

A checkpoint is written to a temporary directory and renamed over the previous one, so an
interruption leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heads import TaskHead, save_head
from heads.io import head_paths

CHECKPOINT = "checkpoint"


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / CHECKPOINT


def save_checkpoint(directory: str | Path, vlm, head: TaskHead | None, optimizer, scheduler, step: int,
                    history: list, domain: str) -> Path:
    final = checkpoint_path(directory)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in vlm.lora_state().items()}, str(tmp / "lora.safetensors"))
    if head is not None:
        save_head(head, tmp)
    torch.save({"step": step, "history": history, "domain": domain, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}, tmp / "trainer_state.pt")
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(directory: str | Path, vlm, head: TaskHead | None, optimizer, scheduler,
                    domain: str) -> dict | None:
    """Restore the latest checkpoint in `directory` into the given objects; None if there is none."""
    final = checkpoint_path(directory)
    if not (final / "trainer_state.pt").is_file():
        old = final.with_name(final.name + ".old")  # a crash between the two renames
        if not (old / "trainer_state.pt").is_file():
            return None
        final = old
    state = torch.load(final / "trainer_state.pt", map_location="cpu", weights_only=False)
    if state["domain"] != domain:
        raise ValueError(f"checkpoint {final} is for domain {state['domain']!r}, not {domain!r}; "
                         "use another output directory or resume=false")
    vlm.load_lora_state(load_file(str(final / "lora.safetensors")))
    if head is not None:
        weights, _ = head_paths(final)
        head.load_state_dict(load_file(str(weights)))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state
