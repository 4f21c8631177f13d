"""RWKV-6 model: fresh-init loss, gradients, packed documents, cached prefill/decode against the full forward, the
optimizer groups RWKV-LM gives x060, the tiny config training on the sample text (in this process, and as a run of
flame.train with its checkpoint)."""

from __future__ import annotations

import json
import math

import torch
from tokenizers import Tokenizer

from flame.config import load_config
from flame.convert_rwkv_lm import to_rwkv_lm_x060
from flame.models import build_model
from flame.optim import build_optimizer
from tests.helpers import REPO, SMALL_VOCAB, one_thread, read_metrics, run_train  # noqa: F401  (one_thread: tiny ops)
from tests.tiny_models import tiny_model, wake_branches

VOCAB = 256


def tiny(vocab=VOCAB, hidden=64, layers=2, head_dim=16, seed=0, branches=True):
    model = tiny_model("rwkv6", seed, vocab_size=vocab, hidden_size=hidden, num_layers=layers, head_dim=head_dim)
    # branches: the zero-initialized output projections and channel-mix gate made to matter
    return wake_branches(model, 0.1) if branches else model


def test_first_loss_is_near_ln_vocab():
    # The RWKV-LM init (tiny embeddings, LayerNorm, orthogonal head of gain 0.5 sqrt(V/C)) starts at ~ln(V).
    model = tiny(vocab=50304, hidden=128, head_dim=64, branches=False)
    ids = torch.randint(0, 50304, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(ids, labels=ids).item() / ids.numel()
    assert abs(loss - math.log(50304)) < 0.3, loss


def test_gradients_are_finite_and_flow():
    model = tiny(branches=False)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # the zero-initialized output projections receive gradient, so every branch can start learning
    assert model.layers[1].attn.o_proj.weight.grad.abs().sum() > 0
    assert model.layers[1].ffn.value.weight.grad.abs().sum() > 0


def test_packed_documents_equal_separate_runs():
    model = tiny()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, VOCAB, (1, 23), generator=g), torch.randint(0, VOCAB, (1, 41), generator=g)
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 23, 64]))
        torch.testing.assert_close(packed[:, :23], model(a), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed[:, 23:], model(b), rtol=1e-4, atol=1e-4)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


def test_prefill_and_decode_equal_the_full_forward():
    """Prompts of 110, 37 and 1 tokens in one prefill, then 4 one-token steps and a 3-token chunk per sequence: every
    logit equals a full forward over the sequence so far (rel 1e-4); the cache is updated in place."""
    model = tiny().eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (110, 37, 1)]
    steps = torch.randint(0, VOCAB, (3, 7), generator=g)
    with torch.no_grad():
        last, cache = model.prefill(prompts)
        tensors = [t for t in cache.tensors()]
        for i, p in enumerate(prompts):
            assert rel_err(last[i], model(torch.tensor([p]))[0, -1]) < 1e-4, ("prefill", i)
        seqs = [list(p) for p in prompts]
        for s in range(4):
            logits, cache = model.decode(steps[:, s:s + 1], cache)
            for i in range(3):
                seqs[i].append(int(steps[i, s]))
                assert rel_err(logits[i, 0], model(torch.tensor([seqs[i]]))[0, -1]) < 1e-4, ("step", s, i)
        logits, cache = model.decode(steps[:, 4:], cache, all_logits=True)
        for i in range(3):
            seqs[i] += steps[i, 4:].tolist()
            assert rel_err(logits[i], model(torch.tensor([seqs[i]]))[0, -3:]) < 1e-4, ("chunk", i)
    assert all(a is b for a, b in zip(tensors, cache.tensors()))


def rwkv_lm_group(name: str, shape: torch.Size) -> tuple[bool, float]:
    """(weight decay, lr scale) of a parameter under RWKV-LM's configure_optimizers for x060 (layerwise_lr 1,
    weight_decay > 0, my_pile_stage not 2), by its RWKV-LM name."""
    if "_w1" in name or "_w2" in name:
        return False, 1.0
    if "time_mix" in name or "time_maa" in name:
        return False, 1.0
    if "time_decay" in name or "time_daaaa" in name:
        return False, 2.0
    if "time_faaaa" in name:
        return False, 1.0
    if len(torch.Size([d for d in shape if d != 1])) >= 2 and ".weight" in name:
        return True, 1.0
    return False, 1.0


def test_optimizer_groups_are_rwkv_lms():
    """Each flame parameter lands in the group RWKV-LM's rule gives its RWKV-LM tensor(s) (found through the
    conversion, which shares storage with the parameters)."""
    model = tiny(branches=False)
    by_storage = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    theirs = to_rwkv_lm_x060(dict(model.named_parameters()), model.args.num_layers)
    expected: dict[str, set] = {}
    for name, t in theirs.items():
        expected.setdefault(by_storage[t.untyped_storage().data_ptr()], set()).add(rwkv_lm_group(name, t.shape))
    got = {n: (g.weight_decay, g.lr_scale) for g in model.optimizer_groups() for n in g.params}
    assert got.keys() == {n for n, _ in model.named_parameters()} == expected.keys()
    for name, groups in expected.items():
        assert groups == {got[name]}, (name, groups, got[name])
    assert got["layers.0.attn.decay"] == (False, 2.0) and got["layers.1.ffn.key.weight"] == (True, 1.0)


def test_tiny_config_trains_on_sample_text():
    """configs/rwkv6_tiny.toml's model and optimizer (RWKV-6's groups, L2Wrap) on the bundled sample text: 10 AdamW
    steps on one batch of 2 x 64 tokens; every loss finite and the loss falls by more than 2 nats."""
    cfg = load_config(REPO / "configs" / "rwkv6_tiny.toml")
    tokenizer = Tokenizer.from_file(str(REPO / cfg.data.tokenizer))
    text = json.loads((REPO / "data" / "sample" / "eval" / "eval-00.jsonl").read_text().splitlines()[0])["text"]
    ids = torch.tensor(tokenizer.encode(text).ids[:2 * 65]).view(2, 65)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights()
    optimizer = build_optimizer(model, cfg.optimizer)
    losses = []
    for _ in range(10):
        loss = model(ids[:, :-1], labels=ids[:, 1:]) / ids[:, 1:].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and abs(losses[0] - math.log(cfg.model.vocab_size)) < 0.3, losses
    assert sum(losses[-3:]) / 3 < losses[0] - 2.0, losses


def test_tiny_config_run_saves_its_checkpoint(tmp_path):
    # flame.train on configs/rwkv6_tiny.toml (the sample text at a 512-token vocabulary): a loss near ln(vocab)
    # falling, its checkpoint
    dump = tmp_path / "run"
    proc = run_train(REPO / "configs/rwkv6_tiny.toml", "--training.steps=4", f"--job.dump_folder={dump}",
                     "--metrics.log_freq=1", "--checkpoint.interval=4", "--training.seq_len=64",
                     "--lr_scheduler.warmup_steps=1", *SMALL_VOCAB)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(512)) < 1.0 and losses[-1] < losses[0]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-4"]
