"""The GPU's own time in kernels, for the benchmarks that time kernels rather than wall clock (bench_kernels,
bench_rwkv7_glue, bench_token_shift, profile_step): a call of one op alone is often host-bound (dispatch, autograd,
launches), so its wall time says little about the kernels it runs."""

from __future__ import annotations

import torch


def kernel_times(fn, *args) -> list[tuple[str, float, int]]:
    """(kernel name, ms, launches) of every kernel, copy and memset the GPU ran while fn(*args) ran, under the
    PyTorch profiler (CUDA activity only), the device synchronized before and after."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]


def gpu_ms(fn, *args) -> float:
    """The GPU's time in kernels while fn(*args) runs (their durations summed)."""
    return sum(ms for _, ms, _ in kernel_times(fn, *args))
