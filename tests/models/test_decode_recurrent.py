"""Cached inference of the recurrent models (RWKV-7, GSA with and without short convolutions): the one-token steps
against the fp64 naive recurrences, then prefill + decode against one full forward pass over the same tokens (the
independent reference: the training path, chunk op over the whole sequence), for one prompt, batched prompts of
different lengths and chunked continuations; and a decode step never touches the prefix."""

from __future__ import annotations

import pytest
import torch

from kernels.gsa import naive_gsa
from kernels.gsa.step import recurrent_step as gsa_step
from kernels.rwkv7 import naive_rwkv7
from kernels.rwkv7.step import recurrent_step as rwkv7_step
from tests.helpers import one_thread  # noqa: F401  (decoding is hundreds of tiny ops)
from tests.tiny_models import tiny_model, wake_branches

VOCAB = 256
MODELS = ["rwkv7", "gsa", "gsa_conv"]


def tiny(kind: str):
    if kind == "rwkv7":     # RWKV-7 starts with zero output projections: make both branches matter
        return wake_branches(tiny_model("rwkv7", vocab_size=VOCAB, hidden_size=64, num_layers=2, head_dim=16),
                             0.1).eval()
    return tiny_model("gsa", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2, num_slots=16,
                      use_short_conv=kind == "gsa_conv", initializer_range=0.05).eval()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of one forward pass over the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


def test_rwkv7_step_matches_naive_recurrence():
    torch.manual_seed(0)
    B, T, H, K, V = 2, 6, 3, 8, 5
    r, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    a, b = -kk, kk * torch.rand(B, T, H, K, dtype=torch.float64)
    w = -0.6 * torch.rand(B, T, H, K, dtype=torch.float64)
    s0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o_ref, s_ref = naive_rwkv7(r, w, k, v, a, b, scale=0.7, initial_state=s0, output_final_state=True)
    state = s0
    for t in range(T):
        o, state = rwkv7_step(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state, scale=0.7)
        torch.testing.assert_close(o, o_ref[:, t], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, s_ref, rtol=1e-12, atol=1e-12)


def test_gsa_step_matches_naive_recurrence():
    torch.manual_seed(0)
    B, T, H, K, V, M = 2, 6, 3, 8, 5, 4
    q, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, M, dtype=torch.float64))
    s = -torch.expm1(g)
    hk0, hv0 = torch.randn(B, H, K, M, dtype=torch.float64), torch.randn(B, H, M, V, dtype=torch.float64)
    o_ref, (hk_ref, hv_ref) = naive_gsa(q, k, v, s, g, initial_state=(hk0, hv0), output_final_state=True)
    state = (hk0, hv0)
    for t in range(T):
        o, state = gsa_step(q[:, t], k[:, t], v[:, t], s[:, t], g[:, t], state)   # default scale K^-0.5 as naive
        torch.testing.assert_close(o, o_ref[:, t], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state[0], hk_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state[1], hv_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", MODELS)
def test_decode_token_by_token_equals_full_forward(kind):
    model = tiny(kind)
    ids = tokens(125, seed=1)
    ref = full_logits(model, ids)
    # a prompt of 105 tokens (several chunks of the chunk path, ending inside one), then 20 single steps
    last, cache = model.prefill([ids[:105]])
    assert rel_err(last[0], ref[104]) < 1e-4
    for t in range(105, 125):
        logits, cache = model.decode(torch.tensor([[ids[t]]]), cache)
        assert logits.shape == (1, 1, VOCAB)
        assert rel_err(logits[0, 0], ref[t]) < 1e-4, t
    # from the first token on, every token a step (across the chunk path's first chunk boundary)
    last, cache = model.prefill([ids[:1]])
    assert rel_err(last[0], ref[0]) < 1e-4
    for t in range(1, 24):
        logits, cache = model.decode(torch.tensor([[ids[t]]]), cache)
        assert rel_err(logits[0, 0], ref[t]) < 1e-4, t
    # the comparison sees the cache: without its contents the next token's logits differ
    for tensor in cache.tensors():
        tensor.zero_()
    logits, _ = model.decode(torch.tensor([[ids[24]]]), cache)
    assert rel_err(logits[0, 0], ref[24]) > 1e-2


@pytest.mark.parametrize("kind", MODELS)
def test_batched_prefill_and_decode_equal_single_sequences(kind):
    model = tiny(kind)
    lengths, new = (37, 101, 2, 5), 4      # 2 < the convolution's 3 cached inputs: its prompt is all there is
    seqs = [tokens(n + new, seed=10 + i) for i, n in enumerate(lengths)]
    refs = [full_logits(model, s) for s in seqs]
    last, cache = model.prefill([s[:n] for s, n in zip(seqs, lengths)])
    assert last.shape == (4, VOCAB) and cache.batch_size == 4
    for i, n in enumerate(lengths):
        assert rel_err(last[i], refs[i][n - 1]) < 1e-4, (i, n)
    for j in range(new):
        step = torch.tensor([[s[n + j]] for s, n in zip(seqs, lengths)])
        logits, cache = model.decode(step, cache)
        for i, n in enumerate(lengths):
            assert rel_err(logits[i, 0], refs[i][n + j]) < 1e-4, (i, j)


@pytest.mark.parametrize("kind", MODELS)
def test_chunked_continuation_equals_full_forward(kind):
    # decode with T > 1 runs the chunk op from the cached states; its first token sees the cached token shift /
    # convolution inputs. Mixed with single steps, for two prompts of different lengths.
    model = tiny(kind)
    lengths, pieces = (21, 50), (35, 1, 7)
    seqs = [tokens(n + sum(pieces), seed=20 + i) for i, n in enumerate(lengths)]
    refs = [full_logits(model, s) for s in seqs]
    _, cache = model.prefill([s[:n] for s, n in zip(seqs, lengths)])
    done = 0
    for T in pieces:
        chunk = torch.tensor([s[n + done:n + done + T] for s, n in zip(seqs, lengths)])
        logits, cache = model.decode(chunk, cache, all_logits=True)
        assert logits.shape == (2, T, VOCAB)
        for i, n in enumerate(lengths):
            assert rel_err(logits[i], refs[i][n + done:n + done + T]) < 1e-4, (i, T)
        done += T
    last, _ = model.decode(torch.tensor([[s[0]] for s in seqs]), cache)
    assert last.shape == (2, 1, VOCAB)


@pytest.mark.parametrize("kind", ["rwkv7", "gsa_conv"])
def test_a_decode_step_never_touches_the_prefix(kind, monkeypatch):
    import importlib

    model = tiny(kind)
    op = "gsa" if kind.startswith("gsa") else "rwkv7"
    module, chunk_name = importlib.import_module(f"flame.models.{op}"), f"chunk_{op}"
    chunk_calls = []
    chunk = getattr(module, chunk_name)
    monkeypatch.setattr(module, chunk_name, lambda *a, **kw: chunk_calls.append(a[0].shape) or chunk(*a, **kw))
    seen = []
    for block in model.layers:
        block.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    for prompt_len in (3, 200):
        _, cache = model.prefill([tokens(prompt_len, 1), tokens(prompt_len // 3 + 1, 2)])
        seen.clear()
        chunk_calls.clear()
        where = [(x.data_ptr(), x.shape) for x in cache.tensors()]
        for step in range(3):
            _, same = model.decode(torch.tensor([[step], [step + 1]]), cache)
        # updated in place (what a CUDA graph of the step needs): the same tensors, the same shapes
        assert same is cache and [(x.data_ptr(), x.shape) for x in cache.tensors()] == where
        # each step: every block sees B x 1 tokens, and the chunk op (which could read a prefix) is never called
        assert seen == [(2, 1, 64)] * (3 * len(model.layers)), (prompt_len, seen)
        assert chunk_calls == [], prompt_len
