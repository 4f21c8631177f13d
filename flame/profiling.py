"""[profiling]: trace a few whole training steps with the PyTorch profiler and say where their wall time went.

The train loop calls `before_step(n)` at the top of each iteration (n: the step about to run) and `close()` when it
ends. Just before step `start_step` the profiler starts (host ops; on a GPU also its kernels, copies and memsets),
and just before step `start_step + steps` (or when training ends or stops first) it stops. Every rank then writes
into {dump_folder}/profile/:

    step-<first>-<last>-rank<R>.json.gz   Chrome trace (open it in ui.perfetto.dev)
    step-<first>-<last>-rank<R>.txt       summary: where the wall time of those steps went

The whole iteration is recorded (data, forward, backward, clipping, optimizer, logging, checkpoint saves, the stop
check), each step under a `ProfilerStep#<n>` range. The summary gives the wall time (host clock, the device
synchronized at both ends; split into steps at the loop's tops, where the host, which queues a step while the device
runs the one before, has got to), the time the device was busy (the union of its kernel, memcpy and memset intervals:
streams that overlap count once) and so the share it sat idle (launch gaps, host syncs, waits for data or other
ranks), then the device time by kind (matmuls, attention, our Triton kernels, Inductor's, copies, the rest), the
kernels by device time, the GPU's idle gaps by the host op over each (where the GPU waited on the host), the host ops
by self CPU time and the annotated host ranges (the optimizer step, FSDP's all-gathers and reductions, ...). On a
CPU, "busy" is the union of the op intervals of all threads.

Disabled, it costs a comparison or two per step and records nothing.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from flame.config import ProfilingConfig

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Kineto activity types of the device's own work (not annotations, runtime calls or syncs)."""
TOP_DEVICE, TOP_HOST, TOP_RANGES, TOP_IDLE = 25, 15, 12, 12
"""Rows of the summary's tables: device kernels (GPU), host ops (25 of them on a CPU), annotated ranges, the host ops
the GPU's idle gaps fall under."""
MIN_GAP_US = 50.0
"""The GPU's idle gaps the summary attributes to host ops: longer than this (shorter ones are a launch's latency)."""
NAME_WIDTH = 100


class StepProfiler:
    def __init__(self, cfg: ProfilingConfig, run_dir: Path, rank: int, device: torch.device, *, next_step: int,
                 last_step: int, say: Callable[[str], None]):
        """next_step: the step this launch runs first (a resumed run: its checkpoint's step + 1); last_step:
        training.steps. `say` prints on rank 0."""
        self.cfg, self.rank, self.device, self.say = cfg, rank, device, say
        self.folder = run_dir / "profile"
        self.start_step = cfg.start_step if cfg.enable else -1
        self.last_step = cfg.start_step + cfg.steps - 1
        self.prof = None
        """The running torch.profiler.profile, within the window only."""
        if cfg.enable and not next_step <= cfg.start_step <= last_step:
            why = (f"past training.steps = {last_step}" if cfg.start_step > last_step
                   else f"already done: this run starts at step {next_step}")
            say(f"profiling: step {cfg.start_step} is {why}; nothing is profiled (set profiling.start_step)")

    def before_step(self, step: int) -> None:
        """At the top of the loop, before step `step` loads its data: open, advance or close the window."""
        if self.prof is not None:
            if step > self.last_step:
                self.finish()
            else:
                self._next_step(step)
        elif step == self.start_step:
            self._begin(step)

    def close(self, write: bool = True) -> None:
        """Training ended or stopped: a window still open ends here, written (write=False, after an error: dropped)."""
        if self.prof is not None:
            if write:
                self.finish()
            else:
                prof, self.prof = self.prof, None
                try:
                    prof.stop()
                except RuntimeError:  # whatever failed may have left the profiler unable to stop: nothing to keep
                    pass

    # ------------------------------------------------------------------------------------------------------ window
    def _begin(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=activities, record_shapes=self.cfg.record_shapes)
        self._synchronize()  # no earlier step's device work inside the window
        self.prof.start()
        self.first = step
        self.marks = [time.perf_counter()]
        """Host clock at the start of each profiled step, then at the end of the last."""
        self._range = None
        self._open_range(step)

    def _next_step(self, step: int) -> None:
        self._range.__exit__(None, None, None)
        self.marks.append(time.perf_counter())
        self._open_range(step)

    def _open_range(self, step: int) -> None:
        from torch.profiler import record_function

        self._range = record_function(f"ProfilerStep#{step}")
        self._range.__enter__()

    def finish(self) -> None:
        """Stop after the last profiled step (the device drained first), write the trace and the summary."""
        self._synchronize()
        self._range.__exit__(None, None, None)
        self.marks.append(time.perf_counter())
        self.prof.stop()
        prof, self.prof = self.prof, None
        first, last = self.first, self.first + len(self.marks) - 2
        stem = f"step-{first}-{last}-rank{self.rank}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_trace(prof, self.folder / f"{stem}.json.gz")
            events = prof.events()
            busy = busy_seconds(events, on_gpu=self.device.type == "cuda")
            text = summary(events, events.key_averages(), busy, steps=range(first, last + 1), marks=self.marks,
                           rank=self.rank, device=self.device)
            (self.folder / f"{stem}.txt").write_text(text)
        except OSError as e:  # a full disk: say so and keep training
            print(f"rank {self.rank}: profiling: could not write {self.folder / stem}.*: {e}", file=sys.stderr,
                  flush=True)
            return
        wall = self.marks[-1] - self.marks[0]
        what = "GPU" if self.device.type == "cuda" else "CPU ops"
        which = f"step {first}" if first == last else f"steps {first}-{last}"
        self.say(f"profile of {which} (rank 0: wall {wall:.3f} s, {what} busy "
                 f"{100 * busy / max(wall, 1e-12):.1f} %): {self.folder}/step-{first}-{last}-rank*.json.gz (trace), "
                 ".txt (summary)")

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def write_trace(prof, path: Path) -> None:
    """The Chrome trace, gzipped; written beside its final name (not in /tmp: traces of large models are large)."""
    raw = path.with_name(path.name.removesuffix(".gz") + ".tmp")
    try:
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as fin, gzip.open(path, "wb", compresslevel=6) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    finally:
        if raw.exists():
            os.remove(raw)


# --------------------------------------------------------------------------------------------------------- summary
def is_device_work(e) -> bool:
    """A kernel, memcpy or memset on the device (FunctionEvent of a profile with CUDA activity)."""
    if e.device_type == torch.autograd.DeviceType.CPU or e.is_user_annotation:
        return False
    return getattr(e, "activity_type", "kernel") in DEVICE_WORK


def is_host_op(e) -> bool:
    return (e.device_type == torch.autograd.DeviceType.CPU and not e.is_async and not e.is_user_annotation
            and getattr(e, "activity_type", "cpu_op") == "cpu_op")


def step_span(events) -> tuple[float, float] | None:
    """(start, end) in the trace's microseconds of the ProfilerStep ranges together."""
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.is_user_annotation and e.device_type == torch.autograd.DeviceType.CPU
             and e.name.startswith("ProfilerStep")]  # (named ProfilerStep* in the events, #<n> in the trace)
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None


def union_us(intervals) -> float:
    """Length of the union of (start, end) intervals: time covered by at least one of them."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def work_in_steps(events, on_gpu: bool) -> list[tuple[object, float, float]]:
    """(event, start, end) of the device's work (on_gpu false: of the host ops), cut to the profiled steps."""
    lo, hi = step_span(events) or (float("-inf"), float("inf"))
    return [(e, max(e.time_range.start, lo), min(e.time_range.end, hi)) for e in events
            if (is_device_work(e) if on_gpu else is_host_op(e)) and e.time_range.end > lo and e.time_range.start < hi]


def busy_seconds(events, on_gpu: bool) -> float:
    """Seconds within the profiled steps during which the GPU ran something (on_gpu false: some host op ran)."""
    return union_us((start, end) for _, start, end in work_in_steps(events, on_gpu)) / 1e6


def idle_under_host_ops(events, work=None, min_gap_us: float = MIN_GAP_US) -> list[tuple[str, float, int]]:
    """Where the GPU waited on the host: each gap longer than min_gap_us between the device's work within the profiled
    steps (work: work_in_steps(events, on_gpu=True), where the caller has it), put on the host op that overlaps it
    most (of equal overlaps the shortest op, the innermost), or on "(no host op)". (name, microseconds summed, gaps)
    by name, the most first."""
    lo, hi = step_span(events) or (float("-inf"), float("inf"))
    gaps, reached = [], lo
    for _, start, end in sorted(work if work is not None else work_in_steps(events, on_gpu=True), key=lambda w: w[1]):
        if start - reached > min_gap_us and reached > float("-inf"):
            gaps.append((reached, start))
        reached = max(reached, end)
    if hi - reached > min_gap_us and hi < float("inf"):
        gaps.append((reached, hi))
    hosts = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events if is_host_op(e)))
    found: dict[str, list] = defaultdict(lambda: [0.0, 0])
    active, i = [], 0
    for a, b in gaps:   # in order; `active`: the host ops begun before this gap that may still cover it
        while i < len(hosts) and hosts[i][0] < b:
            active.append(hosts[i])
            i += 1
        active = [h for h in active if h[1] > a]
        best = max(active, key=lambda h: (min(b, h[1]) - max(a, h[0]), h[0] - h[1]), default=None)
        name = best[2] if best is not None else "(no host op)"
        found[name][0] += b - a
        found[name][1] += 1
    return sorted(((n, us, k) for n, (us, k) in found.items()), key=lambda r: -r[1])


KINDS = ("matmuls (cuBLAS, CUTLASS)", "attention (flash, cuDNN SDPA)", "flame's kernels (kernels/)",
         "Inductor's kernels (triton_*)", "copies and memsets", "other (PyTorch's own: optimizer, reductions, casts)")
"""The summary's groups of device work, in its order."""


def device_kind(name: str, activity: str) -> str:
    """Which of KINDS a piece of device work is, by its kernel name (the names CUDA libraries, Inductor and our
    kernels get: Inductor's start with triton_; ours are the Triton functions of kernels/, _fwd_prep and the like,
    and its CUDA kernels, named flame_*)."""
    low = name.lower()
    if activity in ("gpu_memcpy", "gpu_memset"):
        return KINDS[4]
    if name.startswith("triton_"):
        return KINDS[3]
    if any(s in low for s in ("flash", "fmha", "sdpa")):
        return KINDS[1]
    if low.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "ampere_")) or any(
            s in low for s in ("gemm", "cutlass", "cublas", "splitkreduce")):
        return KINDS[0]
    if name.startswith("flame_") or (name.startswith("_") and not name.startswith("_Z")):   # (_Z: mangled C++)
        return KINDS[2]
    return KINDS[5]


def _name(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."


def summary(events, averages, busy: float, *, steps: range, marks: list[float], rank: int,
            device: torch.device) -> str:
    """The .txt file: wall and busy time, then the tables (events: prof.events(); averages: its key_averages();
    busy: busy_seconds(events, on_gpu))."""
    wall = marks[-1] - marks[0]
    on_gpu = device.type == "cuda"
    n = len(steps)
    which = f"step {steps[0]}" if n == 1 else f"steps {steps[0]}-{steps[-1]} ({n} optimizer steps)"
    lines = [f"profile of {which}, rank {rank}, {device}",
             "",
             f"{'wall time':<22}{wall:10.4f} s            host clock"
             + (", the device synchronized at both ends" if on_gpu else "")]
    lines += [f"  step {s:<15}{b - a:10.4f} s" for s, a, b in zip(steps, marks, marks[1:])]
    pct = 100 * busy / max(wall, 1e-12)
    if on_gpu:
        lines += [f"{'GPU busy':<22}{busy:10.4f} s {pct:6.1f} %   union of kernel, memcpy and memset intervals "
                  "(overlapping streams count once)",
                  f"{'GPU idle':<22}{wall - busy:10.4f} s {100 - pct:6.1f} %   nothing on the device: launch gaps, "
                  "host syncs, optimizer and data on the host, waits for other ranks"]
        work = work_in_steps(events, on_gpu=True)
        kinds = defaultdict(float)
        for e, start, end in work:
            kinds[getattr(e, "activity_type", "kernel")] += (end - start) / 1e6
        lines.append(f"{'device time, summed':<22}{sum(kinds.values()):10.4f} s            "
                     + ", ".join(f"{k} {v:.4f} s" for k, v in sorted(kinds.items()))
                     + " (more than busy where streams overlap)")
        by_kind = defaultdict(float)
        for e, start, end in work:
            by_kind[device_kind(e.name, getattr(e, "activity_type", "kernel"))] += end - start
        summed = sum(by_kind.values())
        lines += ["", "device time by kind, per step (summed over streams)",
                  f"{'device ms':>10} {'% summed':>9}  kind"]
        lines += [f"{by_kind[k] / 1e3 / n:10.3f} {100 * by_kind[k] / max(summed, 1e-12):8.1f}%  {k}"
                  for k in KINDS if k in by_kind]
        lines += ["", f"top {TOP_DEVICE} kernels, copies and memsets by device time",
                  f"{'device ms':>10} {'% busy':>7} {'calls':>7}  name"]
        per_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
        for e, start, end in work:
            per_name[e.name][0] += end - start
            per_name[e.name][1] += 1
        for name, (us, calls) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_DEVICE]:
            lines.append(f"{us / 1e3:10.3f} {100 * us / 1e6 / max(busy, 1e-12):6.1f}% {calls:7d}  {_name(name)}")
        lines += ["", f"GPU idle in gaps longer than {MIN_GAP_US:.0f} us, by the host op over each (the longest "
                  "overlap: what the host ran while the GPU waited)",
                  f"{'idle ms':>10} {'% wall':>7} {'gaps':>7}  host op"]
        for name, us, gaps in idle_under_host_ops(events, work)[:TOP_IDLE]:
            lines.append(f"{us / 1e3:10.3f} {us / 1e4 / max(wall, 1e-12):6.1f}% {gaps:7d}  {_name(name)}")
    else:
        lines += [f"{'busy (CPU ops)':<22}{busy:10.4f} s {pct:6.1f} %   union of the op intervals of all threads",
                  f"{'outside ops':<22}{wall - busy:10.4f} s {100 - pct:6.1f} %   Python, data, logging, waits"]
    host = sorted((a for a in averages if a.device_type == torch.autograd.DeviceType.CPU
                   and not a.is_user_annotation), key=lambda a: -a.self_cpu_time_total)
    top_host = TOP_HOST if on_gpu else TOP_DEVICE
    lines += ["", f"top {top_host} host ops by self CPU time",
              f"{'self ms':>10} {'% wall':>7} {'calls':>7}  name"]
    for a in host[:top_host]:
        lines.append(f"{a.self_cpu_time_total / 1e3:10.3f} {a.self_cpu_time_total / 1e4 / max(wall, 1e-12):6.1f}% "
                     f"{a.count:7d}  {_name(a.key)}")
    ranges = sorted((a for a in averages if a.is_user_annotation and a.device_type == torch.autograd.DeviceType.CPU
                     and not a.key.startswith("ProfilerStep")), key=lambda a: -a.cpu_time_total)
    if ranges:
        lines += ["", f"top {TOP_RANGES} annotated host ranges (record_function) by total CPU time",
                  f"{'cpu ms':>10} " + (f"{'device ms':>10} " if on_gpu else "") + f"{'calls':>7}  name"]
        for a in ranges[:TOP_RANGES]:
            device_ms = f"{a.device_time_total / 1e3:10.3f} " if on_gpu else ""
            lines.append(f"{a.cpu_time_total / 1e3:10.3f} {device_ms}{a.count:7d}  {_name(a.key)}")
    return "\n".join(lines) + "\n"
