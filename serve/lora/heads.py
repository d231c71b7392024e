"""Vision task heads served with their adapter, and how a head request picks one.

On disk (adapters.heads): one head per knowledge domain under
`<adapter>/heads/<domain>/head.safetensors + head.json`, or a single `head.safetensors +
head.json` at the adapter root (named after meta.json's only domain, else "default").
meta.json's `domains[<domain>]["task"]` says what each domain answers.

Head mode: the request's prompt goes through one prefill with the adapter; the head reads the
final hidden states of the prompt (after the final norm, as training's `last_hidden_state`),
pooled as its config says (a dense detect head reads every visual token, with its cell centre in the
picture), and `decode` gives the `HeadResult` (label, count, boxes, yes/no).
"""

from __future__ import annotations

from pathlib import Path

import torch

from adapters.heads import find_heads
from adapters.peft import fail
from heads import NOT_VISUAL, TaskHead, load_head


def load_adapter_heads(path: str | Path, meta: dict, hidden_size: int, device: torch.device) -> dict[str, TaskHead]:
    """domain -> head (fp32, eval mode, on `device`) of an adapter directory; {} when it has none."""
    path = Path(path)
    found = find_heads(path, meta)
    heads = {}
    for domain, directory in found.items():
        try:
            head = load_head(directory, device=device, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise fail(path, f"head {domain!r} cannot be loaded: {e}") from e
        if head.config.hidden_size != hidden_size:
            raise fail(path, f"head {domain!r} reads hidden size {head.config.hidden_size} but the served "
                             f"model's is {hidden_size}")
        heads[domain] = head
    return heads


def head_tasks(heads: dict[str, TaskHead], meta: dict) -> dict[str, str]:
    """domain -> task name (meta.json's, else the head type) of every head."""
    domains = meta.get("domains") if isinstance(meta.get("domains"), dict) else {}
    out = {}
    for domain, head in heads.items():
        record = domains.get(domain) if isinstance(domains.get(domain), dict) else {}
        out[domain] = str(record.get("task") or head.config.type)
    return out


def select_head(adapter: str, heads: dict[str, TaskHead], meta: dict, task: str | None) -> TaskHead:
    """The head a request names by domain or task; without a name, the adapter's only head."""
    tasks = head_tasks(heads, meta)
    described = ", ".join(f"{d} ({t})" for d, t in tasks.items())
    if not heads:
        raise ValueError(f"output_mode 'head' needs an adapter with a task head; adapter {adapter!r} has none "
                         "(use output_mode='generate')")
    if task is None:
        if len(heads) == 1:
            return next(iter(heads.values()))
        raise ValueError(f"adapter {adapter!r} has several heads: {described}; name one with Request.task")
    if task in heads:
        return heads[task]
    matches = [d for d, t in tasks.items() if t == task]
    if len(matches) == 1:
        return heads[matches[0]]
    if matches:
        raise ValueError(f"task {task!r} of adapter {adapter!r} is ambiguous: domains {matches} answer it; "
                         "name the domain in Request.task")
    raise ValueError(f"adapter {adapter!r} has no head for task {task!r}; its heads: {described}")


def run_head(head: TaskHead, hidden: torch.Tensor, token_xy: torch.Tensor | None = None):
    """hidden: [P, D] final hidden states of a prompt (all of it, or its tail for 'last' pooling), token_xy:
    [P, 2] its visual tokens' cell centres (read by dense detect heads) -> HeadResult."""
    return run_heads([(head, hidden, token_xy)])[0]


@torch.no_grad()
def run_heads(jobs: list[tuple[TaskHead, torch.Tensor, torch.Tensor | None]]) -> list:
    """The HeadResult of each (head, hidden rows [P, D], token_xy [P, 2] or None) in order. The prompts
    of one head run as one padded batch (mask and cell centres built on the host), and every head's
    outputs come to the host in one wait for the GPU, not two per prompt."""
    return launch_heads(jobs).results()


class PendingHeads:
    """Head outputs queued on the device and on their way to the host (pinned, non-blocking copies);
    `results()` waits for them alone, not for work queued on the stream after them."""

    def __init__(self, count: int, pending: list, ready):
        self.count, self.pending, self.ready = count, pending, ready  # ready: a CUDA event, or None

    def results(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()  # the one wait: every head's outputs are on the host
        results: list = [None] * self.count
        for head, members, outputs in self.pending:
            for i, result in zip(members, head.decode(outputs)):
                results[i] = result
        return results


@torch.no_grad()
def launch_heads(jobs: list[tuple[TaskHead, torch.Tensor, torch.Tensor | None]]) -> PendingHeads:
    """Queues every head of `jobs` (see run_heads) and the copies of their outputs to the host."""
    groups: dict[int, tuple[TaskHead, list[int]]] = {}
    for i, (head, _, _) in enumerate(jobs):
        groups.setdefault(id(head), (head, []))[1].append(i)
    pending, ready = [], None
    for head, members in groups.values():
        rows = [jobs[i][1] for i in members]
        hidden = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # right padding
        mask = torch.zeros(hidden.shape[:2], dtype=torch.bool)
        for b, r in enumerate(rows):
            mask[b, :r.shape[0]] = True
        cells = [jobs[i][2] for i in members]
        xy = None
        if all(c is not None for c in cells):
            xy = torch.nn.utils.rnn.pad_sequence(cells, batch_first=True, padding_value=NOT_VISUAL)
        outputs = head(hidden, mask, xy)
        if hidden.is_cuda:
            outputs = {k: v.to("cpu", non_blocking=True) for k, v in outputs.items()}  # pinned, queued
            ready = torch.cuda.Event()
        pending.append((head, members, outputs))
    if ready is not None:
        ready.record()  # after the last copy, on the current stream
    return PendingHeads(len(jobs), pending, ready)
