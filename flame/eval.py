"""Loss, perplexity and bits per byte of a model on held-out text.

    python -m flame.eval MODEL --data GLOB [--step N] [--max-tokens N] [--seq-len N] [--batch-size N]
        [--tokenizer SPEC] [--json]

MODEL is anything flame.convert reads (a flame export folder, a flame run folder = its newest complete checkpoint or
--step N, an FLA / Hugging Face folder, an RWKV-LM .pth); its tokenizer comes with it unless --tokenizer names one.
--data is a glob (or folder) of files in any format the data pipeline reads (jsonl, jsonl.zst, json.gz, parquet,
txt).

Tokens: the files are read in sorted order and their documents in file order; each document is followed by the eos
token, as in training. The token stream starts with one eos (as if a document had just ended), so the first token
of the first document is scored too. The stream is cut into windows of seq_len + 1 tokens that share their end
token, as training packs it: every token after the leading eos is a target exactly once, predicted from the
tokens before it in its window.

Bytes: a document counts the UTF-8 bytes of its text plus 1 for its eos (the boundary stands in for the separator
between documents). When --max-tokens cuts a document, it counts the bytes of the text its scored tokens cover
(up to the end of the last scored token's characters) and no eos byte.

Output (stdout): the tokens and bytes scored, loss in nats per token, perplexity exp(loss), and bits per byte =
total loss in nats / ln 2 / bytes, which compares models whose tokenizers differ: one `key: value` a line, or with
--json one JSON object of them, the model, its step (null where the source knows none) and the data glob. Bad input
is one line on stderr and exit code 2.

Several processes (torchrun, e.g. `NPROC=8 scripts/launch.sh -m flame.eval MODEL --data GLOB`): every rank reads and
tokenizes the whole stream and scores window i when i % world_size == rank, so the ranks together score exactly the
windows of one process; the loss, token and byte sums are all-reduced in fp64 (bytes from rank 0 alone: every rank
counts the whole stream). Each rank uses its LOCAL_RANK GPU with NCCL, or the CPU with gloo. Only rank 0 prints.
"""

from __future__ import annotations

if __name__ == "__main__":  # a rank started by scripts/launch.sh: end with the launcher
    from flame import lifeline

    lifeline.die_with_launcher()

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from flame.convert import read_model
from flame.data.config import SourceConfig
from flame.data.counters import Counters
from flame.data.sources import DocumentStream, NoDocumentError, SourcePlan, plan_source
from flame.data.tokenizer import WORLD_SEPARATOR, TextTokenizer, WorldTokenizer, open_tokenizer
from flame.errors import ConfigError
from flame.export import ConvertError, ModelState, load_weights, tokenizer_files
from flame.loss import IGNORE_INDEX
from flame.models import build_model


class EvalError(ValueError):
    """Bad input to flame.eval: one line, exit code 2."""


@dataclass
class EvalResult:
    tokens: int
    """Tokens scored (targets)."""
    bytes: int
    """UTF-8 bytes of the text those tokens cover (see the module docstring)."""
    loss_sum: float
    """Total cross entropy over the scored tokens, in nats."""

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.loss_sum / math.log(2) / self.bytes


# ------------------------------------------------------------------------------------------------------ inputs
def load_model(src: str, device: str | torch.device = "cpu", step: int | None = None) -> tuple[nn.Module, ModelState]:
    """The model of any source flame.convert reads (`step`: a run folder's checkpoint), in eval mode."""
    loaded = read_model(src, step)
    with torch.device("meta"):
        model = build_model(loaded.args)
    model = model.to_empty(device=device)
    load_weights(model, loaded.state, loaded.args)
    return model.eval(), loaded


def load_tokenizer(loaded: ModelState, src: str, spec: str | None,
                   eos_token: str) -> TextTokenizer | WorldTokenizer:
    """--tokenizer if given, else the tokenizer.json or World vocabulary that came with the model."""
    if spec is None:
        files = loaded.tokenizer
        chosen = files.get("tokenizer.json") or next((p for n, p in files.items() if n.startswith("rwkv_vocab")), None)
        if chosen is None:
            raise EvalError(f"{src}: holds no tokenizer ({loaded.tokenizer_note or 'none found'}); "
                            f"name one with --tokenizer")
        spec, what = str(chosen), f"{src}: tokenizer {chosen}"
    else:
        if not tokenizer_files(spec, "--tokenizer"):
            raise EvalError(f"--tokenizer {spec!r}: not a local tokenizer file or folder")
        what = f"--tokenizer {spec!r}"
    try:
        tokenizer = open_tokenizer(spec, eos_token=eos_token, bos_token=None)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EvalError(f"{what}: cannot be opened ({first})") from None
    vocab = getattr(loaded.args, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise EvalError(f"{what}: vocabulary {tokenizer.vocab_size} does not fit the model's {vocab}")
    return tokenizer


def file_plans(glob: str, text_field: str = "text") -> list[SourcePlan]:
    """One plan per matching file, in sorted order (a plan of several files would shuffle their order)."""
    try:
        plan = plan_source(SourceConfig(path=glob, text_field=text_field), "--data", 0)
    except ConfigError as e:
        raise EvalError(f"--data {glob!r}: {e.expected}") from None
    if plan.is_hub:
        raise EvalError(f"--data {glob!r}: hub datasets are not read here; give local files")
    return [SourcePlan(i, f"--data {path}", plan.config, [path], [fmt])
            for i, (path, fmt) in enumerate(zip(plan.files, plan.formats))]


def documents(plans: list[SourcePlan]) -> Iterator[str]:
    """Every usable document of the files once, in order (unusable records are skipped as in training)."""
    counters = Counters()
    for plan in plans:
        stream = DocumentStream(plan, reader=0, n_readers=1, seed=0, counters=counters)
        while True:
            try:
                text = stream.next()
            except NoDocumentError:  # a file with no usable document
                break
            if stream.epoch > 0:  # the stream has begun a second pass
                break
            yield text


# ---------------------------------------------------------------------------------------------------- accounting
def prefix_bytes(tokenizer: TextTokenizer | WorldTokenizer, text: str, ids: list[int], k: int) -> int:
    """UTF-8 bytes of the text covered by the first k of `ids` (the tokens of `text`)."""
    if k == 0:
        return 0
    if isinstance(tokenizer, WorldTokenizer):
        return sum(len(tokenizer.pieces[i]) for i in ids[:k])
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    end = encoding.offsets[k - 1][1]  # character offsets; a token that splits a character covers all of it
    return len(text[:end].encode("utf-8"))


def scored_tokens(tokenizer, texts: Iterator[str], max_tokens: int | None,
                  counted: list[int]) -> Iterator[int]:
    """The token stream (leading eos, then each document and its eos), stopping after max_tokens targets;
    counted[0] accumulates the bytes of what has been yielded as targets."""
    yield tokenizer.eos_id
    left = max_tokens if max_tokens is not None else -1
    batch: list[str] = []

    def flush():
        nonlocal left
        for text, ids in zip(batch, tokenizer.encode_batch(batch)):
            doc = ids + [tokenizer.eos_id]
            if 0 <= left < len(doc):
                counted[0] += prefix_bytes(tokenizer, text, ids, min(left, len(ids)))
                yield from doc[:left]
                left = 0
                return
            counted[0] += len(text.encode("utf-8")) + 1
            left -= len(doc) if left >= 0 else 0
            yield from doc
        batch.clear()

    for text in texts:
        if left == 0:
            return
        batch.append(text)
        if len(batch) == 32:
            yield from flush()
    if batch and left != 0:
        yield from flush()


def windows(tokens: Iterator[int], seq_len: int) -> Iterator[list[int]]:
    """Windows of up to seq_len + 1 tokens, each starting with the previous one's last token."""
    window = [next(tokens)]
    for t in tokens:
        window.append(t)
        if len(window) == seq_len + 1:
            yield window
            window = [t]
    if len(window) > 1:
        yield window


# ------------------------------------------------------------------------------------------------------- scoring
@torch.no_grad()
def evaluate(model: nn.Module, tokenizer, texts: Iterator[str], *, seq_len: int, batch_size: int,
             max_tokens: int | None = None, device: str | torch.device = "cpu", progress=None,
             rank: int = 0, world_size: int = 1) -> EvalResult:
    """This rank's share of the scores: window i when i % world_size == rank. `bytes` is the whole stream's (every
    rank reads all of it); `progress` gets the targets of every window passed, this rank's or not."""
    counted = [0]
    loss_sum, n_tokens, rows, passed = 0.0, 0, [], 0

    def run(rows):
        nonlocal passed
        inputs = torch.full((len(rows), seq_len), tokenizer.eos_id, dtype=torch.long)
        labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
        for b, w in enumerate(rows):  # a short last window is padded; causal models never see the padding
            inputs[b, :len(w) - 1] = torch.tensor(w[:-1])
            labels[b, :len(w) - 1] = torch.tensor(w[1:])
        loss = model(inputs.to(device), labels=labels.to(device))
        if progress is not None:
            progress(passed)
            passed = 0
        return float(loss), sum(len(w) - 1 for w in rows)

    stream = windows(scored_tokens(tokenizer, texts, max_tokens, counted), seq_len)
    for i, window in enumerate(stream):
        passed += len(window) - 1
        if i % world_size != rank:
            continue
        rows.append(window)
        if len(rows) == batch_size:
            s, n = run(rows)
            loss_sum, n_tokens, rows = loss_sum + s, n_tokens + n, []
    if rows:
        s, n = run(rows)
        loss_sum, n_tokens = loss_sum + s, n_tokens + n
    if progress is not None and passed:
        progress(passed)
    return EvalResult(n_tokens, counted[0], loss_sum)


def job_layout(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device): the torchrun job's when WORLD_SIZE > 1, else (0, 1, device). Joins
    nothing: every rank checks its inputs before join_job, so that a rank failing on bad input never leaves another
    inside the process group's setup, where it would fail with a traceback."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, torch.device(device)
    rank = int(os.environ["RANK"])
    if torch.device(device).type == "cuda":
        local = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(local)
        return rank, world_size, local
    return rank, world_size, torch.device(device)


def join_job(device: torch.device) -> None:
    """The process group of a job of several ranks (job_layout)."""
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def all_reduce(result: EvalResult, rank: int, device: torch.device) -> EvalResult:
    """The job's totals: sums of loss and tokens over the ranks; bytes from rank 0 (each rank counts all of them)."""
    sums = torch.tensor([result.loss_sum, result.tokens, result.bytes if rank == 0 else 0],
                        dtype=torch.float64, device=device)  # fp64 holds integers exactly up to 2**53
    dist.all_reduce(sums)
    loss_sum, tokens, n_bytes = sums.tolist()
    return EvalResult(round(tokens), round(n_bytes), loss_sum)


def progress_bar(total: int | None):
    """A callable taking the tokens just scored, and a close(); tqdm on stderr if installed, else a counter."""
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def update(n):
            done[0] += n
            print(f"\rscored {done[0]:,} tokens" + (f" of {total:,}" if total else ""), end="", file=sys.stderr)

        return update, lambda: print(file=sys.stderr) if done[0] else None
    bar = tqdm(total=total, unit="tok", unit_scale=True, file=sys.stderr, desc="eval")
    return bar.update, bar.close


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flame.eval",
                                description="Loss, perplexity and bits per byte of a model on held-out text.")
    p.add_argument("model", help="flame export or run folder, FLA / Hugging Face folder, or RWKV-LM .pth")
    p.add_argument("--data", required=True, help="glob or folder of jsonl, jsonl.zst, json.gz, parquet or txt files")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="a run folder's checkpoint step-N (default: its newest complete checkpoint)")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens (default: all)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec overriding the model's (as data.tokenizer)")
    p.add_argument("--eos-token", default=WORLD_SEPARATOR, help="the token that ends every document")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    a = p.parse_args(argv)
    rank_env = int(os.environ.get("RANK", "0"))  # known before the job is joined: only rank 0 says what went wrong

    def fail(message: str):
        if rank_env == 0:
            print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    try:
        for name in ("seq_len", "batch_size", "max_tokens"):
            value = getattr(a, name)
            if value is not None and value < 1:
                raise EvalError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value}")
        plans = file_plans(a.data, a.text_field)
        rank, world_size, device = job_layout(a.device)
        model, loaded = load_model(a.model, device, a.step)
        tokenizer = load_tokenizer(loaded, a.model, a.tokenizer, a.eos_token)
        if world_size > 1:
            join_job(device)
    except (EvalError, ConvertError) as e:
        fail(str(e))
    except ValueError as e:  # weights that do not fit the model's own config
        fail(f"{a.model}: {str(e).splitlines()[0]}")
    update, close = progress_bar(a.max_tokens) if rank == 0 else (None, lambda: None)
    result = evaluate(model, tokenizer, documents(plans), seq_len=a.seq_len, batch_size=a.batch_size,
                      max_tokens=a.max_tokens, device=device, progress=update, rank=rank, world_size=world_size)
    close()
    if world_size > 1:
        result = all_reduce(result, rank, device)
        dist.destroy_process_group()
    if result.tokens == 0:
        fail(f"--data {a.data!r}: no usable document")
    if rank == 0 and a.json:
        print(json.dumps({"model": a.model, "step": loaded.step, "data": a.data, "tokens": result.tokens,
                          "bytes": result.bytes, "loss": result.loss, "perplexity": result.perplexity,
                          "bits_per_byte": result.bits_per_byte}))
    elif rank == 0:
        print(f"tokens: {result.tokens}\nbytes: {result.bytes}\nloss: {result.loss:.6f}\n"
              f"perplexity: {result.perplexity:.4f}\nbits_per_byte: {result.bits_per_byte:.6f}")


if __name__ == "__main__":
    main()
