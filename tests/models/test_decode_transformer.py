"""The Transformer's KV cache against its own full forward pass (fp32): token by token from the first token and
after a long prefill, prompts of different lengths in one batch, multi-token continuations, the cache growing."""

import torch

from flame.models import build_model
from flame.models.transformer import TransformerArgs

VOCAB = 97


def tiny(**kw):
    args = TransformerArgs(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, **kw)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model.eval()


def assert_rel_close(got, want, rel=1e-4):
    err = (got - want).abs().max() / want.abs().max()
    assert err < rel, f"relative error {err:.2e}"


@torch.no_grad()
def test_token_by_token_equals_full_forward():
    model = tiny()
    seq = torch.randint(0, VOCAB, (1, 140))
    full = model(seq)[0]
    for prefix in (1, 110):  # from the first token, and after a prefill of 100+ tokens
        last, cache = model.prefill([seq[0, :prefix].tolist()], max_len=seq.shape[1])
        assert_rel_close(last[0], full[prefix - 1])
        for t in range(prefix, seq.shape[1] if prefix > 1 else 30):
            logits, cache = model.decode(seq[:, t:t + 1], cache)
            assert logits.shape == (1, 1, VOCAB)
            assert_rel_close(logits[0, 0], full[t])


@torch.no_grad()
def test_batched_prompts_of_different_lengths_equal_each_alone():
    model = tiny(tie_embeddings=True)
    lengths = (3, 17, 9)
    seqs = [torch.randint(0, VOCAB, (n + 6,)) for n in lengths]
    last, cache = model.prefill([s[:n].tolist() for s, n in zip(seqs, lengths)])
    steps = [last]
    for i in range(6):
        step = torch.stack([s[n + i] for s, n in zip(seqs, lengths)])[:, None]
        logits, cache = model.decode(step, cache)
        steps.append(logits[:, 0])
    assert cache.lengths.tolist() == [n + 6 for n in lengths]
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        full = model(s[None])[0]  # alone, no padding anywhere
        for i, logits in enumerate(steps):
            assert_rel_close(logits[b], full[n - 1 + i])


@torch.no_grad()
def test_multi_token_continuation_equals_full_forward():
    model = tiny()
    lengths = (5, 12)
    seqs = [torch.randint(0, VOCAB, (n + 8,)) for n in lengths]
    _, cache = model.prefill([s[:n].tolist() for s, n in zip(seqs, lengths)], max_len=16)  # forces a regrow
    chunk = torch.stack([s[n:n + 8] for s, n in zip(seqs, lengths)])
    logits, cache = model.decode(chunk, cache, all_logits=True)
    assert logits.shape == (2, 8, VOCAB) and cache.capacity >= 20
    last, _ = model.decode(torch.zeros(2, 1, dtype=torch.long), cache)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        full = model(torch.cat([s, torch.zeros(1, dtype=torch.long)])[None])[0]
        assert_rel_close(logits[b], full[n:n + 8])
        assert_rel_close(last[b, 0], full[n + 8])


@torch.no_grad()
def test_decode_step_keeps_the_cache_tensors():
    """A T == 1 step writes in place (what a CUDA graph of the step needs) while the reserved slots last."""
    model = tiny()
    _, cache = model.prefill([[1, 2, 3], [4]], max_len=8)
    keys, lengths = [k.data_ptr() for k in cache.keys], cache.lengths.data_ptr()
    for _ in range(5):
        _, cache = model.decode(torch.ones(2, 1, dtype=torch.long), cache)
    assert [k.data_ptr() for k in cache.keys] == keys and cache.lengths.data_ptr() == lengths
    assert cache.lengths.tolist() == [8, 6]
