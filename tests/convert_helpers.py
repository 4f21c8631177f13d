"""Helpers the RWKV-LM conversion tests share: flame.convert called in-process, random RWKV-LM checkpoints and their
flame export as module fixtures, the round-trip comparison, and the rwkv package's import settings."""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager

import pytest
import torch

from flame.convert import main
from flame.export import load_exported, read_export


def convert(*argv) -> None:
    main([str(a) for a in argv])


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


class RandomTensors:
    """Seeded random tensors for a synthetic checkpoint, drawn in call order from one generator."""

    def __init__(self, seed: int, width: int):
        self.g = torch.Generator().manual_seed(seed)
        self.width = width

    def normal(self, *shape, std=1.0, mean=0.0) -> torch.Tensor:
        return mean + std * torch.randn(*shape, generator=self.g)

    def rand(self, *shape) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g)

    def norm(self, prefix: str) -> dict[str, torch.Tensor]:
        """A LayerNorm near its init but not at it: weight 1 +- 0.1, bias 0 +- 0.1."""
        C = self.width
        return {f"{prefix}.weight": self.normal(C, std=0.1, mean=1.0), f"{prefix}.bias": self.normal(C, std=0.1)}


def random_rwkv_lm_checkpoint(layers: int, width: int, vocab: int, seed: int, block) -> dict:
    """RWKV-LM's names around the blocks (emb, blocks.0.ln0, each block's ln1 / ln2, ln_out, head) with random
    tensors, and each block's own from block(tensors, i) -> {name: tensor}."""
    t, C = RandomTensors(seed, width), width
    sd = {"emb.weight": t.normal(vocab, C), **t.norm("blocks.0.ln0")}
    for i in range(layers):
        sd.update(t.norm(f"blocks.{i}.ln1"))
        sd.update(t.norm(f"blocks.{i}.ln2"))
        sd.update(block(t, i))
    sd.update(t.norm("ln_out"))
    sd["head.weight"] = t.normal(vocab, C, std=C ** -0.5)
    return sd


X070_RANKS = {"w": 32, "a": 16, "v": 24, "g": 40}   # all different, so a mixed-up path has the wrong shape
X070_LERP = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def x070_checkpoint(layers=3, width=128, head=64, vocab=300, ranks=X070_RANKS, seed=0) -> dict:
    """Random tensors under RWKV-LM's x070 names and shapes (as its RWKV class creates them, v0/v1/v2 in layer 0
    included), every one nonzero and of a scale where every path moves the logits."""
    C, H = width, width // head

    def block(t, i):
        b, att = f"blocks.{i}.", f"blocks.{i}.att."
        sd = {att + name: t.rand(1, 1, C) for name in X070_LERP}
        for x, mean in (("w", -1.0), ("a", 0.0), ("v", 0.0)):
            sd[att + x + "0"] = t.normal(1, 1, C, std=0.5, mean=mean)
        for x, r in ranks.items():
            sd[att + x + "1"] = t.normal(C, r, std=0.1)
            sd[att + x + "2"] = t.normal(r, C, std=0.1)
        sd[att + "k_k"] = t.normal(1, 1, C, std=0.1, mean=0.7)
        sd[att + "k_a"] = t.normal(1, 1, C, std=0.1, mean=1.0)
        sd[att + "r_k"] = t.normal(H, head, std=0.1)
        for name in ("receptance", "key", "value", "output"):
            sd[f"{att}{name}.weight"] = t.normal(C, C, std=C ** -0.5)
        sd.update(t.norm(att + "ln_x"))
        sd[b + "ffn.x_k"] = t.rand(1, 1, C)
        sd[b + "ffn.key.weight"] = t.normal(4 * C, C, std=C ** -0.5)
        sd[b + "ffn.value.weight"] = t.normal(C, 4 * C, std=(4 * C) ** -0.5)
        return sd

    return random_rwkv_lm_checkpoint(layers, width, vocab, seed, block)


def checkpoint_fixtures(make_checkpoint):
    """Module fixtures `pth` (make_checkpoint()'s tensors saved as an RWKV-LM .pth) and `exported` (that .pth
    converted into a flame export folder): `pth, exported = checkpoint_fixtures(rwkv_lm_checkpoint)`."""

    @pytest.fixture(scope="module")
    def pth(tmp_path_factory):
        path = tmp_path_factory.mktemp("rwkv_lm") / "model.pth"
        torch.save(make_checkpoint(), path)
        return path

    @pytest.fixture(scope="module")
    def exported(pth, tmp_path_factory):
        out = tmp_path_factory.mktemp("flame") / "export"
        convert(pth, out)
        return out

    return pth, exported


def flame_logits_one_and_two_documents(exported, vocab: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """64 random tokens (seed 1) and the exported model's logits [64, vocab] on them: as one document, and packed as
    two documents (23 + 41 tokens) in one row."""
    model = load_exported(exported).eval()
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        single = model(ids)[0]
        packed = model(ids, cu_seqlens=torch.tensor([0, 23, 64]))[0]
    return ids[0].tolist(), single, packed


def assert_same_export(a_dir, b_dir) -> None:
    """Two export folders hold the same model settings and bit-identical tensors."""
    a, b = read_export(a_dir), read_export(b_dir)
    assert a.args == b.args
    assert a.state.keys() == b.state.keys() and all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def assert_rwkv_lm_round_trip(pth, exported, tmp_path, unused=frozenset()) -> None:
    """`exported` --to rwkv-lm gives back the .pth it came from, names and shapes, every tensor bit-exact in fp32
    (`unused`: RWKV-LM's tensors that its model never reads, written as fp32 zeros), and converting that file again
    gives the same export."""
    out = tmp_path / "again.pth"
    convert(exported, out, "--to", "rwkv-lm")
    original, written = torch.load(pth), torch.load(out)
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in original.items()}
    assert all(torch.equal(written[k], original[k]) and written[k].dtype == torch.float32
               for k in original if k not in unused)
    assert all(written[k].dtype == torch.float32 and not written[k].any() for k in unused)
    convert(out, tmp_path / "back")
    assert_same_export(exported, tmp_path / "back")


@contextmanager
def rwkv_package_settings(v7: bool):
    """For loading the rwkv package's model.py on CPU: RWKV_V7_ON as asked, no TorchScript, no CUDA kernels. What
    importing it switches globally (TF32, cuDNN benchmark, the JIT's autocast mode) and RWKV_V7_ON / RWKV_JIT_ON are
    put back afterwards; RWKV_CUDA_ON stays "0", since its forward reads it."""
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    autocast = torch._C._jit_set_autocast_mode(True)
    env = {k: os.environ.get(k) for k in ("RWKV_V7_ON", "RWKV_JIT_ON")}
    os.environ.update(RWKV_V7_ON="1" if v7 else "0", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
    try:
        yield
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = saved
        torch._C._jit_set_autocast_mode(autocast)
        for k, v in env.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})


def rwkv_package_x060(pth, strategy: str = "cpu fp32"):
    """The rwkv package's RWKV class on an x060 .pth (it detects x060 and runs RWKV_x060's math in plain PyTorch, no
    TorchScript, no CUDA kernels), from a private copy of rwkv/model.py: the shared module may have been imported with
    RWKV_V7_ON, which replaces that class. Skips where the package is not installed."""
    pytest.importorskip("rwkv")
    import rwkv

    with rwkv_package_settings(v7=False):
        spec = importlib.util.spec_from_file_location("rwkv_model_x060", os.path.join(rwkv.__path__[0], "model.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.RWKV(str(pth.with_suffix("")), strategy, verbose=False)   # it appends .pth itself
    assert model.version == 6.0
    return model
