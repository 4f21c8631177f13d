"""flame.generate: the sampling filters against plain loops, the CLI against a reference loop that reruns the full
forward pass for every token (one prompt streamed, a batch), streamed text, and the one-line errors."""

from __future__ import annotations

import io

import pytest
import torch

from flame.data.tokenizer import open_tokenizer
from flame.export import ModelState, write_export
from flame.generate import Sampling, StreamPrinter, keep_top_k, keep_top_p, main, sample
from flame.models import build_model, model_args_class
from tests.helpers import EOS, REPO, byte_bpe, one_error_line

TEXT = ["the quick brown fox jumps over the lazy dog. " * 3, "héllo wörld, naïve café ünïcode text",
        "pack my box with five dozen liquor jugs " * 4]
SEQ_LEN = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("generate")
    byte_bpe(TEXT, base / "tokenizer.json")
    args = model_args_class("transformer")(name="transformer", vocab_size=320, hidden_size=64, num_layers=2,
                                           num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():  # a bigger head spreads the logits: greedy choices are not near-ties
        model.lm_head.weight.mul_(20)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export = write_export(base / "export", ModelState(args, state, "test", seq_len=SEQ_LEN,
                                                      tokenizer={"tokenizer.json": base / "tokenizer.json"}))
    return export, open_tokenizer(str(export), eos_token=EOS, bos_token=None), model.eval()


@torch.no_grad()
def reference_greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """The whole sequence through forward() again for every new token, argmax, stop after eos."""
    new: list[int] = []
    for _ in range(n):
        t = int(model(torch.tensor([ids + new]))[0, -1].argmax())
        new.append(t)
        if t == eos:
            break
    return new


# ------------------------------------------------------------------------------------------------------- sampling
def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, Sampling(temperature=0), None), logits.argmax(-1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(4, 50)
    kept = keep_top_k(logits, 7)
    for row, orig in zip(kept, logits):
        finite = torch.isfinite(row).nonzero()[:, 0].tolist()
        assert sorted(finite) == sorted(orig.argsort(descending=True)[:7].tolist())
        assert torch.equal(row[finite], orig[finite])
    assert torch.equal(keep_top_k(logits, 0), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    torch.manual_seed(1)
    logits = torch.randn(6, 40) * 2
    for p in (0.05, 0.5, 0.9, 0.999):
        kept = keep_top_p(logits, p)
        for row, orig in zip(kept, logits):
            probs = orig.double().softmax(-1).tolist()
            want, mass = set(), 0.0
            for i in sorted(range(len(probs)), key=lambda i: -probs[i]):  # plain loop: add until the mass is p
                want.add(i)
                mass += probs[i]
                if mass >= p:
                    break
            assert set(torch.isfinite(row).nonzero()[:, 0].tolist()) == want
    assert torch.equal(keep_top_p(logits, 1.0), logits)


def test_sampling_follows_the_filtered_softmax_and_repeats_with_a_seed():
    logits = torch.randn(2, 30)
    s = Sampling(temperature=0.7, top_k=10, top_p=0.8)
    first = [sample(logits, s, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(first[0], first[1])
    n = 4000
    draws = sample(logits.repeat_interleave(n, 0), s, torch.Generator().manual_seed(0)).view(2, n)
    # reference: the softmax of logits / T over the 10 largest, then over the most likely of those up to mass 0.8
    for b in range(2):
        probs = (logits[b].double() / 0.7).softmax(-1)
        top = probs.argsort(descending=True)[:10]
        nucleus = probs[top] / probs[top].sum()
        keep = int((nucleus.cumsum(0) < 0.8).sum()) + 1
        want = torch.zeros(30, dtype=torch.double)
        want[top[:keep]] = nucleus[:keep] / nucleus[:keep].sum()
        freq = torch.bincount(draws[b], minlength=30).double() / n
        assert (freq[want == 0] == 0).all() and (freq - want).abs().max() < 0.04


def test_stream_printer_prints_whole_characters_only(setup):
    export, tok, model = setup
    text = "héllo wörld, naïve café"
    ids = tok.encode_batch([text])[0]
    out = io.StringIO()
    printer = StreamPrinter(tok, out)
    writes = []
    for t in ids:
        printer([t])
        writes.append(out.getvalue())
    printer.close()
    assert out.getvalue() == text + "\n"
    assert len(set(writes)) > 3 and not any("\ufffd" in w for w in writes)  # printed as it came, never half


# ------------------------------------------------------------------------------------------------------------ CLI
def test_one_prompt_greedy_equals_full_forward_loop(setup, capsys):
    export, tok, model = setup
    prompt = "the quick brown"
    main([str(export), "--prompt", prompt, "--max-new-tokens", "12", "--device", "cpu"])
    new = reference_greedy(model, tok.encode_batch([prompt])[0], 12, tok.eos_id)
    assert len(new) >= 4
    assert capsys.readouterr().out == prompt + tok.decode(new) + "\n"


def test_batch_of_prompts_equals_each_alone(setup, tmp_path, capsys):
    export, tok, model = setup
    prompts = ["pack my box", "héllo", "the lazy dog. the quick brown fox"]
    (tmp_path / "prompts.txt").write_text(prompts[2] + "\n\n")
    main([str(export), "--prompt", prompts[0], "--prompt", prompts[1], "--prompts-file", str(tmp_path / "prompts.txt"),
          "--max-new-tokens", "10", "--device", "cpu"])
    out = capsys.readouterr().out
    news = [reference_greedy(model, tok.encode_batch([p])[0], 10, tok.eos_id) for p in prompts]
    want = "".join(f"--- prompt {i + 1}\n{p}{tok.decode(new)}\n" for i, (p, new) in enumerate(zip(prompts, news)))
    assert out == want


def test_seeded_sampling_repeats(setup, capsys):
    export, tok, model = setup
    argv = [str(export), "--prompt", "the", "--prompt", "pack my", "--max-new-tokens", "8", "--temperature", "1.5",
            "--top-k", "40", "--top-p", "0.95", "--device", "cpu"]
    runs = []
    for seed in ("1", "1", "2"):
        main(argv + ["--seed", seed])
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("case", ["not a model", "empty prompt", "prompt too long", "no prompt"])
def test_bad_input_is_one_line(setup, tmp_path, capsys, case):
    export, tok, model = setup
    argv = [str(export), "--prompt", "the quick", "--device", "cpu"]
    if case == "not a model":
        (tmp_path / "notes.txt").write_text("hello")
        argv[0] = str(tmp_path)
    elif case == "empty prompt":
        argv[2] = ""
    elif case == "prompt too long":
        argv[2] = TEXT[0]
        assert len(tok.encode_batch([TEXT[0]])[0]) > SEQ_LEN
    else:
        argv = [str(export)]
    # "not a model" once through the real entry point
    err = one_error_line(capsys, main, argv, "flame.generate" if case == "not a model" else None)
    if case == "prompt too long":
        assert f"the {SEQ_LEN} the Transformer was trained on" in err


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["transformer_tiny", "rwkv7_tiny", "gsa_tiny"])
def test_cuda_graph_step_equals_eager(config):
    """The one-token step replayed as a CUDA graph gives the eager steps' logits (fp32): greedy tokens identical."""
    from flame.config import load_config
    from flame.generate import generate

    args = load_config(REPO / "configs" / f"{config}.toml").model
    torch.manual_seed(0)
    model = build_model(args).cuda()
    model.init_weights()
    model.eval()
    prompts = [list(range(1, 40)), [5, 6, 7]]
    eager = generate(model, prompts, 24)
    graph = generate(model, prompts, 24, cuda_graph=True)
    assert graph == eager
