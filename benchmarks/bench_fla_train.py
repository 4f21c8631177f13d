"""FLA's own model, trained for a few steps on one GPU the way benchmarks/bench_train.py runs ours: one JSON line.

    python benchmarks/bench_fla_train.py configs/rwkv7_0.6B.toml --steps 30 [--activation-checkpoint] [--section.key=v ...]
    python benchmarks/bench_fla_train.py configs/gsa_tiny.toml --check

The model is FLA's RWKV7ForCausalLM or GSAForCausalLM with the config that `python -m flame.convert --to fla` writes
for this flame model (flame/convert_fla.py), fresh weights, FLA's default fused norms and cross entropy, and our L2Wrap
setting. Its best single-GPU setting: fp32 weights under bf16 autocast (as our FSDP mixed precision keeps fp32 master
weights and computes in bf16), fused AdamW with the config's settings, gradient clipping, the config's micro-batch and
accumulation, on flame's synthetic token stream (the same batches as our rows; the loss is the mean over every target
token of the step, as ours). --activation-checkpoint turns on FLA's own (Hugging Face) gradient checkpointing.

Figures come from the second half of the steps, as bench_train's: the median step. time_to_first_step_sec runs from
this script's start to the end of step 1: imports, building the model, and FLA's Triton autotuning, which happens on
its first steps; first_step_sec is step 1 alone (the autotuning and FLA's kernel compiles, plus one step).
FLA's autotune results are kept in Triton's cache (TRITON_CACHE_AUTOTUNING=1 unless set otherwise), so a run cut
short by bench_train's --timeout still saves the kernels it finished tuning and a later run resumes from there.
MFU counts the FLOPs per token of the matching flame model, so that it compares with our rows.
--check builds the FLA model on the CPU and prints its parameter count beside flame's; it trains nothing.
On failure the line is {"error": ...} ("out of memory" for a CUDA OOM) and the exit code 1.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# before Triton is imported: FLA's autotuning (minutes cold at 0.6B) is cached with the compiled kernels
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

CONFIG_CLASSES = {"RWKV7ForCausalLM": "RWKV7Config", "GSAForCausalLM": "GSAConfig"}


def fla_model(cfg, device: str):
    """FLA's counterpart of flame model `cfg.model`, built on `device` in fp32 (fresh weights)."""
    import torch

    import fla.models
    from flame.convert_fla import LAYOUTS

    layout = next((x for x in LAYOUTS.values() if x.flame_name == cfg.model.name), None)
    if layout is None:
        raise ValueError(f"model.name = {cfg.model.name!r} has no FLA counterpart (FLA models: "
                         f"{', '.join(x.flame_name for x in LAYOUTS.values())})")
    fields = layout.config(cfg.model)
    fields.update(dtype="float32", use_cache=False, use_l2warp=bool(getattr(cfg.model, "l2wrap", False)))
    for key in ("model_type", "architectures"):
        fields.pop(key)
    config = getattr(fla.models, CONFIG_CLASSES[layout.architecture])(**fields)
    with torch.device(device):
        return getattr(fla.models, layout.architecture)(config), layout.architecture


def flame_counts(cfg) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of the flame model, built on the meta device."""
    import torch

    from flame.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    return model.num_params(), model.flops_per_token(cfg.training.seq_len)


def train(cfg, steps: int, activation_checkpoint: bool) -> dict:
    import torch

    from flame.data.synthetic import SyntheticLoader
    from flame.loss import IGNORE_INDEX
    from flame.metrics import peak_flops

    t, o = cfg.training, cfg.optimizer
    device = torch.device("cuda")
    torch.manual_seed(t.seed)
    model, architecture = fla_model(cfg, "cuda")
    model.train()
    if activation_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)
    loader = SyntheticLoader(seq_len=t.seq_len, batch_size=t.batch_size, grad_accum=t.gradient_accumulation_steps,
                             dp_rank=0, dp_world=1, seed=t.seed, vocab_size=cfg.model.vocab_size)
    _, flops_per_token = flame_counts(cfg)
    warmup = steps // 2
    first_step = first_step_alone = None
    step_times = []
    torch.cuda.synchronize()
    for step in range(1, steps + 1):
        start = time.perf_counter()
        micro_batches = [next(loader) for _ in range(t.gradient_accumulation_steps)]
        targets = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            ids, labels = mb["input_ids"].to(device), mb["labels"].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = model.model(input_ids=ids, use_cache=False)[0]
                # FLA's own loss path (fused cross entropy, L2Wrap) on our labels, which are already shifted (the
                # model's forward would shift them again); summed and divided by the step's target count, as ours
                loss, _ = model._compute_logits_and_loss(hidden_states=hidden, shift_labels=labels,
                                                         num_items_in_batch=targets)
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss = loss_sum.item()  # one host sync per step, as our trainer's
        if step == 1:
            first_step = time.perf_counter() - STARTED
            first_step_alone = time.perf_counter() - start
        if step > warmup:
            step_times.append(time.perf_counter() - start)
    # the median step, as bench_train's rows
    per_device = t.gradient_accumulation_steps * t.batch_size * t.seq_len / statistics.median(step_times)
    peak = peak_flops(cfg.metrics.peak_tflops, device)
    return {"model": architecture, "fla_version": fla_version(), "activation_checkpoint": activation_checkpoint,
            "tokens_per_sec_per_device": per_device,
            "mfu": None if peak is None else 100.0 * per_device * flops_per_token / peak,
            "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30, "time_to_first_step_sec": first_step,
            "first_step_sec": first_step_alone, "loss": last_loss}


def fla_version() -> str:
    import importlib.metadata

    for dist in ("flash-linear-attention", "fla-core"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def check(cfg) -> dict:
    model, architecture = fla_model(cfg, "cpu")
    params, _ = flame_counts(cfg)
    return {"model": architecture, "fla_params": sum(p.numel() for p in model.parameters()), "flame_params": params}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--activation-checkpoint", action="store_true")
    p.add_argument("--check", action="store_true", help="build the model on the CPU and compare parameter counts")
    a, overrides = p.parse_known_args()
    from flame.config import ConfigError, load_config

    try:
        cfg = load_config(a.config, [o for o in overrides if o != "--"])
    except ConfigError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    if a.steps < 2:
        print(json.dumps({"error": "--steps must be at least 2 (the second half is measured)"}))
        return 2
    try:
        if a.check:
            result = check(cfg)
        else:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("FLA's Triton kernels need a GPU")
            result = train(cfg, a.steps, a.activation_checkpoint)
    except Exception as e:  # the caller prints a table: one line says why this row is missing
        import torch

        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        print(json.dumps({"error": "out of memory" if oom else f"{type(e).__name__}: {e}".splitlines()[0][:300]}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
