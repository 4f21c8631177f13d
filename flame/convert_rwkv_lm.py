"""RWKV-LM's .pth checkpoints <-> flame weights: RWKV-7 (x070, flame's rwkv7) and RWKV-6 (x060, flame's rwkv6).

x070 names: emb, blocks.0.ln0 (flame's embed_norm), blocks.i.ln1 / ln2 (attn_norm / ffn_norm), blocks.i.att.{x_r,
x_w, x_k, x_v, x_a, x_g (the six rows of flame's lerp), w0/w1/w2, a0/a1/a2, v0/v1/v2, g1/g2, k_k, k_a, r_k,
receptance / key / value / output (r_proj / k_proj / v_proj / o_proj), ln_x}, blocks.i.ffn.{x_k, key, value}, ln_out
(norm), head (lm_head). Per-channel vectors are [1, 1, C] there; the low-rank matrices are stored the way both use
them (x @ w1 @ w2), so nothing is transposed. RWKV-LM also creates v0/v1/v2 in layer 0, where nothing reads them:
they are written as zeros and ignored on reading. The model's settings are read from the tensors' shapes.

x060 names: the same emb, ln0, ln1, ln2, ln_out, head and att.{receptance, key, value, output, ln_x}, plus att.gate
(g_proj), att.time_maa_x (maa_x), att.time_maa_{w, k, v, r, g} (the five rows of maa), att.time_maa_w1 / w2 (maa_w1
/ maa_w2), att.time_decay (decay), att.time_decay_w1 / w2 (decay_w1 / decay_w2), att.time_faaaa (bonus [H, N]),
ffn.time_maa_k / time_maa_r (maa_k / maa_r) and ffn.{key, receptance, value}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flame.export import (ConvertError, ModelState, build_args, check_tensors, empty_state, load_torch_file,
                          staged_output, standalone)

LERP = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
"""RWKV-LM's names of the rows of flame's attn.lerp, in order."""
CHANNEL_VECTORS = ("w0", "a0", "v0", "k_k", "k_a")
"""[C] in flame, [1, 1, C] in RWKV-LM."""
LOW_RANK = ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")
LINEAR = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}
UNUSED_IN_LAYER_0 = ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2")


def _norm(out: dict, theirs: str, state: dict, ours: str) -> None:
    out[f"{theirs}.weight"], out[f"{theirs}.bias"] = state[f"{ours}.weight"], state[f"{ours}.bias"]


def to_rwkv_lm(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """flame rwkv7 weights -> RWKV-LM names and shapes (meta tensors give the expected layout)."""
    out = {"emb.weight": state["embed.weight"]}
    _norm(out, "blocks.0.ln0", state, "embed_norm")
    for i in range(num_layers):
        b, ours = f"blocks.{i}.", f"layers.{i}."
        a, att = ours + "attn.", b + "att."
        _norm(out, b + "ln1", state, ours + "attn_norm")
        _norm(out, b + "ln2", state, ours + "ffn_norm")
        C = state[a + "w0"].shape[0]
        for j, name in enumerate(LERP):
            out[att + name] = state[a + "lerp"][j].reshape(1, 1, C)
        if i == 0:  # RWKV-LM's layer 0 carries a value-residual path it never uses: zeros, shaped like layer 1's
            ref = f"layers.{1 if num_layers > 1 else 0}.attn."
            state = {**state, a + "v0": torch.zeros_like(state[a + "w0"]),
                     a + "v1": torch.zeros_like(state.get(ref + "v1", state[a + "w1"])),
                     a + "v2": torch.zeros_like(state.get(ref + "v2", state[a + "w2"]))}
        for name in CHANNEL_VECTORS:
            out[att + name] = state[a + name].reshape(1, 1, C)
        for name in LOW_RANK:
            out[att + name] = state[a + name]
        out[att + "r_k"] = state[a + "r_k"]
        for theirs, mine in LINEAR.items():
            out[f"{att}{theirs}.weight"] = state[f"{a}{mine}.weight"]
        _norm(out, att + "ln_x", state, a + "ln_x")
        out[b + "ffn.x_k"] = state[ours + "ffn.x_k"].reshape(1, 1, C)
        out[b + "ffn.key.weight"] = state[ours + "ffn.key.weight"]
        out[b + "ffn.value.weight"] = state[ours + "ffn.value.weight"]
    _norm(out, "ln_out", state, "norm")
    out["head.weight"] = state["lm_head.weight"]
    return out


def from_rwkv_lm(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """RWKV-LM names -> flame rwkv7 weights (fp32); `sd` has already been checked against the model's layout."""
    out = {"embed.weight": sd["emb.weight"]}
    _norm(out, "embed_norm", sd, "blocks.0.ln0")
    for i in range(num_layers):
        b, ours = f"blocks.{i}.", f"layers.{i}."
        a, att = ours + "attn.", b + "att."
        _norm(out, ours + "attn_norm", sd, b + "ln1")
        _norm(out, ours + "ffn_norm", sd, b + "ln2")
        out[a + "lerp"] = torch.stack([sd[att + name].reshape(-1) for name in LERP])
        for name in CHANNEL_VECTORS + LOW_RANK:
            if i > 0 or name not in ("v0", "v1", "v2"):
                out[a + name] = sd[att + name].reshape(-1) if name in CHANNEL_VECTORS else sd[att + name]
        out[a + "r_k"] = sd[att + "r_k"]
        for theirs, mine in LINEAR.items():
            out[f"{a}{mine}.weight"] = sd[f"{att}{theirs}.weight"]
        _norm(out, a + "ln_x", sd, att + "ln_x")
        out[ours + "ffn.x_k"] = sd[b + "ffn.x_k"].reshape(-1)
        out[ours + "ffn.key.weight"] = sd[b + "ffn.key.weight"]
        out[ours + "ffn.value.weight"] = sd[b + "ffn.value.weight"]
    _norm(out, "norm", sd, "ln_out")
    out["lm_head.weight"] = sd["head.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}


def args_from_shapes(sd: dict[str, torch.Tensor], file: Path):
    """flame rwkv7 settings read off an x070 checkpoint's tensors."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in sd:
            if name.endswith("att.r_k") and any(k.endswith("att.time_faaaa") for k in sd):
                raise ConvertError(f"{file}: an RWKV-LM checkpoint older than RWKV-6 (time_faaaa without "
                                   f"time_maa_x: x052 or before); flame reads x060 and x070")
            raise ConvertError(f"{file}: missing tensor {name} (not an RWKV-LM RWKV-7 x070 checkpoint?)")
        return tuple(sd[name].shape)

    vocab, hidden = shape("emb.weight")
    heads, head_dim = shape("blocks.0.att.r_k")
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks.") and k.split(".")[1].isdigit())
    ffn = shape("blocks.0.ffn.key.weight")[0]
    if ffn % hidden:
        raise ConvertError(f"{file}: tensor blocks.0.ffn.key.weight has {ffn} rows, not a multiple of the width "
                           f"{hidden} (flame's channel mix is ffn_mult * hidden_size wide)")
    v_layer = 1 if layers > 1 else 0
    fields = {"vocab_size": vocab, "hidden_size": hidden, "num_layers": layers, "head_dim": head_dim,
              "decay_low_rank": shape("blocks.0.att.w1")[1], "a_low_rank": shape("blocks.0.att.a1")[1],
              "v_low_rank": shape(f"blocks.{v_layer}.att.v1")[1], "gate_low_rank": shape("blocks.0.att.g1")[1],
              "ffn_mult": ffn // hidden, "norm_eps": 1e-5}   # RWKV-LM's LayerNorms keep torch's default eps
    if heads * head_dim != hidden:
        raise ConvertError(f"{file}: tensor blocks.0.att.r_k has shape {(heads, head_dim)}, "
                           f"but heads x head size must equal the width {hidden}")
    return build_args("rwkv7", fields, file)


def load_pth(path: Path) -> dict[str, torch.Tensor]:
    sd = load_torch_file(path)
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise ConvertError(f"{path}: not an RWKV-LM checkpoint (expected a flat dict of named tensors)")
    return sd


def read_rwkv_lm(path: Path) -> ModelState:
    sd = load_pth(path)
    if any(k.endswith(".att.time_maa_x") for k in sd):
        args = args_from_shapes_x060(sd, path)
        check_tensors(path, sd, to_rwkv_lm_x060(empty_state(args), args.num_layers))
        return ModelState(args, from_rwkv_lm_x060(sd, args.num_layers), str(path.resolve()))
    args = args_from_shapes(sd, path)
    expected = to_rwkv_lm(empty_state(args), args.num_layers)
    check_tensors(path, sd, expected, ignored=set(UNUSED_IN_LAYER_0))
    return ModelState(args, from_rwkv_lm(sd, args.num_layers), str(path.resolve()))


def write_rwkv_lm(dst: Path, model: ModelState) -> Path:
    """`dst` (a .pth) as RWKV-LM saves RWKV-7 or RWKV-6: loadable by RWKV-LM and by the rwkv package (fp32)."""
    writers = {"rwkv7": to_rwkv_lm, "rwkv6": to_rwkv_lm_x060}
    if model.args.name not in writers:
        raise ConvertError(f"{model.source}: --to rwkv-lm needs an RWKV-7 or RWKV-6 model, not {model.args.name!r}")
    if dst.suffix != ".pth":
        raise ConvertError(f"{dst}: an RWKV-LM checkpoint must be named *.pth (the rwkv package appends .pth)")
    out = standalone(writers[model.args.name](model.state, model.args.num_layers))
    with staged_output(dst) as tmp:
        torch.save(out, tmp)
    return dst


# RWKV-6 (x060)

MAA_ROWS = ("w", "k", "v", "r", "g")
"""RWKV-LM's att.time_maa_<x> for the rows of flame's attn.maa, in order."""
LINEAR_X060 = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj", "gate": "g_proj"}
SAME_X060 = {"time_maa_w1": "maa_w1", "time_maa_w2": "maa_w2", "time_decay_w1": "decay_w1",
             "time_decay_w2": "decay_w2", "time_faaaa": "bonus"}
"""Tensors held the same way by both (x @ w1 @ w2; the bonus [H, N])."""
VECTORS_X060 = {"time_maa_x": "maa_x", "time_decay": "decay"}
"""[C] in flame, [1, 1, C] in RWKV-LM."""


def to_rwkv_lm_x060(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """flame rwkv6 weights -> RWKV-LM x060 names and shapes (meta tensors give the expected layout)."""
    out = {"emb.weight": state["embed.weight"]}
    _norm(out, "blocks.0.ln0", state, "embed_norm")
    for i in range(num_layers):
        b, ours = f"blocks.{i}.", f"layers.{i}."
        a, att, ffn = ours + "attn.", b + "att.", b + "ffn."
        _norm(out, b + "ln1", state, ours + "attn_norm")
        _norm(out, b + "ln2", state, ours + "ffn_norm")
        C = state[a + "maa_x"].shape[0]
        for theirs, mine in VECTORS_X060.items():
            out[att + theirs] = state[a + mine].reshape(1, 1, C)
        for j, x in enumerate(MAA_ROWS):
            out[f"{att}time_maa_{x}"] = state[a + "maa"][j].reshape(1, 1, C)
        for theirs, mine in SAME_X060.items():
            out[att + theirs] = state[a + mine]
        for theirs, mine in LINEAR_X060.items():
            out[f"{att}{theirs}.weight"] = state[f"{a}{mine}.weight"]
        _norm(out, att + "ln_x", state, a + "ln_x")
        out[ffn + "time_maa_k"] = state[ours + "ffn.maa_k"].reshape(1, 1, C)
        out[ffn + "time_maa_r"] = state[ours + "ffn.maa_r"].reshape(1, 1, C)
        for name in ("key", "receptance", "value"):
            out[f"{ffn}{name}.weight"] = state[f"{ours}ffn.{name}.weight"]
    _norm(out, "ln_out", state, "norm")
    out["head.weight"] = state["lm_head.weight"]
    return out


def from_rwkv_lm_x060(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """RWKV-LM x060 names -> flame rwkv6 weights (fp32); `sd` has already been checked against the layout."""
    out = {"embed.weight": sd["emb.weight"]}
    _norm(out, "embed_norm", sd, "blocks.0.ln0")
    for i in range(num_layers):
        b, ours = f"blocks.{i}.", f"layers.{i}."
        a, att, ffn = ours + "attn.", b + "att.", b + "ffn."
        _norm(out, ours + "attn_norm", sd, b + "ln1")
        _norm(out, ours + "ffn_norm", sd, b + "ln2")
        for theirs, mine in VECTORS_X060.items():
            out[a + mine] = sd[att + theirs].reshape(-1)
        out[a + "maa"] = torch.stack([sd[f"{att}time_maa_{x}"].reshape(-1) for x in MAA_ROWS])
        for theirs, mine in SAME_X060.items():
            out[a + mine] = sd[att + theirs]
        for theirs, mine in LINEAR_X060.items():
            out[f"{a}{mine}.weight"] = sd[f"{att}{theirs}.weight"]
        _norm(out, a + "ln_x", sd, att + "ln_x")
        out[ours + "ffn.maa_k"] = sd[ffn + "time_maa_k"].reshape(-1)
        out[ours + "ffn.maa_r"] = sd[ffn + "time_maa_r"].reshape(-1)
        for name in ("key", "receptance", "value"):
            out[f"{ours}ffn.{name}.weight"] = sd[f"{ffn}{name}.weight"]
    _norm(out, "norm", sd, "ln_out")
    out["lm_head.weight"] = sd["head.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}


def args_from_shapes_x060(sd: dict[str, torch.Tensor], file: Path):
    """flame rwkv6 settings read off an x060 checkpoint's tensors."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in sd:
            raise ConvertError(f"{file}: missing tensor {name} (not an RWKV-LM RWKV-6 x060 checkpoint?)")
        return tuple(sd[name].shape)

    vocab, hidden = shape("emb.weight")
    faaaa = shape("blocks.0.att.time_faaaa")
    if len(faaaa) != 2 or faaaa[0] * faaaa[1] != hidden:
        raise ConvertError(f"{file}: tensor blocks.0.att.time_faaaa has shape {faaaa}, expected [heads, head size] "
                           f"with heads x head size = the width {hidden}")
    mix = shape("blocks.0.att.time_maa_w2")
    if len(mix) != 3 or mix[0] != len(MAA_ROWS):
        raise ConvertError(f"{file}: tensor blocks.0.att.time_maa_w2 has shape {mix}, expected [5, rank, {hidden}]")
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks.") and k.split(".")[1].isdigit())
    ffn = shape("blocks.0.ffn.key.weight")[0]
    fields = {"vocab_size": vocab, "hidden_size": hidden, "num_layers": layers, "head_dim": faaaa[1],
              "mix_low_rank": mix[1], "decay_low_rank": shape("blocks.0.att.time_decay_w1")[1],
              "ffn_size": None if ffn == int(hidden * 3.5) // 32 * 32 else ffn,
              "norm_eps": 1e-5}   # RWKV-LM's LayerNorms keep torch's default eps
    return build_args("rwkv6", fields, file)
