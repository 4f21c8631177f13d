"""What a log step reports: one console line, one JSON line in {dump_folder}/metrics.jsonl, wandb if enabled.

metrics.jsonl holds each step once: a launch that resumes from step N (or starts fresh, N = 0) first drops the
file's rows past step N, which a run stopped after its last checkpoint had logged and this one logs again.

Every row carries wall-clock time, so that curves can be plotted against it (scripts/plot_metrics.py --x time):
`time`, Unix seconds when it was written, and `elapsed_sec`, seconds of this run's training: counted from the
metrics logger's start (the model built and any checkpoint loaded, before the first step) and summed over the run's
launches, a resume going on from the largest elapsed_sec of the rows it keeps (time between launches not counted).
Console lines begin with the local date and time (`clock`).
"""

from __future__ import annotations

import json
import math
import netrc
import os
import resource
import sys
import time
from pathlib import Path

import torch

from flame.config import Config


def peak_flops(cfg_tflops: float, device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of one device; None on CPU (no meaningful MFU there)."""
    if cfg_tflops > 0:
        return cfg_tflops * 1e12
    if device.type != "cuda":
        return None
    from torchtitan.tools.logging import logger as titan_logger
    from torchtitan.tools.utils import get_peak_flops

    titan_logger.disabled = True  # (the root logger) it logs an error where lspci is missing, then uses the name
    try:
        return get_peak_flops(torch.cuda.get_device_name(device))
    finally:
        titan_logger.disabled = False


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process' peak RSS


def wandb_mode(requested: str) -> str:
    """auto -> online only when credentials exist, so a cluster without network never hangs on login."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


class MetricsLogger:
    """Rank 0 writes; other ranks only keep time. Throughput counts every rank's tokens."""

    def __init__(self, cfg: Config, run_dir: Path, *, rank: int, world_size: int, device: torch.device,
                 flops_per_token: float, wandb_id: str | None = None, start_step: int = 0):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(cfg.metrics.peak_tflops, device)
        if rank == 0:
            drop_rows_after(run_dir / "metrics.jsonl", start_step)
        self.file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
        self.wandb = None
        self.wandb_id = wandb_id
        if rank == 0 and cfg.metrics.enable_wandb:
            import wandb

            self.wandb = wandb.init(project=cfg.metrics.wandb_project, name=cfg.job.name, id=wandb_id,
                                    resume="allow", dir=str(run_dir), config=cfg.to_dict(),
                                    mode=wandb_mode(cfg.metrics.wandb_mode))
            self.wandb_id = self.wandb.id  # saved in checkpoints: a resumed run continues this wandb run
        self.window_start = time.perf_counter()
        self.window_tokens = 0
        self.train_start = time.perf_counter()
        self.steps_timed = 0
        self.alloc_retries_warned = False
        self.elapsed_before = elapsed_sec_logged(run_dir / "metrics.jsonl") if rank == 0 else 0.0

    def count(self, global_tokens: int) -> None:
        """Tokens (inputs, all ranks) processed by one optimizer step."""
        self.window_tokens += global_tokens
        self.steps_timed += 1

    def log(self, step: int, values: dict, seconds: float | None = None) -> dict:
        """seconds: the time the window's steps took (default: the host's time since the last line)."""
        now = time.perf_counter()
        elapsed = max(now - self.window_start if seconds is None else seconds, 1e-9)
        tokens_per_sec = self.window_tokens / elapsed
        per_device = tokens_per_sec / self.world_size
        mfu = None if self.peak is None else 100.0 * per_device * self.flops_per_token / self.peak
        step_time = (now - self.train_start) / max(self.steps_timed, 1)
        record = {"step": step, **values, "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": per_device,
                  "mfu": mfu, "memory_gib": peak_memory_gib(self.device),
                  "eta_sec": step_time * (self.cfg.training.steps - step), **self.clock_fields()}
        self.window_start, self.window_tokens = now, 0
        if self.device.type == "cuda":
            record["alloc_retries"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            self.warn_alloc_retries(step, record)
        if self.rank == 0:
            self.file.write(json.dumps(record, default=_jsonable) + "\n")
            self.file.flush()
            print(console_line(record), flush=True)
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if k not in ("step", "time") and v is not None},
                               step=step)
        return record

    def warn_alloc_retries(self, step: int, record: dict) -> None:
        """Once per run: the caching allocator ran out of cached blocks, freed its cache and tried again. Each retry
        waits for the whole GPU, so a run that keeps retrying is slower than its memory suggests."""
        if record["alloc_retries"] and not self.alloc_retries_warned and self.rank == 0:
            self.alloc_retries_warned = True
            total = torch.cuda.get_device_properties(self.device).total_memory / 2**30
            print(f"warning: by step {step} the CUDA allocator freed its cache and retried {record['alloc_retries']} "
                  f"allocation(s) (peak {record['memory_gib']:.1f} of {total:.0f} GiB; each retry waits for the GPU): "
                  f"lower training.batch_size or seq_len, or checkpoint more activations "
                  f"(metrics.jsonl's alloc_retries counts them)", flush=True)

    def log_eval(self, step: int, loss: float) -> None:
        ppl = math.exp(min(loss, 50.0))
        self.log_extra(step, {"eval_loss": loss, "eval_ppl": ppl})
        if self.rank == 0:
            print(f"{clock()} step {step:>6} | eval loss {loss:.4f} | ppl {ppl:.2f}", flush=True)

    def log_extra(self, step: int, values: dict) -> None:
        """A line of its own in metrics.jsonl (eval results, checkpoint timings), and in wandb."""
        if self.rank == 0:
            self.file.write(json.dumps({"step": step, **values, **self.clock_fields()}) + "\n")
            self.file.flush()
            if self.wandb is not None:
                self.wandb.log(values, step=step)

    def clock_fields(self) -> dict:
        """The wall-clock fields of a row (module docstring)."""
        return {"time": round(time.time(), 3),
                "elapsed_sec": round(self.elapsed_before + time.perf_counter() - self.train_start, 3)}

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def drop_rows_after(path: Path, step: int) -> int:
    """Remove the rows of a metrics.jsonl whose step is past `step` (rewritten whole, then renamed); returns how many.
    A line that is not JSON (cut by a crash mid-write) goes too."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (json.JSONDecodeError, AttributeError):
            pass
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return len(lines) - len(kept)


def elapsed_sec_logged(path: Path) -> float:
    """The largest elapsed_sec of a metrics.jsonl's rows (0 without any): where a resumed run's clock goes on."""
    if not path.is_file():
        return 0.0
    latest = 0.0
    for line in path.read_text().splitlines():
        try:
            latest = max(latest, float(json.loads(line).get("elapsed_sec", 0.0)))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            pass
    return latest


def clock(unix_time: float | None = None) -> str:
    """Local date and time as console lines begin with it: 2026-11-27 23:45:01."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_time))


def _jsonable(x):
    return x.item() if isinstance(x, torch.Tensor) else str(x)


def console_line(r: dict) -> str:
    mfu = "  n/a" if r["mfu"] is None else f"{r['mfu']:5.1f}%"
    eta = time.strftime("%H:%M:%S", time.gmtime(r["eta_sec"])) if r["eta_sec"] < 86400 else f"{r['eta_sec']/86400:.1f}d"
    skipped = f" | skipped {r['skipped_steps']}" if r.get("skipped_steps") else ""
    return (f"{clock(r.get('time'))} step {r['step']:>6} | loss {r['loss']:.4f} | grad norm {r['grad_norm']:.3f} | "
            f"lr {r['lr']:.3e} | {r['tokens_per_sec']:,.0f} tok/s | mfu {mfu} | mem {r['memory_gib']:.2f} GiB | "
            f"eta {eta}{skipped}")


def warn(msg: str) -> None:
    bar = "!" * 100
    print(f"\n{bar}\n{msg}\n{bar}\n", file=sys.stderr, flush=True)
