"""[profiling]: a real tiny run traces steps 2-3 into the run folder (a Chrome trace holding the model's ops, a summary
whose wall time covers its busy time) and trains exactly as without it; nothing is written when disabled or when
the window is never reached; the busy time is the union of the device's intervals, not their sum."""

import gzip
import json
import re

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from flame.config import ProfilingConfig
from flame.profiling import StepProfiler, busy_seconds, summary
from flame.train import main
from tests.helpers import exit_line, read_metrics, run_train, write_config

PROFILE_2_3 = ["--training.steps=4", "--profiling.enable=true", "--profiling.start_step=2", "--profiling.steps=2"]


def seconds(text: str, label: str) -> float:
    return float(re.search(rf"^{re.escape(label)}\s+([\d.]+) s", text, re.M).group(1))


def test_tiny_run_profiles_steps_2_and_3(tmp_path):
    path, dump = write_config(tmp_path)
    proc = run_train(path, *PROFILE_2_3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (dump / "profile").iterdir()) == ["step-2-3-rank0.json.gz", "step-2-3-rank0.txt"]
    assert "profile of steps 2-3 (rank 0: wall" in proc.stdout and str(dump / "profile") in proc.stdout

    trace = json.loads(gzip.decompress((dump / "profile" / "step-2-3-rank0.json.gz").read_bytes()))
    events = trace["traceEvents"]
    steps = {e["name"]: e for e in events if e["name"].startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#2", "ProfilerStep#3"]  # exactly the window, each step a range
    start = steps["ProfilerStep#2"]["ts"]
    end = steps["ProfilerStep#3"]["ts"] + steps["ProfilerStep#3"]["dur"]
    ops = [e for e in events if e.get("cat") == "cpu_op" and start <= e["ts"] <= end]
    names = {e["name"] for e in ops}
    assert {"aten::mm", "aten::scaled_dot_product_attention"} <= names  # the model's forward and backward ...
    assert any(n.startswith("Optimizer.step") for n in (e["name"] for e in events))  # ... and the optimizer

    text = (dump / "profile" / "step-2-3-rank0.txt").read_text()
    assert text.startswith("profile of steps 2-3 (2 optimizer steps), rank 0, cpu")
    wall, busy = seconds(text, "wall time"), seconds(text, "busy (CPU ops)")
    assert 0 < busy <= wall
    assert abs(seconds(text, "  step 2") + seconds(text, "  step 3") - wall) < 2e-4  # rounded to 0.1 ms
    host_ops = text.split("top 25 host ops by self CPU time")[1].split("\n\n")[0]
    assert "aten::mm" in host_ops and "Optimizer.step#AdamW.step" in text

    # the same run without profiling: no profile folder, no line about it, the same losses step by step
    path, plain = write_config(tmp_path, "plain")
    proc = run_train(path, *PROFILE_2_3, "--profiling.enable=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (plain / "profile").exists() and "profile of" not in proc.stdout and "profiling:" not in proc.stdout
    assert [r["loss"] for r in read_metrics(plain)] == [r["loss"] for r in read_metrics(dump)]


def step_loop(tmp_path, cfg: ProfilingConfig, *, next_step: int = 1, last_step: int = 4, write: bool = True):
    """Drive a StepProfiler as the train loop does, over steps next_step..last_step of a matmul; what it said."""
    said = []
    prof = StepProfiler(cfg, tmp_path, 0, torch.device("cpu"), next_step=next_step, last_step=last_step,
                        say=said.append)
    for step in range(next_step, last_step + 1):
        prof.before_step(step)
        torch.randn(32, 32) @ torch.randn(32, 32)
    prof.close(write=write)
    return said


def test_window_cut_by_the_end_of_training_or_never_reached(tmp_path):
    said = step_loop(tmp_path / "a", ProfilingConfig(enable=True, start_step=3, steps=5))
    assert sorted(p.name for p in (tmp_path / "a" / "profile").iterdir()) == [
        "step-3-4-rank0.json.gz", "step-3-4-rank0.txt"]  # steps 3-7 asked, training ends after 4
    assert len(said) == 1 and said[0].startswith("profile of steps 3-4")

    said = step_loop(tmp_path / "b", ProfilingConfig(enable=True, start_step=5))
    assert said == ["profiling: step 5 is past training.steps = 4; nothing is profiled (set profiling.start_step)"]
    said = step_loop(tmp_path / "c", ProfilingConfig(enable=True, start_step=2), next_step=3)  # a resumed run
    assert said == ["profiling: step 2 is already done: this run starts at step 3; nothing is profiled "
                    "(set profiling.start_step)"]
    assert step_loop(tmp_path / "d", ProfilingConfig(enable=True, start_step=4), write=False) == []  # an error
    assert step_loop(tmp_path / "e", ProfilingConfig(enable=False, start_step=2)) == []
    assert not any((tmp_path / x / "profile").exists() for x in "bcde")


def fake_event(name, start, end, activity="kernel"):
    on_host = activity in ("cpu_op", "user_annotation")
    event = FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, use_device="cuda",
                          device_type=DeviceType.CPU if on_host else DeviceType.CUDA,
                          is_user_annotation=activity.endswith("user_annotation"), stack=[], input_shapes=[])
    event.activity_type = activity  # newer torch sets it in the constructor, which in torch 2.11 has no such argument
    return event


def test_gpu_busy_is_the_union_of_device_intervals_within_the_steps():
    # two kernels overlapping on two streams, a copy, one kernel running past the last step, one before the first,
    # and the GPU-side range of the step (an annotation, not work): busy = 500 + 100 + 50 us of a 1000 us step
    events = EventList([fake_event("ProfilerStep*", 100, 1100, "user_annotation"),
                        fake_event("ProfilerStep#2", 100, 1100, "gpu_user_annotation"),
                        fake_event("gemm", 100, 400), fake_event("softmax", 300, 600),
                        fake_event("Memcpy HtoD", 700, 800, "gpu_memcpy"), fake_event("gemm", 1050, 1200),
                        fake_event("before", 0, 50), fake_event("aten::mm", 110, 150, "cpu_op")], use_device="cuda")
    events._build_tree()
    busy = busy_seconds(events, on_gpu=True)
    assert busy == pytest.approx(650e-6)
    text = summary(events, events.key_averages(), busy, steps=range(2, 3), marks=[0.0, 0.001], rank=0,
                   device=torch.device("cuda"))
    assert text.startswith("profile of step 2, rank 0, cuda")
    assert re.search(r"^GPU busy\s+[\d.]+ s\s+65.0 %", text, re.M) and re.search(r"^GPU idle\s+[\d.]+ s\s+35.0 %",
                                                                                text, re.M)
    kernels = text.split("by device time\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [line.split()[-1] for line in kernels] == ["gemm", "softmax", "HtoD"]
    assert kernels[0].split()[:3] == ["0.350", "53.8%", "2"]  # 300 us + the 50 us inside the step


def test_gpu_idle_gaps_go_to_the_host_op_over_them():
    # kernels leave gaps of 300, 20, 100 and 60 us within the step: the 300 us one lies under a backward node whose
    # children cover less of it, the 100 us one under two nested ops covering it alike (the inner one takes it), the
    # 20 us one is a launch's latency (not counted) and the 60 us one has no host op over it
    from flame.profiling import idle_under_host_ops

    events = EventList([fake_event("ProfilerStep*", 0, 1000, "user_annotation")]
                       + [fake_event("k", a, b) for a, b in ((0, 100), (400, 500), (520, 600), (700, 740), (800, 1000))]
                       + [fake_event(n, a, b, "cpu_op") for n, a, b in (
                           ("autograd::engine::evaluate_function: PostBackward", 90, 420), ("aten::copy_", 100, 150),
                           ("aten::add", 160, 200), ("aten::item", 500, 520), ("outer", 580, 720),
                           ("aten::to", 590, 710))], use_device="cuda")
    events._build_tree()
    assert idle_under_host_ops(events) == [("autograd::engine::evaluate_function: PostBackward", 300.0, 1),
                                           ("aten::to", 100.0, 1), ("(no host op)", 60.0, 1)]
    text = summary(events, events.key_averages(), busy_seconds(events, on_gpu=True), steps=range(2, 3),
                   marks=[0.0, 0.001], rank=0, device=torch.device("cuda"))
    rows = text.split("while the GPU waited)\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["0.300", "30.0%", "1"], ["0.100", "10.0%", "1"],
                                                 ["0.060", "6.0%", "1"]]
    assert rows[1].endswith("aten::to") and rows[2].endswith("(no host op)")


def test_device_time_by_kind():
    # one piece of work of each kind over two steps (per step: half), and names that only look like ours
    from flame.profiling import KINDS, device_kind
    work = [("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 100, 300, "kernel"),
            ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 300, 500, "kernel"),
            ("_fwd_prep", 500, 600, "kernel"), ("triton_poi_fused_add_0", 600, 650, "kernel"),
            ("Memcpy DtoD (Device -> Device)", 650, 700, "gpu_memcpy"),
            ("void at::native::reduce_kernel<128, 4>", 700, 750, "kernel")]
    assert [device_kind(n, a) for n, _, _, a in work] == list(KINDS)
    assert device_kind("_ZN2at6native18elementwise_kernelE", "kernel") == KINDS[5]
    assert device_kind("flame_rwkv7_fwd_scan", "kernel") == KINDS[2]   # our CUDA kernels
    assert device_kind("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu>", "kernel") == KINDS[0]
    events = EventList([fake_event("ProfilerStep*", 100, 1100, "user_annotation")]
                       + [fake_event(*w) for w in work], use_device="cuda")
    events._build_tree()
    text = summary(events, events.key_averages(), busy_seconds(events, on_gpu=True), steps=range(2, 4),
                   marks=[0.0, 0.0005, 0.001], rank=0, device=torch.device("cuda"))
    block = text.split("per step (summed over streams)\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [line.split(None, 2)[2] for line in block] == list(KINDS)
    assert [float(line.split()[0]) for line in block] == [0.1, 0.1, 0.05, 0.025, 0.025, 0.025]
    assert block[0].split()[1] == "30.8%"   # 200 of 650 us


@pytest.mark.parametrize("override,expected", [("--profiling.start_step=0", "an integer >= 1, got 0"),
                                               ("--profiling.steps=0", "an integer >= 1, got 0"),
                                               ("--profiling.enable=yes", "true or false, got 'yes'")])
def test_bad_profiling_value_is_one_line_exit_2(tmp_path, capsys, override, expected):
    path, dump = write_config(tmp_path)
    key = override[2:].split("=")[0]
    assert exit_line(capsys, main, ["--config", str(path), override]) == f"config error: {path}: {key}: expected {expected}"
    assert not dump.exists()
