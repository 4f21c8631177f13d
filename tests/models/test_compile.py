"""torch.compile of each block, as training.compile does it. Every model compiles a bounded number of variants of its
block whatever its depth (an int attribute read in forward, a layer index, is a constant to Dynamo: it recompiled the
block once per layer, and past the recompile limit (8) the deeper layers silently ran eager), stops recompiling when
packed batches change their document count, and compiles under full activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from flame.config import load_config
from flame.models import build_model

SMALL_VOCAB = ["--model.vocab_size=512"]
"""What compiles is the blocks: the configs' 50k-row head would only add CPU time around them."""


@pytest.mark.parametrize("config", ["transformer_tiny", "rwkv7_tiny", "gsa_tiny"])
def test_blocks_compile_once_whatever_the_depth(config):
    import torch._dynamo as dynamo

    cfg = load_config(f"configs/{config}.toml", ["--model.num_layers=10", *SMALL_VOCAB])
    model = build_model(cfg.model)
    model.init_weights()
    ids = torch.randint(0, cfg.model.vocab_size, (1, 32))
    eager_loss = model(ids, labels=ids)
    dynamo.reset()
    dynamo.utils.counters.clear()
    for block in model.layers:
        block.compile(backend="eager")   # Dynamo's graph capture and guards only: no code generation needed
    loss = model(ids, labels=ids)
    loss.backward()
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    # RWKV-7's first layer differs (it supplies v_first): two variants; the others one
    assert 1 <= graphs <= 2, f"{config}: {graphs} compiled graphs for {len(model.layers)} blocks"
    torch.testing.assert_close(loss, eager_loss)


@pytest.mark.parametrize("config,module,kernel", [("rwkv7_tiny", "flame.models.rwkv7", "chunk_rwkv7"),
                                                  ("gsa_tiny", "flame.models.gsa", "chunk_gsa")])
def test_packed_batches_stop_recompiling(config, module, kernel, monkeypatch):
    # Packed documents change cu_seqlens' length every step. On the GPU the chunk kernel is opaque to Dynamo
    # (torch.compiler.disable on its Triton entry); here the CPU path is made opaque the same way. After one
    # recompile (Dynamo then takes the length as dynamic) no new document count may compile again.
    import importlib

    import torch._dynamo as dynamo

    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, kernel, torch.compiler.disable(getattr(mod, kernel)))
    cfg = load_config(f"configs/{config}.toml", ["--model.num_layers=3", *SMALL_VOCAB])   # layer 0 and two alike
    model = build_model(cfg.model)
    model.init_weights()
    dynamo.reset()
    dynamo.utils.counters.clear()
    for block in model.layers:
        block.compile(backend="eager")
    gen = torch.Generator().manual_seed(0)
    graphs = []
    for n_docs in (2, 3, 5, 4, 9, 1, 13):
        ids = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=gen)
        cuts = (torch.randperm(127, generator=gen)[:n_docs - 1] + 1).sort().values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([128])]).to(torch.int32)
        model(ids, labels=ids, cu_seqlens=cu).backward()
        graphs.append(dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[1]] * (len(graphs) - 1), f"{config}: graphs after each step {graphs}"


AC_COMPILE_SCRIPT = r"""
import sys, torch, torch._dynamo as dynamo
from flame import parallel
from flame.config import load_config
from flame.models import build_model

compile_ = torch.nn.Module.compile
torch.nn.Module.compile = lambda self, *a, **k: compile_(self, backend="eager")   # graph capture only
cfg = load_config(f"configs/{sys.argv[1]}.toml", ["--model.num_layers=4", "--model.vocab_size=512"])
d = parallel.init_distributed(cfg.parallelism)
ids = torch.randint(0, cfg.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
losses = []
for compile in (False, True):
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights()
    dynamo.reset()
    dynamo.utils.counters.clear()
    model = parallel.parallelize(model, d, param_dtype="float32", reduce_dtype="float32",
                                 activation_checkpoint="full", compile=compile)
    loss = model(ids, labels=ids)
    loss.backward()
    losses.append(loss.item())
print(dynamo.utils.counters["stats"]["unique_graphs"], losses[0], losses[1])
"""


@pytest.mark.parametrize("config", ["rwkv7_tiny", "gsa_tiny", "transformer_tiny"])
def test_blocks_compile_under_full_activation_checkpointing(config):
    # parallelize wraps each block in its checkpoint and compiles the wrapper: the blocks must still be captured
    # (Dynamo traces checkpoint() as one higher-order op; a graph break inside would run the block eager) and give
    # the uncompiled loss. (A process of its own: it joins a process group of one.)
    from tests.helpers import run_script

    proc = run_script(AC_COMPILE_SCRIPT, config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs, eager_loss, compiled_loss = proc.stdout.split()
    assert int(graphs) >= 1, f"{config}: no block was compiled under full activation checkpointing"
    assert float(compiled_loss) == pytest.approx(float(eager_loss), rel=1e-6)


CACHED_COMPILE_SCRIPT = r"""
import torch
import flame.models.rwkv7 as R
from flame import parallel
from flame.config import load_config
from flame.models import build_model

R.chunk_rwkv7 = torch.compiler.disable(R.chunk_rwkv7)    # a graph break, live tensors across it
cfg = load_config("configs/rwkv7_tiny.toml", ["--model.num_layers=2"])
d = parallel.init_distributed(cfg.parallelism)
torch.manual_seed(0)
model = build_model(cfg.model)
model.init_weights()
model = parallel.parallelize(model, d, param_dtype="float32", reduce_dtype="float32", activation_checkpoint="none",
                             compile=True)
ids = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
loss = model(ids, labels=ids)
loss.backward()
print(loss.item())
"""


def test_a_second_compiled_run_on_a_warm_cache(tmp_path):
    # Inductor for real (C++ on CPU), twice on one cache folder, as a user's second launch of a config is. With
    # AOTAutograd's cache warm, the second run replayed the outputs aliasing a linear's 3-D result with garbage sizes
    # and failed or segfaulted (first seen on an H100); parallel.parallelize turns that cache off.
    from tests.helpers import run_script

    losses = []
    for _ in range(2):   # two processes (forked from the tests' server on CPU: its imports, nothing compiled)
        proc = run_script(CACHED_COMPILE_SCRIPT, timeout=600, extra={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append(float(proc.stdout.split()[-1]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
