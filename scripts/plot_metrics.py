"""Plot the curves of one or more runs into one PNG, from their metrics.jsonl: training loss (as logged, faint, and
smoothed over it) with validation loss as dots, learning rate, gradient norm and tokens/s, the runs overlaid.

    python3 scripts/plot_metrics.py runs/rwkv7_0.1B runs/transformer_0.1B -o curves.png [--x tokens|step]

Each RUN is a run folder (or its metrics.jsonl); its label is the folder name, or LABEL=RUN. Where a resumed run
logged a step twice, the later line wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (("loss", "loss (nats per token)"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tokens_per_sec", "tokens/s"))


def read_run(path: Path, x_key: str) -> tuple[dict[str, list[tuple[float, float]]], list[tuple[float, float]]]:
    """({metric: [(x, value)] by step} for the training lines' metrics in PANELS, [(x, eval_loss)]). Validation lines
    carry no token count: their x is the step times the tokens per step of the training lines (a fixed global
    batch)."""
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in rows if "loss" in r}      # later lines win
    val = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    per_step = next((r["tokens_seen"] / r["step"] for r in train.values() if r.get("tokens_seen") and r["step"]), 1)
    scale = per_step if x_key == "tokens" else 1
    curves = {key: [(s * scale, train[s][key]) for s in sorted(train) if key in train[s]] for key, _ in PANELS}
    return curves, [(s * scale, val[s]) for s in sorted(val)]


def running_mean(ys: list[float], window: int) -> list[float]:
    return [sum(ys[max(0, j - window + 1):j + 1]) / len(ys[max(0, j - window + 1):j + 1]) for j in range(len(ys))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders or metrics.jsonl files, optionally LABEL=PATH")
    p.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--x", choices=("tokens", "step"), default="tokens")
    p.add_argument("--smooth", type=int, default=5, help="logged training losses per point of the mean (1: none)")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    runs = []
    for spec in a.runs:
        label, _, path = spec.rpartition("=")
        path = Path(path)
        if not (path / "metrics.jsonl" if path.is_dir() else path).is_file():
            print(f"plot_metrics: no metrics.jsonl at {path}", file=sys.stderr)
            sys.exit(2)
        runs.append((label or (path.name if path.is_dir() else path.parent.name), *read_run(path, a.x)))
    try:
        import matplotlib
    except ImportError:
        print("plot_metrics: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        sys.exit(2)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=110)
    window = max(1, a.smooth)
    for i, (label, curves, val) in enumerate(runs):
        color = f"C{i}"
        for ax, (key, _) in zip(axes.flat, PANELS):
            if not curves[key]:
                continue
            xs, ys = zip(*curves[key])
            if key == "loss" and window > 1:
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ys = running_mean(list(ys), window)
            ax.plot(xs, ys, color=color, label=label if key != "loss" or window == 1 else f"{label} (mean of {window})")
        if val:
            vx, vy = zip(*val)
            axes.flat[0].plot(vx, vy, "o", color=color, label=f"{label} (validation)")
    for ax, (key, ylabel) in zip(axes.flat, PANELS):
        ax.set_xlabel("tokens" if a.x == "tokens" else "step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
