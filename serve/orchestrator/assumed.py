"""An assumed cost profile, shaped after the V-LoRA paper's A100 / Qwen-VL-7B measurements.

It is NOT a measurement: it stands in until `measure_profile` has run on a GPU, and it says so
(`assumed=True`, and the name and note carry it into every table and plot). Shapes taken from
the paper (sections 3.2, 6.2, 6.3):

- base step: about 26 ms for one decoding sequence (the paper reports 30-50 ms per output token
  end to end) plus 0.07 ms per prompt token (prefill costs < 1 ms per token; three 256-token
  prompts take ~83 ms merged, figure 7);
- einsum (dLoRA) LoRA branch: ~140 ms extra for four 1024-token requests, 40-61% of the base
  step (figure 6), and 4.5x ATMM at decode;
- ATMM LoRA branch: 3.4x faster than einsum on prefill-sized inputs (figure 17), a fixed
  launch cost per step plus a small cost per distinct adapter (its A/B are read once) and per
  token;
- deLoRA (mixture): each token carries two adapters' work (-dW_merged + dW_own), so twice
  ATMM's per-token term with the same launch cost;
- switch: one-shot all-layer merge 5 ms (section 6.3.2), dLoRA's per-layer addmm 53 ms
  (figure 7).
"""

from __future__ import annotations

from .profile import CostProfile, Grid2D

SEQS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TOKENS = [1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384]
ADAPTERS = [1, 2, 4, 8, 16, 32, 64, 128]


def _grid(rows: list[int], fn) -> Grid2D:
    return Grid2D([float(r) for r in rows], [float(t) for t in TOKENS],
                  [[round(fn(r, t), 4) for t in TOKENS] for r in rows])


def assumed_profile() -> CostProfile:
    return CostProfile(
        base=_grid(SEQS, lambda s, t: 26.0 + 0.07 * t + 0.1 * s),
        lora={
            "atmm": _grid(ADAPTERS, lambda a, t: 1.0 + 0.1 * a + 0.009 * t),
            "einsum": _grid(ADAPTERS, lambda a, t: 4.0 + 0.5 * a + 0.03 * t),
            "delora": _grid(ADAPTERS, lambda a, t: 1.0 + 0.1 * a + 0.018 * t),
        },
        switch_ms={"atmm": 5.0, "addmm": 53.0},
        name="assumed-paper-a100-7b",
        device="none (assumed)",
        model="7B-shaped (assumed)",
        assumed=True,
        note="ASSUMED profile shaped after the V-LoRA paper's A100 measurements; "
             "not measured on any device. Replace with a GPU-measured profile.",
        created="assumed",
    )
