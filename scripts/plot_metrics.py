"""Plot the curves of one or more runs into one PNG, from their metrics.jsonl: training loss (as logged, faint, and
smoothed over it) with validation loss as dots, learning rate, gradient norm and tokens/s, the runs overlaid.

    python3 scripts/plot_metrics.py runs/rwkv7_0.1B runs/transformer_0.1B -o curves.png [--x tokens|step|time]

Each RUN is a run folder (or its metrics.jsonl); its label is the folder name, or LABEL=RUN. Where a resumed run
logged a step twice, the later line wins. --x time plots against the run's training wall-clock time (metrics.jsonl's
elapsed_sec: summed over its launches, the time between them left out), in seconds, minutes or hours as the longest
run needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIME_UNITS = ((3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))
"""--x time's unit: the first whose two make no more than the longest run's time."""

PANELS = (("loss", "loss (nats per token)"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tokens_per_sec", "tokens/s"))


class NoTimeError(ValueError):
    """--x time on a metrics.jsonl without elapsed_sec (written by a flame that did not record it)."""


def read_run(path: Path, x_key: str) -> tuple[dict[str, list[tuple[float, float]]], list[tuple[float, float]]]:
    """({metric: [(x, value)] by step} for the training lines' metrics in PANELS, [(x, eval_loss)]). Validation lines
    carry no token count: their x is the step times the tokens per step of the training lines (a fixed global
    batch). With x_key "time", x is elapsed_sec, each line's own."""
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in rows if "loss" in r}      # later lines win
    val = {r["step"]: r for r in rows if "eval_loss" in r}
    if x_key == "time":
        if any("elapsed_sec" not in r for r in [*train.values(), *val.values()]):
            raise NoTimeError(f"{metrics}: lines without elapsed_sec (logged by an older flame): plot it against "
                              f"--x tokens or step")
        x = {s: r["elapsed_sec"] for s, r in train.items()}
        val_x = {s: r["elapsed_sec"] for s, r in val.items()}
    else:
        per_step = next((r["tokens_seen"] / r["step"] for r in train.values() if r.get("tokens_seen") and r["step"]),
                        1)
        scale = per_step if x_key == "tokens" else 1
        x = {s: s * scale for s in train}
        val_x = {s: s * scale for s in val}
    curves = {key: [(x[s], train[s][key]) for s in sorted(train) if key in train[s]] for key, _ in PANELS}
    return curves, [(val_x[s], val[s]["eval_loss"]) for s in sorted(val)]


def time_unit(longest_sec: float) -> tuple[float, str]:
    return next(((size, name) for size, name in TIME_UNITS if longest_sec >= 2 * size), TIME_UNITS[-1])


def in_unit(curves: dict, val: list, size: float) -> tuple[dict, list]:
    return ({k: [(x / size, y) for x, y in points] for k, points in curves.items()},
            [(x / size, y) for x, y in val])


def running_mean(ys: list[float], window: int) -> list[float]:
    return [sum(ys[max(0, j - window + 1):j + 1]) / len(ys[max(0, j - window + 1):j + 1]) for j in range(len(ys))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders or metrics.jsonl files, optionally LABEL=PATH")
    p.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--x", choices=("tokens", "step", "time"), default="tokens",
                   help="the x axis: tokens seen, optimizer step, or training wall-clock time (default tokens)")
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
        try:
            runs.append((label or (path.name if path.is_dir() else path.parent.name), *read_run(path, a.x)))
        except NoTimeError as e:
            print(f"plot_metrics: {e}", file=sys.stderr)
            sys.exit(2)
    x_label = a.x
    if a.x == "time":
        longest = max((x for _, curves, val in runs for points in (*curves.values(), val) for x, _ in points),
                      default=0.0)
        size, unit = time_unit(longest)
        runs = [(label, *in_unit(curves, val, size)) for label, curves, val in runs]
        x_label = f"training time ({unit})"
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
        ax.set_xlabel(x_label)
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
