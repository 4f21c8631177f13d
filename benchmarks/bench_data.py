"""Tokens per second of the training loader on the bundled sample, with 0, 1, 2 and 4 dataloader workers.

    python benchmarks/bench_data.py [--seq-len 2048] [--batch-size 8] [--batches 60] [--workers 0 1 2 4]
                                 [--tokenizer rwkv-world]

Sources: data/sample/pile (0.8) and data/sample/webtext (0.2), shuffle buffer 1000 documents; the GPT-NeoX
tokenizer, or --tokenizer (any data.tokenizer spec: "rwkv-world" is RWKV's World tokenizer).
"startup" is the time to the first batch (worker start, tokenizer load, filling the shuffle buffer); tokens/s is
measured after it, over --batches micro-batches. Workers run one tokenizer thread each; 0 workers tokenizes in
this process with the tokenizer's own thread pool. Compare with the rate one GPU consumes: a 0.6B model at
~40% MFU on an H100 trains on roughly 1e15 * 0.4 / (6 * 0.6e9) ~ 1e5 tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.data import build_train_loader  # noqa: E402
from flame.data.config import DataConfig, SourceConfig  # noqa: E402


def measure(workers: int, args) -> tuple[float, float]:
    cfg = DataConfig(sources=[SourceConfig(path="data/sample/pile/*.jsonl.zst", weight=0.8),
                              SourceConfig(path="data/sample/webtext/*.parquet", weight=0.2)],
                     num_workers=workers, shuffle_buffer=args.shuffle_buffer, varlen=args.varlen)
    if args.tokenizer:
        cfg.tokenizer = args.tokenizer
    cfg.validate()
    start = time.perf_counter()
    loader = build_train_loader(cfg, seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=1, dp_rank=0,
                                dp_world=1, seed=0, vocab_size=50304)
    next(loader)
    startup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.batches):
        next(loader)
    elapsed = time.perf_counter() - start
    del loader
    return startup, args.batches * args.batch_size * args.seq_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    parser.add_argument("--varlen", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--tokenizer", default="", help="a data.tokenizer spec (default: the config's GPT-NeoX)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # 4 workers on a 2-core machine
    print(f"cpus: {os.cpu_count()}  seq_len {args.seq_len}  batch {args.batch_size}  batches {args.batches}  "
          f"shuffle_buffer {args.shuffle_buffer}  varlen {args.varlen}  tokenizer {args.tokenizer or 'gpt-neox'}")
    print(f"{'workers':>7} | {'startup s':>9} | {'tokens/s':>10}")
    print(f"{'-' * 7}-+-{'-' * 9}-+-{'-' * 10}")
    for workers in args.workers:
        startup, rate = measure(workers, args)
        print(f"{workers:>7} | {startup:>9.2f} | {rate:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
