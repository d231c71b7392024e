"""The streams evaluation's outputs: a summary per mode, the printed tables, streams.csv,
streams.json (meta, summary, rows; NaN written as null) and streams.png (p95 latency against the
number of streams, one line per mode, with the latency target)."""

from __future__ import annotations

import math
from pathlib import Path
from .results import write_csv, write_json

ROW_COLUMNS = ("point", "mode", "streams", "offered_per_s", "sent", "done", "unfinished", "errors", "error_kinds", "p50_ms",
               "p95_ms", "p99_ms", "mean_ms", "max_ms", "chunks_per_s", "served_per_s", "latency_trend_ms_per_s", "projected_p95_ms", "pass",
               "prompt_tokens", "frame_decode_ms", "preprocess_ms", "queue_ms", "prefill_ms", "decode_ms", "vision_tokens_per_s",
               "settled", "leftover_before", "steps", "step_max_ms", "items_encoded", "items_encoded_ahead", "gc_full_ms")
TABLE = ("point", "mode", "streams", "sent", "done", "p50_ms", "p95_ms", "p99_ms", "chunks_per_s", "served_per_s", "queue_ms",
         "prefill_ms", "step_max_ms", "gc_full_ms", "projected_p95_ms", "pass")
SUMMARY_TABLE = ("mode", "max_streams", "chunks_per_s", "vision_tokens_per_s", "p95_ms", "tflop_per_chunk", "achieved_tflops",
                 "matmul_fraction", "compute_floor_chunks_per_s", "hf_chunks_per_s", "vs_hf")


def summarize(rows: list[dict], job, flops: dict, tflops: float, hf: dict | None,
              sustained_tflops: float | None = None) -> list[dict]:
    """Per mode: the largest passing stream count, its chunks/s and the fraction of the matmul rate
    that chunks/s x FLOPs per chunk reaches, the compute floor (matmul rate / FLOPs per chunk; at the
    sustained rate too, where measured) and the ratio to transformers' chunks/s."""
    sustained = sustained_tflops or math.nan
    out = []
    hf_rate = hf["chunks_per_s"] if hf else math.nan
    for mode in job.modes:
        mine = [r for r in rows if r["mode"] == mode and r.get("point", "warm") == "warm"]
        passing = [r for r in mine if r["pass"]]
        best = max(passing, key=lambda r: r["streams"]) if passing else None
        rate = best["chunks_per_s"] if best else math.nan
        per_chunk = flops[mode]
        achieved = rate * per_chunk / 1e12
        peak = max(mine, key=lambda r: r["served_per_s"]) if mine else None
        out.append({"mode": mode, "max_streams": best["streams"] if best else 0, "chunks_per_s": rate,
                    "vision_tokens_per_s": best.get("vision_tokens_per_s", math.nan) if best else math.nan,
                    "p95_ms": best["p95_ms"] if best else math.nan, "target_ms": job.target_ms,
                    "tflop_per_chunk": per_chunk / 1e12, "achieved_tflops": achieved, "matmul_tflops": tflops,
                    "matmul_fraction": achieved / tflops, "compute_floor_chunks_per_s": tflops * 1e12 / per_chunk,
                    "sustained_floor_chunks_per_s": sustained * 1e12 / per_chunk,
                    "peak_served_per_s": peak["served_per_s"] if peak else math.nan,
                    "peak_at_streams": peak["streams"] if peak else 0,
                    "hf_chunks_per_s": hf_rate, "vs_hf": rate / hf_rate if hf else math.nan})
    return out


def floor_summary(flops: dict, tflops: float, sustained: dict | None, in_process: dict | None) -> dict:
    """A head chunk's compute floor in GPU ms at the burst matmul rate and at the sustained one, and the
    in-process full batch's GPU ms per chunk over each (the issue's target: <= 1.25x)."""
    floor = {"burst_ms": flops["head"] / (tflops * 1e12) * 1e3}
    if sustained:
        floor["sustained_ms"] = flops["head"] / (sustained["tflops"] * 1e12) * 1e3
    gpu_ms = ((in_process or {}).get("full_batch") or {}).get("gpu_ms_per_chunk")
    if gpu_ms:
        floor["gpu_ms_per_chunk"] = gpu_ms
        floor["vs_burst"] = gpu_ms / floor["burst_ms"]
        if sustained:
            floor["vs_sustained"] = gpu_ms / floor["sustained_ms"]
    return floor


COLD_TARGET = 1.5  # the cold point's p95 within this multiple of the warm p95 at the same count


def cold_summary(rows: list[dict], job) -> dict | None:
    """The cold point (right after ready) beside the warm point of the same mode and count."""
    cold = next((r for r in rows if r.get("point") == "cold"), None)
    if cold is None:
        return None
    warm = next((r for r in rows if r.get("point", "warm") == "warm" and r["mode"] == cold["mode"]
                 and r["streams"] == cold["streams"]), None)
    ratio = cold["p95_ms"] / warm["p95_ms"] if warm and warm["p95_ms"] else math.nan
    # the same start on the warmed server: the part of the cold point's p95 that N cameras starting at once cost
    ramps = [r["p95_ms"] for r in rows if r.get("point") == "ramp" and r["mode"] == cold["mode"]
             and r["streams"] == cold["streams"]]
    return {"mode": cold["mode"], "streams": cold["streams"], "seconds": job.cold_seconds,
            "cold_p95_ms": cold["p95_ms"], "cold_unfinished": cold["unfinished"], "cold_errors": cold["errors"],
            "warm_p95_ms": warm["p95_ms"] if warm else math.nan, "cold_vs_warm": ratio, "target": COLD_TARGET,
            "met": bool(ratio <= COLD_TARGET and not cold["unfinished"] and not cold["errors"]),
            "ramp_p95_ms": ramps}


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def format_table(records: list[dict], columns: tuple[str, ...]) -> str:
    cells = [list(columns)] + [[_fmt(r.get(c)) for c in columns] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(" | ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def _clean(value):
    """JSON-safe: NaN / inf -> None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "streams.csv", ({k: r.get(k) for k in ROW_COLUMNS} for r in rows), ROW_COLUMNS)
    meta["plot"] = str(out / "streams.png")
    plot(rows, meta["job"]["target_ms"], meta["device"], out / "streams.png")
    write_json(out / "streams.json", _clean({"meta": meta, "rows": rows}))
    print(format_table(rows, TABLE))
    print()
    print(format_table(meta["summary"], SUMMARY_TABLE))
    cold = meta.get("cold")
    if cold:
        print(f"\ncold ({cold['streams']} {cold['mode']} streams, the first {cold['seconds']:g} s after ready): "
              f"p95 {cold['cold_p95_ms']:.0f} ms against {cold['warm_p95_ms']:.0f} ms warm = "
              f"{cold['cold_vs_warm']:.2f}x (target <= {cold['target']:g}x): {'met' if cold['met'] else 'MISSED'}")
        if cold.get("ramp_p95_ms"):
            ramps, warm = cold["ramp_p95_ms"], cold["warm_p95_ms"]
            print("the same start on the warmed server (ramp): p95 " + ", ".join(f"{v:.0f}" for v in ramps)
                  + " ms = " + ", ".join(f"{v / warm:.2f}" for v in ramps) + "x the warm p95")
    for r in rows:  # profiled first steps (bench.streams.profile_first_steps): the cold point's beside the ramp's
        for i, step in enumerate(r.get("step_profiles") or []):
            print(f"\n{r['point']} {r['streams']}, profiled step {i + 1}: {step['wall_ms']:.1f} ms; most self CPU ms: "
                  + ", ".join(f"{name} {own:.1f} ({calls}x)" for name, calls, own, _ in step["ops"][:8]))
    hf = meta.get("hf")
    if hf:
        print(f"\ntransformers generate, batch {hf['batch']}: {hf['chunks_per_s']:.3g} chunks/s "
              f"({hf['chunks_per_s_with_preprocess']:.3g} with preprocessing)")
    floor, sustained = meta.get("floor") or {}, meta.get("matmul_sustained")
    if floor:
        line = f"\ncompute floor of a head chunk: {floor['burst_ms']:.1f} GPU ms at the burst matmul rate"
        if sustained:
            clock = f", SM clock {sustained['sm_clock_mhz']} MHz" if sustained["sm_clock_mhz"] else ""
            line += (f", {floor['sustained_ms']:.1f} at the sustained one ({sustained['tflops']:.4g} TFLOP/s after "
                     f"{meta['job']['matmul_sustained_s']:g} s{clock})")
        if "gpu_ms_per_chunk" in floor:
            line += f"; in process {floor['gpu_ms_per_chunk']:.1f} GPU ms per chunk = {floor['vs_burst']:.2f}x the burst floor"
            line += f", {floor['vs_sustained']:.2f}x the sustained one" if "vs_sustained" in floor else ""
        print(line + " (target <= 1.25x)")
    print(f"{meta['device']}, {meta['date']}: matmul {meta['matmul_tflops']:.4g} TFLOP/s; wrote {out}")


def plot(rows: list[dict], target_ms: float, device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        points = sorted((r["streams"], r["p95_ms"]) for r in rows if r["mode"] == mode and not math.isnan(r["p95_ms"]))
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{mode} (p95)")
    ax.axhline(target_ms, color="grey", linestyle="--", label=f"target {target_ms:g} ms")
    ax.set_xlabel("concurrent streams (one chunk per second each)")
    ax.set_ylabel("p95 chunk latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Streams within the latency target ({device})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
