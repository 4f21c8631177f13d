"""Cached generation speed: prefill time, decode tokens/s and time per new token, by batch size and prompt length.

    python benchmarks/bench_decode.py configs/transformer_0.6B.toml configs/rwkv7_0.6B.toml configs/gsa_0.6B.toml \\
        --batch 1 32 --prompt-len 40 4000 --new-tokens 128 [--cuda-graph]
    python benchmarks/bench_decode.py configs/transformer_tiny.toml --device cpu --batch 1 2 --prompt-len 8 32 \
        --new-tokens 4

Each CONFIG_OR_MODEL is a config (.toml: random weights, init_weights) or any model flame.eval reads. Random
prompt tokens; each new token is the previous step's argmax fed back, one model.decode per token as flame.generate
runs it. The first prefill and the first decode steps of each row (the CUDA graph's warm-up and capture with
--cuda-graph) are not timed.
A recurrent model's time per new token should not grow with the prompt; a Transformer's grows with its cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flame.config import load_config  # noqa: E402
from flame.eval import load_model  # noqa: E402
from flame.generate import GraphStep  # noqa: E402
from flame.models import build_model  # noqa: E402
from flame.models.transformer import Transformer  # noqa: E402

UNTIMED_STEPS = 3  # with --cuda-graph: two eager warm-up steps and the capture


def open_model(spec: str, device: str, dtype: torch.dtype):
    if spec.endswith(".toml"):
        args = load_config(spec).model
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build_model(args)
        model = model.to_empty(device=device)
        model.init_weights()
    else:
        model, _ = load_model(spec, device)
    return model.to(dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def bench(model, batch: int, prompt_len: int, new_tokens: int, device: str, cuda_graph: bool) -> dict:
    vocab = model.embed.weight.shape[0]
    g = torch.Generator().manual_seed(batch * 100003 + prompt_len)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    total = prompt_len + new_tokens + UNTIMED_STEPS
    for _ in range(2):   # the second prefill is timed: the first compiles the kernels for these shapes
        sync(device)
        start = time.perf_counter()
        if isinstance(model, Transformer):  # every slot up front, as flame.generate does
            logits, cache = model.prefill(prompts, max_len=total)
        else:
            logits, cache = model.prefill(prompts)
        sync(device)
        prefill_s = time.perf_counter() - start
    step = GraphStep(model, cache, batch, logits.device) if cuda_graph else (lambda ids: model.decode(ids, cache)[0])
    ids = logits.argmax(-1)[:, None]
    for _ in range(UNTIMED_STEPS):
        ids = step(ids)[:, -1].argmax(-1)[:, None]
    sync(device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        ids = step(ids)[:, -1].argmax(-1)[:, None]
    sync(device)
    decode_s = time.perf_counter() - start
    return {"prefill_ms": 1e3 * prefill_s, "tokens_per_s": batch * new_tokens / decode_s,
            "ms_per_token": 1e3 * decode_s / new_tokens}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="CONFIG_OR_MODEL")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[40, 4000])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--cuda-graph", action="store_true", help="replay the one-token step as a CUDA graph")
    a = p.parse_args(argv)
    if a.cuda_graph and a.device != "cuda":
        p.error("--cuda-graph needs --device cuda")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype or ("bf16" if a.device == "cuda" else "fp32")]
    header = f"{'model':<24} {'batch':>5} {'prompt':>6} {'prefill ms':>11} {'decode tok/s':>13} {'ms/new token':>13}"
    print(header)
    print("-" * len(header))
    for spec in a.models:
        model = open_model(spec, a.device, dtype)
        name = Path(spec).stem
        for batch in a.batch:
            for prompt_len in a.prompt_len:
                try:
                    r = bench(model, batch, prompt_len, a.new_tokens, a.device, a.cuda_graph)
                except torch.OutOfMemoryError:
                    print(f"{name:<24} {batch:>5} {prompt_len:>6} {'out of memory':>11}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                print(f"{name:<24} {batch:>5} {prompt_len:>6} {r['prefill_ms']:>11.1f} {r['tokens_per_s']:>13.1f} "
                      f"{r['ms_per_token']:>13.2f}", flush=True)
        del model
        if a.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
