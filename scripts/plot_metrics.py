"""Plot the loss curves of one or more runs into one PNG, from their metrics.jsonl.

    python3 scripts/plot_metrics.py runs/rwkv7_0.1B runs/transformer_0.1B --out loss.png [--x tokens|step]

Each RUN is a run folder (or its metrics.jsonl); its label is the folder name, or LABEL=RUN. Training loss is drawn
faintly as logged (each logged step's own batch) and, over it, as the mean of the last --smooth logged values;
validation loss (eval_loss, when the run had validation) as dots in the same colour. Where a resumed run logged a
step twice, the later line wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_curves(path: Path, x_key: str) -> tuple[dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
    """{step: (x, loss)} for training and for validation lines. Validation lines carry no token count: their x is
    the step times the tokens per step of the training lines (a fixed global batch)."""
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in rows if "loss" in r}
    val = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    per_step = next((r["tokens_seen"] / r["step"] for r in train.values() if r.get("tokens_seen") and r["step"]), 1)
    scale = per_step if x_key == "tokens" else 1
    return ({s: (s * scale, r["loss"]) for s, r in train.items()},
            {s: (s * scale, loss) for s, loss in val.items()})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders or metrics.jsonl files, optionally LABEL=PATH")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--x", choices=("tokens", "step"), default="tokens")
    p.add_argument("--smooth", type=int, default=5, help="logged training values per point of the mean (1: none)")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_metrics: matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, spec in enumerate(a.runs):
        label, _, path = spec.rpartition("=")
        path = Path(path)
        if not (path / "metrics.jsonl" if path.is_dir() else path).is_file():
            print(f"plot_metrics: no metrics.jsonl at {path}", file=sys.stderr)
            sys.exit(2)
        train, val = read_curves(path, a.x)
        label = label or (path.name if path.is_dir() else path.parent.name)
        color = f"C{i}"
        xs, ys = zip(*(train[s] for s in sorted(train))) if train else ((), ())
        window = max(1, a.smooth)
        means = [sum(ys[max(0, j - window + 1):j + 1]) / len(ys[max(0, j - window + 1):j + 1]) for j in range(len(ys))]
        if window > 1:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(xs, means, color=color, label=f"{label} (train" + (f", mean of {window} logged)" if window > 1 else ")"))
        if val:
            vx, vy = zip(*(val[s] for s in sorted(val)))
            ax.plot(vx, vy, "o", color=color, label=f"{label} (validation)")
    ax.set_xlabel("tokens" if a.x == "tokens" else "step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(a.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
