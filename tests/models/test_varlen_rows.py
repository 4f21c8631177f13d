"""Varlen batches of several rows: cu_seqlens spans the flattened B*T tokens (flame.data.packing's layout, a segment
starting at every row start). Every model must give each document the logits it gets alone."""

import pytest
import torch

from flame.config import load_config
from flame.models import build_model
from tests.helpers import REPO


def tiny(name):
    cfg = load_config(REPO / f"configs/{name}_tiny.toml",
                      ["--model.vocab_size=97", "--data.synthetic=true", "--checkpoint.enable=false"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.double()


@pytest.mark.parametrize("name", ["transformer", "rwkv7", "gsa"])
def test_rows_of_packed_documents_match_separate_documents(name):
    model = tiny(name)
    rows = [[5, 11], [9, 7]]  # two rows of 16 tokens, two documents each
    docs = [[torch.randint(0, 97, (n,)) for n in row] for row in rows]
    batch = torch.stack([torch.cat(row) for row in docs])
    lengths = [n for row in rows for n in row]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    logits = model(batch, cu_seqlens=cu)
    assert logits.shape == (2, 16, 97)
    alone = torch.cat([model(d[None])[0] for row in docs for d in row])
    torch.testing.assert_close(logits.reshape(32, 97), alone, rtol=1e-6, atol=1e-6)
