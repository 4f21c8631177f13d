"""Output loss benchmark (kernels/cross_entropy): our fused linear + cross entropy beside the checkpointed chunk path
it replaced, Liger-Kernel's fused linear cross entropy and Apple's Cut Cross-Entropy, on the same inputs and GPU.

    python benchmarks/bench_loss.py                                # N = 8*4096 tokens, D = 1280 and 1024, V = 50304
    python benchmarks/bench_loss.py --tokens 16384 --dims 2048 --vocab 65536 --chunk 8192

All take bf16 hidden [N, D] and weight [V, D] and return the sum of the token losses (reduction "sum"). Per row:
fwd+bwd ms (CUDA events, median of --reps after --warmup), the peak memory a fwd+bwd allocates above its inputs
(MiB; the gradients included), and the max abs error of the loss, d hidden and d weight against an fp32 reference
(the same bf16 inputs taken to fp32, fp32 logits without tf32, F.cross_entropy; L2Wrap rows add its gradient).
A library that is not installed, or fails, gets its row with the reason instead of figures.
`--device cpu` runs the plumbing at a small shape (our PyTorch path; the libraries' Triton code needs a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cross_entropy import linear_cross_entropy_sum  # noqa: E402

IGNORE_INDEX = -100
L2WRAP_FACTOR = 1e-4


# The output loss flame used before kernels/cross_entropy, kept here as the baseline: per chunk of tokens, under
# checkpoint, bf16 logits -> fp32 copy -> F.cross_entropy (+ L2Wrap by autograd of max); backward recomputes the
# chunk's matmul (4 matmuls in all and fp32 copies of each chunk's logits).
def _max_logit_pull(logits, labels):
    top = logits.max(dim=-1).values.masked_fill(labels == IGNORE_INDEX, 0.0)
    pull = 0.5 * L2WRAP_FACTOR * top.square().sum()
    return pull - pull.detach()


def _old_chunk_loss_sum(hidden, weight, labels, l2wrap):
    logits = (hidden @ weight.t()).float()
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss + _max_logit_pull(logits, labels) if l2wrap else loss


def old_loss_sum(hidden, weight, labels, chunk_size, l2wrap):
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
        total = total + checkpoint(_old_chunk_loss_sum, h, weight, y, l2wrap, use_reentrant=False)
    return total


def reference(hidden, weight, labels, l2wrap, chunk_size):
    """(loss, d hidden, d weight) in fp32 from fp32 logits, chunk by chunk (each chunk's backward right away, so
    memory holds one chunk of fp32 logits)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h = hidden.float().requires_grad_(True)
        w = weight.float().requires_grad_(True)
        total = 0.0
        for start in range(0, h.shape[0], chunk_size):
            loss = _old_chunk_loss_sum(h[start:start + chunk_size], w, labels[start:start + chunk_size], l2wrap)
            loss.backward()
            total += loss.item()
        return torch.tensor(total, dtype=torch.float64), h.grad, w.grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def implementations(chunk_size):
    """(name, note, fn(hidden, weight, labels) -> loss sum, or the reason it cannot run, l2wrap)."""
    rows = [
        ("old: checkpointed chunks", f"chunk {chunk_size}",
         lambda h, w, y: old_loss_sum(h, w, y, chunk_size, False), False),
        ("ours", f"chunk {chunk_size}", lambda h, w, y: linear_cross_entropy_sum(h, w, y, chunk_size), False),
        ("old + L2Wrap", f"chunk {chunk_size}", lambda h, w, y: old_loss_sum(h, w, y, chunk_size, True), True),
        ("ours + L2Wrap", f"chunk {chunk_size}",
         lambda h, w, y: linear_cross_entropy_sum(h, w, y, chunk_size, L2WRAP_FACTOR), True),
    ]
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
        rows.append(("Liger-Kernel", "LigerFusedLinearCrossEntropyLoss", lambda h, w, y: liger(w, h, y), False))
    except ImportError as e:
        rows.append(("Liger-Kernel", "", f"not installed ({e})", False))
    try:
        from cut_cross_entropy import linear_cross_entropy
        rows.append(("Cut Cross-Entropy", "default filter_eps (gradient filtering)",
                     lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, reduction="sum"), False))
        rows.append(("Cut Cross-Entropy", "filter_eps=None (exact)",
                     lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, reduction="sum",
                                                          filter_eps=None), False))
    except ImportError as e:
        rows.append(("Cut Cross-Entropy", "", f"not installed ({e})", False))
    return rows


def timed(fn, hidden, weight, labels, warmup, reps):
    """(median fwd+bwd ms, peak MiB above the inputs, loss, d hidden, d weight)."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    cuda = h.is_cuda

    def step():
        h.grad = w.grad = None
        loss = fn(h, w, labels)
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    h.grad = w.grad = None
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    h.grad = w.grad = None
    peak = float("nan")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss = step()
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), peak, loss.detach(), h.grad, w.grad


def inputs(N, D, V, device, seed=0):
    """bf16 hidden ~ N(0, 1) (a normed hidden state), weight of std 2 / sqrt(D) (logits of std ~2), 5% of the
    labels ignored."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(N, D, device=device, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(V, D, device=device, generator=gen) * (2 / D ** 0.5)).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device=device, generator=gen)
    labels[torch.rand(N, device=device, generator=gen) < 0.05] = IGNORE_INDEX
    return hidden, weight, labels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8 * 4096, help="N, tokens per call (8 sequences of 4096)")
    p.add_argument("--dims", type=int, nargs="+", default=[1280, 1024], help="hidden sizes D")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of ours and of the old path")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_loss: no CUDA GPU (use --device cpu for a plumbing run at a small shape)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}; N = {args.tokens}, V = {args.vocab}, bf16, "
          f"median of {args.reps} fwd+bwd after {args.warmup} warm-up\n")
    print("| D | implementation | note | fwd+bwd ms | peak MiB | loss abs err | d hidden max abs err "
          "| d weight max abs err |\n|---|---|---|---|---|---|---|---|")
    for D in args.dims:
        hidden, weight, labels = inputs(args.tokens, D, args.vocab, device)
        refs = {wrap: reference(hidden, weight, labels, wrap, args.chunk) for wrap in (False, True)}
        for impl, note, fn, wrap in implementations(args.chunk):
            if isinstance(fn, str):
                print(f"| {D} | {impl} | {note} | {fn} | | | | |")
                continue
            try:
                ms, peak, loss, dh, dw = timed(fn, hidden, weight, labels, args.warmup, args.reps)
            except Exception as e:  # noqa: BLE001 (a library failing on this device or version: say so, go on)
                print(f"| {D} | {impl} | {note} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} "
                      f"| | | | |")
                continue
            ref_loss, ref_dh, ref_dw = refs[wrap]
            err = lambda x, y: (x.double() - y.double()).abs().max().item()  # noqa: E731
            loss_err = abs(loss.double().item() - ref_loss.item())
            print(f"| {D} | {impl} | {note} | {ms:.2f} | {peak:.0f} | {loss_err:.3g} | {err(dh, ref_dh):.3g} "
                  f"| {err(dw, ref_dw):.3g} |")
            del dh, dw
        print(f"| {D} | (fp32 reference) | scale | | | loss {refs[False][0].item():.6g} "
              f"| max abs {refs[False][1].abs().max().item():.3g} | max abs {refs[False][2].abs().max().item():.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
