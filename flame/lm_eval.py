"""lm-evaluation-harness model `flame`: any model flame reads, scored and sampled by lm-eval's own tasks and CLI.

    python -m flame.lm_eval --model flame --model_args pretrained=MODEL[,device=cuda,dtype=bf16,batch_size=N]
        --tasks TASKS [any other lm_eval argument: --include_path DIR, --num_fewshot N, --limit N, --output_path ...]

Needs lm-evaluation-harness (pip install 'lm-eval>=0.4.13,<0.5'; flame's test extra has it). MODEL is anything
flame.eval reads (a flame export or run folder, an FLA / Hugging Face folder, an RWKV-LM .pth); its tokenizer comes
with it. Other model_args: tokenizer=SPEC (overrides the model's), eos_token=TOKEN (the document boundary,
"<|endoftext|>" by default: the prefix of rolling log-likelihoods and of empty contexts, and a stop for
generation), max_length=N (the window, see below; default the training seq_len stored with the model, else 2048),
max_gen_toks=N (default 256). model_args win over the harness's own --batch_size / --device.

How the three request types run:
- loglikelihood: context + continuation in one forward pass, batched (rows right-padded: causal models never look
  at the padding); the continuation's summed log-probs and whether every token of it is the argmax.
- loglikelihood_rolling: a whole document after the eos token. The Transformer keeps to its trained length with
  lm-eval's rolling windows (every token predicted once, each window with as much context as fits). A recurrent
  model carries its state instead: the document runs through prefill and then decode(all_logits=True) window by
  window, so every token is conditioned on the whole document before it.
- generate_until: greedy, from model.prefill of the contexts and one model.decode step per token (constant time
  per token for the recurrent models, the KV cache for the Transformer), stopping at the eos token, at any of the
  task's `until` strings (cut off, as lm-eval expects) or after max_gen_toks tokens.
Requests longer than the window: the Transformer drops context tokens from the left (lm-eval's convention); the
recurrent models take them through the carried state (loglikelihood as rolling does, generation by prefill).

Offline: lm-eval's own tasks (hellaswag, lambada_openai, ...) download their data from the Hugging Face Hub on first
use (it stays in the datasets cache). Without network and without that cache the run stops with one line and exit
code 2, naming the dataset and the local task that needs no network: docs/lm_eval_task (LOCAL_TASK_DIR).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:
    if __name__ == "__main__":
        print("error: flame.lm_eval needs lm-evaluation-harness: pip install 'lm-eval>=0.4.13,<0.5' (flame's test "
              "extra has it)", file=sys.stderr)
        sys.exit(2)
    raise

from flame.data.tokenizer import WORLD_SEPARATOR
from flame.eval import EvalError, load_model, load_tokenizer
from flame.export import ConvertError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DEFAULT_WINDOW = 2048
LOCAL_TASK_DIR = Path(__file__).resolve().parents[1] / "docs" / "lm_eval_task"
"""The task that runs without network on a fresh clone (its README.md), named by its full path in messages so that
the command works from any folder."""


class LmEvalError(ValueError):
    """Bad model_args or a request flame cannot serve: one line, exit code 2."""


@dataclass
class Scored:
    """One sequence to score: the log-probs of its last n_scored tokens, each given every token before it."""

    tokens: list[int]
    n_scored: int


def positive_int(value, name: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise LmEvalError(f"model_args {name}: expected an integer >= 1, got {value!r}") from None
    if n < 1 or str(n) != str(value).strip():
        raise LmEvalError(f"model_args {name}: expected an integer >= 1, got {value!r}")
    return n


@register_model("flame")
class FlameLM(TemplateLM):
    def __init__(self, pretrained: str | None = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int | str = 1, max_length: int | None = None, max_gen_toks: int = 256,
                 tokenizer: str | None = None, eos_token: str = WORLD_SEPARATOR, max_batch_size=None,
                 trust_remote_code=None, **unknown):
        super().__init__()
        if unknown:
            raise LmEvalError(f"model_args: unknown key(s) {', '.join(sorted(unknown))} (known: pretrained, device, "
                              f"dtype, batch_size, max_length, max_gen_toks, tokenizer, eos_token)")
        if not pretrained:
            raise LmEvalError("model_args: pretrained=MODEL is required")
        if str(dtype) not in DTYPES:
            raise LmEvalError(f"model_args dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        self.batch_size = positive_int(batch_size, "batch_size")
        self.max_gen_toks = positive_int(max_gen_toks, "max_gen_toks")
        device = str(device) if device else ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            print(f"flame.lm_eval: device {device} is not available; running on cpu", file=sys.stderr)
            device = "cpu"
        self._device = torch.device(device)
        pretrained = str(pretrained)
        model, loaded = load_model(pretrained, self._device)
        self.model = model.to(DTYPES[str(dtype)])
        self.tokenizer = load_tokenizer(loaded, pretrained, tokenizer, eos_token)
        self.recurrent = loaded.args.name != "transformer"
        trained = getattr(loaded, "seq_len", None)
        self.max_length = positive_int(max_length, "max_length") if max_length is not None else \
            trained or DEFAULT_WINDOW

    # model_args (key=value on the command line) win over the harness's defaults for batch_size and device
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        defaults = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**defaults, **arg_dict})

    # ------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode_batch([string])[0]

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.score([Scored(context + continuation, len(continuation))
                              for _, context, continuation in requests], disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pieces, owner = [], []  # every scored piece, and the request it belongs to
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            if not tokens:
                continue
            if self.recurrent:
                pieces.append(Scored([self.eot_token_id] + tokens, len(tokens)))
                owner.append(i)
                continue
            for window in get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, context_len=1):
                context, predicted = make_disjoint_window(window)
                pieces.append(Scored(context + predicted, len(predicted)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score(pieces, disable_tqdm)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def score(self, items: list[Scored], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(summed log-prob, all greedy) of each item. Items of up to max_length inputs run in batched full forward
        passes; longer ones run through the recurrent state (recurrent models) or lose context tokens from the left
        (the Transformer). Batches hold items of similar lengths, longest first."""
        window = self.max_length
        full, carried = [], []
        for i, item in enumerate(items):
            if item.n_scored < 1:
                raise LmEvalError("a request scores no token (empty continuation)")
            if len(item.tokens) - 1 <= window:
                full.append(i)
            elif self.recurrent:
                carried.append(i)
            elif item.n_scored > window:
                raise LmEvalError(f"a continuation of {item.n_scored} tokens does not fit the Transformer's window "
                                  f"of {window} tokens (model_args max_length)")
            else:
                items[i] = Scored(item.tokens[-(window + 1):], item.n_scored)
                full.append(i)
        results: list[tuple[float, bool] | None] = [None] * len(items)
        batches = [(self.score_full, b) for b in self.batches(full, items)]
        batches += [(self.score_carried, b) for b in self.batches(carried, items)]
        for run, batch in tqdm(batches, desc="flame: scoring", disable=disable_tqdm or len(batches) < 2):
            for i, result in zip(batch, run([items[i] for i in batch])):
                results[i] = result
        return results

    def batches(self, indices: list[int], items: list[Scored]) -> list[list[int]]:
        ordered = sorted(indices, key=lambda i: -len(items[i].tokens))
        return [ordered[s:s + self.batch_size] for s in range(0, len(ordered), self.batch_size)]

    @torch.no_grad()
    def score_full(self, batch: list[Scored]) -> list[tuple[float, bool]]:
        lengths = [len(item.tokens) - 1 for item in batch]
        inputs = torch.full((len(batch), max(lengths)), self.eot_token_id, dtype=torch.long)
        for b, item in enumerate(batch):
            inputs[b, :lengths[b]] = torch.tensor(item.tokens[:-1])
        logits = self.model(inputs.to(self._device))
        return [scored_logprob(logits[b, n - item.n_scored:n], item.tokens[-item.n_scored:])
                for b, (item, n) in enumerate(zip(batch, lengths))]

    @torch.no_grad()
    def score_carried(self, batch: list[Scored]) -> list[tuple[float, bool]]:
        """Recurrent models: each row's inputs (tokens[:-1]) run as a prefill of up to one window (no further than
        its first scored position), then decode windows that carry the state. Logits are kept only where scored."""
        window = self.max_length
        inputs = [item.tokens[:-1] for item in batch]
        first = [len(x) - item.n_scored for x, item in zip(inputs, batch)]  # first scored input position
        done = [min(max(f, 1), window) for f in first]  # inputs consumed by the prefill
        last_logits, cache = self.model.prefill([x[:n] for x, n in zip(inputs, done)])
        kept: list[list[torch.Tensor]] = [[last_logits[b:b + 1]] if first[b] == 0 else [] for b in range(len(batch))]
        while any(n < len(x) for n, x in zip(done, inputs)):
            T = min(window, max(len(x) - n for n, x in zip(done, inputs)))
            step = torch.full((len(batch), T), self.eot_token_id, dtype=torch.long)
            spans = []  # the scored positions of each row inside this step
            for b, (x, n) in enumerate(zip(inputs, done)):
                piece = x[n:n + T]
                step[b, :len(piece)] = torch.tensor(piece, dtype=torch.long)
                spans.append((max(n, first[b]) - n, min(n + T, len(x)) - n))
            wanted = any(lo < hi for lo, hi in spans)
            logits, cache = self.model.decode(step.to(self._device), cache, all_logits=wanted)
            for b, (lo, hi) in enumerate(spans):
                if wanted and lo < hi:
                    kept[b].append(logits[b, lo:hi])
            done = [n + T for n in done]
        return [scored_logprob(torch.cat(kept[b]), item.tokens[-item.n_scored:]) for b, item in enumerate(batch)]

    # ----------------------------------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise LmEvalError(f"generate_until: flame generates greedily; the task asks for sampling "
                                  f"(do_sample={kwargs.get('do_sample')}, temperature={kwargs.get('temperature')})")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = positive_int(kwargs.get("max_gen_toks", self.max_gen_toks), "max_gen_toks")
            tokens = self.tok_encode(context) or [self.eot_token_id]
            if not self.recurrent:  # context and generated tokens within the trained length
                tokens = tokens[-max(1, self.max_length - max_new):]
                max_new = min(max_new, self.max_length - len(tokens))
            jobs.append((tokens, until, max_new))
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))
        results: list[str | None] = [None] * len(jobs)
        starts = range(0, len(order), self.batch_size)
        for s in tqdm(starts, desc="flame: generating", disable=disable_tqdm or len(starts) < 2):
            batch = order[s:s + self.batch_size]
            for i, text in zip(batch, self.greedy([jobs[i] for i in batch])):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    @torch.no_grad()
    def greedy(self, jobs: list[tuple[list[int], list[str], int]]) -> list[str]:
        """Greedy continuations of a batch of (context tokens, stop strings, max new tokens): one prefill, then one
        decode step per token for every row until all have stopped."""
        logits, cache = self.model.prefill([tokens for tokens, _, _ in jobs])
        generated: list[list[int]] = [[] for _ in jobs]
        texts = [""] * len(jobs)
        running = [max_new > 0 for _, _, max_new in jobs]
        while any(running):
            next_ids = logits.argmax(-1)
            for b, token in enumerate(next_ids.tolist()):
                if not running[b]:
                    continue
                _, until, max_new = jobs[b]
                if token == self.eot_token_id:
                    running[b] = False
                    continue
                generated[b].append(token)
                texts[b] = self.tok_decode(generated[b])
                if any(stop in texts[b] for stop in until) or len(generated[b]) >= max_new:
                    running[b] = False
            if not any(running):
                break
            logits, cache = self.model.decode(next_ids[:, None], cache)
            logits = logits[:, -1]
        return [cut_at_first(text, until) for text, (_, until, _) in zip(texts, jobs)]


def scored_logprob(logits: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
    """Summed log-prob of targets under logits [n, V] (fp32), and whether each target is the argmax."""
    logprobs = logits.float().log_softmax(-1)
    target = torch.tensor(targets, device=logits.device)
    total = logprobs.gather(-1, target[:, None]).double().sum()
    return float(total), bool((logprobs.argmax(-1) == target).all())


def cut_at_first(text: str, stops: list[str]) -> str:
    """text up to the earliest occurrence of any stop string."""
    cut = min((text.find(s) for s in stops if s and s in text), default=len(text))
    return text[:cut]


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own CLI with `flame` registered (importing this module registers it)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except (ConnectionError, *dataset_missing_errors()) as e:  # a hub task's data, neither reachable nor cached
        print(f"error: a task's data could not be loaded ({first_line(e)}): lm-eval's hub tasks download it on first "
              f"use, which needs network (then it stays in the datasets cache); offline, run a local task: "
              f"--include_path {LOCAL_TASK_DIR} --tasks flame_sample_mc ({LOCAL_TASK_DIR / 'README.md'})",
              file=sys.stderr)
        sys.exit(2)
    except (LmEvalError, EvalError, ConvertError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:  # lm-eval's own complaints (a task not found) and weights that do not fit the model
        print(f"error: {first_line(e)}", file=sys.stderr)
        sys.exit(2)


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def dataset_missing_errors() -> tuple[type[Exception], ...]:
    """What datasets and huggingface_hub raise for hub data that is neither cached nor reachable (offline mode, a
    file missing from the local cache), beside ConnectionError."""
    errors = []
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError
        errors.append(LocalEntryNotFoundError)
    except ImportError:
        pass
    try:
        from datasets.exceptions import DatasetNotFoundError
        errors.append(DatasetNotFoundError)
    except ImportError:
        pass
    return tuple(errors)


if __name__ == "__main__":
    main()
