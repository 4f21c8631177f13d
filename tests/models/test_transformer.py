"""The Transformer baseline: packed documents (cu_seqlens) are independent; the loss path equals plain cross entropy."""

import torch
import torch.nn.functional as F

from flame.models import build_model
from flame.models.transformer import TransformerArgs


def tiny(**kw):
    args = TransformerArgs(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, **kw)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.double()


def test_packed_documents_match_separate_runs():
    model = tiny()
    docs = [torch.randint(0, 97, (n,)) for n in (5, 11, 8)]
    packed = torch.cat(docs)[None]
    cu = torch.tensor([0, 5, 16, 24])
    logits = model(packed, cu_seqlens=cu)[0]
    separate = torch.cat([model(d[None])[0] for d in docs])
    torch.testing.assert_close(logits, separate)
    # without cu_seqlens the later documents see the earlier ones: the check above is not vacuous
    assert not torch.allclose(model(packed)[0][5:], separate[5:])


def test_chunked_loss_sum_equals_cross_entropy():
    model = tiny(loss_chunk_size=7)
    x = torch.randint(0, 97, (3, 10))
    y = torch.randint(0, 97, (3, 10))
    y[0, 4:] = -100
    total = model(x, labels=y)
    ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(total, ref.float(), rtol=1e-6, atol=1e-6)
    total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
