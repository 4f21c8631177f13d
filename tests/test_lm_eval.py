"""flame.lm_eval (the lm-evaluation-harness model `flame`) against plain references written here from the models'
full forward passes: the harness's accuracy and per-choice log-likelihoods on the local task in
tests/data/lm_eval_task, loglikelihood, generate_until against a greedy loop, rolling log-likelihood (the
Transformer's windows; a recurrent model's state carried across windows); a bad MODEL is one line, exit code 2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from flame.export import ModelState, write_export  # noqa: E402
from flame.lm_eval import FlameLM, main  # noqa: E402
from tests.helpers import EOS, REPO, byte_bpe, one_thread  # noqa: E402, F401  (one_thread: tiny matrices)
from tests.tiny_models import tiny_model, wake_branches  # noqa: E402

TASK_DIR = REPO / "tests" / "data" / "lm_eval_task"
ITEMS = [json.loads(line) for line in (TASK_DIR / "items.jsonl").read_text().splitlines()]
TEXT = ("the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. "
        "how many legs does a spider have? a baby cat is called a kitten. ")
WINDOW = 16


def tiny(kind: str):
    if kind == "transformer":
        model = tiny_model("transformer", vocab_size=320, hidden_size=64, num_layers=2, num_heads=2)
    elif kind == "rwkv7":  # RWKV-7 starts with zero output projections: make both branches matter
        model = wake_branches(tiny_model("rwkv7", vocab_size=320, hidden_size=64, num_layers=2, head_dim=16), 0.1)
    else:
        model = tiny_model("gsa", vocab_size=320, hidden_size=64, num_layers=2, num_heads=2, num_slots=16,
                           use_short_conv=True, initializer_range=0.05)
    return model.args, model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A BPE tokenizer trained on the task's text, and a tiny exported Transformer, RWKV-7 and GSA using it."""
    base = tmp_path_factory.mktemp("lm_eval")
    corpus = [TEXT] + [f"Question: {d['question']}\nAnswer: {' '.join(d['choices'])}" for d in ITEMS]
    tok = byte_bpe(corpus, base / "tokenizer.json")
    out = {}
    for kind in ("transformer", "rwkv7", "gsa"):
        args, model = tiny(kind)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        export = write_export(base / kind, ModelState(args, state, "test",
                                                      tokenizer={"tokenizer.json": base / "tokenizer.json"}))
        out[kind] = (export, model)
    return base, tok, out


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@torch.no_grad()
def reference_loglikelihood(model, tokens: list[int], n_scored: int) -> tuple[float, bool]:
    """The last n_scored tokens' summed log-probs from one forward pass over all the tokens before them."""
    logits = model(torch.tensor([tokens[:-1]]))[0, -n_scored:].double()
    logprobs = logits.log_softmax(-1)
    target = torch.tensor(tokens[-n_scored:])
    return logprobs.gather(-1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


def split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal split: the continuation is what the whole text adds to the context's tokens."""
    whole, ctx = ids(tok, context + continuation), ids(tok, context)
    return ctx, whole[len(ctx):]


def requests(kind, args_list) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


@pytest.fixture
def harness(monkeypatch):
    """main() in this process, with lm-eval's task index limited to --include_path: indexing its thousands of
    built-in task files takes ~10 s and no test uses them."""
    from lm_eval import tasks

    class LocalTasksOnly(tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(tasks, "TaskManager", LocalTasksOnly)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() replaces it
    return lambda model_args, *more: main(["--model", "flame", "--model_args", model_args, "--device", "cpu",
                                           "--tasks", "flame_tiny_mc", "--include_path", str(TASK_DIR), *more])


def test_harness_accuracy_and_choice_loglikelihoods_match_reference(setup, tmp_path, harness):
    base, tok, models_ = setup
    export, model = models_["transformer"]
    harness(f"pretrained={export},batch_size=3", "--output_path", str(tmp_path), "--log_samples")
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]["flame_tiny_mc"]
    samples = [json.loads(line) for line in next(tmp_path.rglob("samples_flame_tiny_mc_*.jsonl")).open()]
    assert len(samples) == len(ITEMS)
    correct = []
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        item = ITEMS[sample["doc_id"]]
        context = f"Question: {item['question']}\nAnswer:"
        scores = []
        for choice, response in zip(item["choices"], sample["resps"]):
            ctx, cont = split(tok, context, " " + choice)
            ll, greedy = reference_loglikelihood(model, ctx + cont, len(cont))
            assert float(response[0][0]) == pytest.approx(ll, abs=1e-5) and response[0][1] == str(greedy)
            scores.append(ll)
        correct.append(max(range(len(scores)), key=scores.__getitem__) == item["answer"])
    assert 0 < sum(correct) < len(correct)  # the reference itself tells right from wrong answers
    assert results["acc,none"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)


@pytest.mark.parametrize("kind", ["transformer", "rwkv7", "gsa"])
def test_loglikelihood_equals_full_forward(setup, kind):
    base, tok, models_ = setup
    export, model = models_[kind]
    lm = FlameLM(pretrained=str(export), device="cpu", batch_size=3, max_length=WINDOW)
    long_context = TEXT * 2  # longer than the window: the Transformer drops context, RWKV-7 carries its state
    pairs = [("the quick brown", " fox"), ("pack my box with", " five dozen liquor jugs"), ("a", " baby cat"),
             ("", "the lazy dog"), ("how many legs ", "does a spider have"), (long_context, "the end")]
    got = lm.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        if context == "":
            ctx, cont = [tok.token_to_id(EOS)], ids(tok, continuation)
        else:
            context, continuation = context.rstrip(" "), context[len(context.rstrip(" ")):] + continuation
            ctx, cont = split(tok, context, continuation)
        tokens = ctx + cont
        if kind == "transformer":
            tokens = tokens[-(WINDOW + 1):]
        assert len(ctx + cont) > WINDOW + 1 or context != long_context
        want_ll, want_greedy = reference_loglikelihood(model, tokens, len(cont))
        assert ll == pytest.approx(want_ll, abs=1e-5) and greedy == want_greedy


@torch.no_grad()
def reference_greedy(model, tok, context: str, max_new: int) -> str:
    tokens, out = ids(tok, context), []
    for _ in range(max_new):
        next_id = int(model(torch.tensor([tokens + out]))[0, -1].argmax())
        if next_id == tok.token_to_id(EOS):
            break
        out.append(next_id)
    return tok.decode(out)


@pytest.mark.parametrize("kind", ["transformer", "rwkv7", "gsa"])
def test_generate_until_equals_greedy_loop(setup, kind):
    base, tok, models_ = setup
    export, model = models_[kind]
    lm = FlameLM(pretrained=str(export), device="cpu", batch_size=3, max_length=64)
    contexts = ["the quick brown fox", "a", "pack my box with five dozen liquor jugs. how many"]
    free = [reference_greedy(model, tok, c, 12) for c in contexts]
    # a stop string from the middle of the first continuation: the text before its first occurrence comes back
    stop = free[0][len(free[0]) // 2:][:3]
    assert stop and len(free[0]) > 6
    got = lm.generate_until(requests("generate_until", [
        (contexts[0], {"until": [stop], "max_gen_toks": 12}),
        (contexts[1], {"until": [], "max_gen_toks": 12}),
        (contexts[2], {"until": "\x00never", "max_gen_toks": 5, "do_sample": False, "temperature": 0.0})]),
        disable_tqdm=True)
    assert got[0] == free[0][:free[0].find(stop)] and len(got[0]) < len(free[0])
    assert got[1] == free[1]
    assert got[2] == reference_greedy(model, tok, contexts[2], 5)


def test_rolling_loglikelihood_transformer_windows(setup):
    """A document longer than the window is scored in lm-eval's rolling windows: the first predicts the first
    WINDOW tokens after the eos token, each later one the next WINDOW tokens from the WINDOW tokens before its last
    target; a short document is one forward pass."""
    base, tok, models_ = setup
    export, model = models_["transformer"]
    lm = FlameLM(pretrained=str(export), device="cpu", batch_size=2, max_length=WINDOW)
    docs = [TEXT, "a baby cat"]
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
    stream = [tok.token_to_id(EOS)] + ids(tok, docs[0])
    n = len(stream) - 1
    assert n > 3 * WINDOW
    want, start = 0.0, 0
    while start < n:  # targets stream[start + 1 .. end]
        end = min(start + WINDOW, n)
        want += reference_loglikelihood(model, stream[max(0, end - WINDOW):end + 1], end - start)[0]
        start = end
    assert got[0] == pytest.approx(want, abs=1e-5)
    short = [tok.token_to_id(EOS)] + ids(tok, docs[1])
    assert got[1] == pytest.approx(reference_loglikelihood(model, short, len(short) - 1)[0], abs=1e-5)


@pytest.mark.parametrize("kind", ["rwkv7", "gsa"])
def test_rolling_loglikelihood_recurrent_carries_state(setup, kind):
    """A recurrent model: a document several windows long scores as one forward pass over all of it (the state
    carried through prefill and decode windows), in a batch with a short document."""
    base, tok, models_ = setup
    export, model = models_[kind]
    lm = FlameLM(pretrained=str(export), device="cpu", batch_size=2, max_length=WINDOW)
    docs = [TEXT, "a baby cat", TEXT[:70]]
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
    for doc, value in zip(docs, got):
        stream = [tok.token_to_id(EOS)] + ids(tok, doc)
        assert value == pytest.approx(reference_loglikelihood(model, stream, len(stream) - 1)[0], abs=1e-5)
    assert len(ids(tok, docs[0])) > 3 * WINDOW and len(ids(tok, docs[2])) > WINDOW


@pytest.mark.parametrize("case", ["missing model", "bad key", "bad batch size"])
def test_bad_input_is_one_line(setup, tmp_path, capsys, harness, case):
    base, tok, models_ = setup
    model_args = {"missing model": f"pretrained={tmp_path / 'nope'}",
                  "bad key": f"pretrained={models_['transformer'][0]},colour=red",
                  "bad batch size": f"pretrained={models_['transformer'][0]},batch_size=0"}[case]
    with pytest.raises(SystemExit) as exit_info:
        harness(model_args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.strip().splitlines()[-1].startswith("error: "), err
