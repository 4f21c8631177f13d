"""Sample text from a model, one cached step per new token.

    python -m flame.generate MODEL --prompt "..." [--prompt "..." ...] [--prompts-file F] [--max-new-tokens N]
        [--temperature T] [--top-k K] [--top-p P] [--seed S] [--device cpu|cuda] [--dtype fp32|bf16] [--no-cuda-graph]

MODEL is anything flame.eval reads (a flame export, a flame run folder = its newest complete checkpoint, an FLA /
Hugging Face folder, an RWKV-LM .pth), its tokenizer with it. The prompts run together: `model.prefill` once, then
`model.decode` one token per sequence per step (a recurrent model carries its state, the Transformer its KV cache;
the prefix is never run again). Temperature 0 is greedy; otherwise softmax(logits / T) restricted to the top-k
tokens and then to the smallest set whose mass reaches top-p, drawn with a seeded generator. One prompt streams its
text as it comes; several print each prompt's text at the end, in order. A sequence stops at the tokenizer's eos.
--prompts-file holds one prompt per line. On CUDA the one-token step is replayed as a CUDA graph (--no-cuda-graph:
eager steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flame.data.tokenizer import WORLD_SEPARATOR, WorldTokenizer
from flame.eval import EvalError, load_model, load_tokenizer
from flame.export import ConvertError
from flame.models.transformer import Transformer


class GenerateError(ValueError):
    """Bad input to flame.generate: one line, exit code 2."""


# ------------------------------------------------------------------------------------------------------- sampling
@dataclass
class Sampling:
    temperature: float = 0.0
    """0 (or less): greedy, the argmax."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches p; 1 keeps all."""


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [B, V] with every token outside each row's k largest set to -inf (ties at the k-th value: the
    first k by topk's order)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    index = logits.topk(k, dim=-1).indices
    return torch.full_like(logits, float("-inf")).scatter(-1, index, logits.gather(-1, index))


def keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits [B, V] with every token outside each row's nucleus set to -inf: the most likely tokens, in order,
    up to and including the first at which their probability mass reaches p."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop = mass_before >= p  # the most likely token always stays (its mass before is 0)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of logits [B, V]: [B] long."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    logits = keep_top_p(keep_top_k(logits.float() / sampling.temperature, sampling.top_k), sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------------------------------- decoding
class GraphStep:
    """model.decode of one token per sequence, captured once as a CUDA graph and replayed: the cache is updated in
    place with static shapes (DECODE_API), so the graph's reads and writes stay valid. The caller's first steps
    run eagerly on a side stream (warm-up: lazy initialisations, allocator pools) before the capture."""

    def __init__(self, model, cache, batch: int, device: torch.device):
        self.model, self.cache = model, cache
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.eager_steps = 0
        self.host_deltas: dict[str, int | float] = {}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        if self.graph is None and self.eager_steps < 2:  # real steps, doubling as the warm-up
            self.eager_steps += 1
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits, _ = self.model.decode(self.ids, self.cache)
            torch.cuda.current_stream().wait_stream(stream)
            return logits
        if self.graph is None:
            self.capture()
        self.graph.replay()
        for name, delta in self.host_deltas.items():  # a replay runs no Python: advance them as decode would
            setattr(self.cache, name, getattr(self.cache, name) + delta)
        return self.logits

    def host_fields(self) -> dict[str, int | float]:
        """The cache's numbers kept on the host (a Transformer's longest length), which decode's Python advances."""
        if not dataclasses.is_dataclass(self.cache):
            return {}
        values = {f.name: getattr(self.cache, f.name) for f in dataclasses.fields(self.cache)}
        return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def capture(self) -> None:
        # Capturing records the kernels without running them, yet runs decode's Python once: the host fields
        # must not count that step, and each replay advances them by what that one call did.
        before = self.host_fields()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits, _ = self.model.decode(self.ids, self.cache)
        after = self.host_fields()
        self.host_deltas = {k: after[k] - before[k] for k in before if after[k] != before[k]}
        for name, value in before.items():
            setattr(self.cache, name, value)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
             generator: torch.Generator | None = None, eos_id: int | None = None, cuda_graph: bool = False,
             on_tokens: Callable[[list[int | None]], None] | None = None) -> list[list[int]]:
    """The new tokens of each prompt (up to and including its eos): prefill the prompts, then one decode step
    per token. on_tokens gets each step's tokens, None for a sequence that has already stopped."""
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    longest = max(len(p) for p in prompts) + max_new_tokens
    if isinstance(model, Transformer):  # every slot up front: the decode steps never reallocate the cache
        logits, cache = model.prefill(prompts, max_len=longest)
    else:
        logits, cache = model.prefill(prompts)
    device = logits.device
    step = GraphStep(model, cache, len(prompts), device) if cuda_graph else (lambda ids: model.decode(ids, cache)[0])
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for i in range(max_new_tokens):
        tokens = sample(logits.float(), sampling, generator)
        host = tokens.tolist()
        fresh: list[int | None] = []
        for b, t in enumerate(host):
            fresh.append(None if done[b] else t)
            if not done[b]:
                out[b].append(t)
                done[b] = t == eos_id
        if on_tokens is not None:
            on_tokens(fresh)
        if all(done) or i == max_new_tokens - 1:
            break
        logits = step(tokens[:, None])[:, -1]
    return out


class StreamPrinter:
    """Prints one sequence's text as its tokens come: the decoded text's new suffix, held back while it ends in an
    incomplete UTF-8 character (decoded as U+FFFD) that the next token may complete."""

    def __init__(self, tokenizer, file=None):
        self.tokenizer, self.file = tokenizer, file or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens: list[int | None]) -> None:
        if tokens[0] is None:
            return
        self.ids.append(tokens[0])
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        print(text[self.printed:], end="", file=self.file, flush=True)
        self.printed = len(text)

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids)
        print(text[self.printed:], file=self.file, flush=True)


# ---------------------------------------------------------------------------------------------------------- CLI
def read_prompts(prompts: list[str], prompts_file: str | None) -> list[str]:
    texts = list(prompts)
    if prompts_file is not None:
        try:
            texts += [line for line in Path(prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"--prompts-file {prompts_file}: cannot be read ({type(e).__name__})") from None
    if not texts:
        raise GenerateError("no prompt: give --prompt TEXT or --prompts-file FILE")
    return texts


def encode_prompts(tokenizer, texts: list[str], trained_length: int | None, model) -> list[list[int]]:
    prompts = tokenizer.encode_batch(texts)
    for i, (text, ids) in enumerate(zip(texts, prompts)):
        if not ids:
            raise GenerateError(f"prompt {i + 1} ({text!r}): empty, no token to start from")
        if isinstance(model, Transformer) and trained_length is not None and len(ids) > trained_length:
            raise GenerateError(f"prompt {i + 1}: {len(ids)} tokens, longer than the {trained_length} the "
                                f"Transformer was trained on")
    return prompts


def eos_of(tokenizer, eos_token: str) -> int | None:
    if isinstance(tokenizer, WorldTokenizer):
        return tokenizer.eos_id
    return tokenizer.tokenizer.token_to_id(eos_token)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flame.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="flame export or run folder, FLA / Hugging Face folder, or RWKV-LM .pth")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--prompts-file", default=None, help="a text file of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of mass p (1: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-token", default=WORLD_SEPARATOR, help="the token that ends a sequence, if the "
                                                                "tokenizer has it")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec overriding the model's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the one-token step as a CUDA graph (default: on with --device cuda, where an eager "
                        "step is bound by kernel launches)")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens: expected an integer >= 1, got {a.max_new_tokens}")
    if a.top_k < 0:
        raise GenerateError(f"--top-k: expected an integer >= 0, got {a.top_k}")
    if not 0 < a.top_p <= 1:
        raise GenerateError(f"--top-p: expected a number in (0, 1], got {a.top_p}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA device here")
    if a.cuda_graph and a.device != "cuda":
        raise GenerateError("--cuda-graph needs --device cuda")
    if a.cuda_graph is None:
        a.cuda_graph = a.device == "cuda"
    return a


def main(argv: list[str] | None = None) -> None:
    try:
        a = parse_args(argv)
        texts = read_prompts(a.prompt, a.prompts_file)
        model, loaded = load_model(a.model, a.device)
        tokenizer = load_tokenizer(loaded, a.model, a.tokenizer, eos_token=None)
        prompts = encode_prompts(tokenizer, texts, loaded.seq_len, model)
    except (GenerateError, EvalError, ConvertError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:  # weights that do not fit the model's own config
        print(f"error: {a.model}: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    generator = torch.Generator(device=a.device).manual_seed(a.seed)
    sampling = Sampling(a.temperature, a.top_k, a.top_p)
    printer = StreamPrinter(tokenizer) if len(prompts) == 1 else None
    if printer is not None:
        print(texts[0], end="", flush=True)
    out = generate(model, prompts, a.max_new_tokens, sampling, generator=generator,
                   eos_id=eos_of(tokenizer, a.eos_token), cuda_graph=a.cuda_graph, on_tokens=printer)
    if printer is not None:
        printer.close()
        return
    for i, (text, new) in enumerate(zip(texts, out)):
        print(f"--- prompt {i + 1}\n{text}{tokenizer.decode(new)}")


if __name__ == "__main__":
    main()
