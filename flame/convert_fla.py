"""FLA (flash-linear-attention) / Hugging Face model folders <-> flame weights, for RWKV-7, RWKV-6 and GSA (FLA's
models) and the Transformer (transformers' Llama).

Such a folder is config.json (model_type, architectures and every field the config class writes) + the weights as
model.safetensors, sharded safetensors with model.safetensors.index.json, or pytorch_model.bin (+ its index), and
maybe tokenizer files. The folders written here load with transformers' AutoModelForCausalLM.from_pretrained: the
Transformer's as it is, the others once fla is imported. The model's settings come from config.json; every tensor's
name and shape is checked against them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from flame.export import (CONFIG, ConvertError, ModelState, build_args, check_tensors, copy_tokenizer, empty_state,
                          folder_tokenizer_files, load_torch_file, save_safetensors, staged_output, standalone)

RWKV_LM_GROUP_NORM_EPS = 64e-5
"""flame's (and RWKV-LM's) ln_x epsilon; FLA's is head_dim * norm_eps."""


def _require(cfg: dict, key: str, want, file: Path, default=None) -> None:
    got = cfg.get(key, default)
    if got != want:
        raise ConvertError(f"{file}: {key} = {got!r} is not supported (flame's model needs {want!r})")


def _int(cfg: dict, key: str, default, file: Path) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConvertError(f"{file}: {key} must be an integer, got {value!r}")
    return value


def _norm(out: dict, dst: str, state: dict, src: str, bias: bool = True) -> None:
    out[f"{dst}.weight"] = state[f"{src}.weight"]
    if bias:
        out[f"{dst}.bias"] = state[f"{src}.bias"]


# ------------------------------------------------------------------------------------------------------ RWKV-7
class RWKV7Layout:
    """FLA's RWKV7ForCausalLM: model.embeddings, model.layers.i.{pre_norm (layer 0: flame's embed_norm), attn_norm,
    attn, ffn_norm, ffn}, model.norm, lm_head. Inside attn: x_r..x_g [1, 1, C] (the rows of flame's lerp), and the
    low-rank paths as LoRA modules: {w,a,v,g}_lora.lora.0 = Linear(C, r) holding w1^T, lora.2 = Linear(r, C) holding
    w2^T with bias w0 (a0, v0; the gate's has no bias); g_norm = ln_x."""

    model_type, flame_name, architecture = "rwkv7", "rwkv7", "RWKV7ForCausalLM"
    LERP = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
    LORA = {"w": "w_lora", "a": "a_lora", "v": "v_lora", "g": "g_lora"}
    SAME = ("k_k", "k_a", "r_k", "r_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")

    def config(self, args) -> dict:
        C, L = args.hidden_size, args.num_layers
        return {
            "a_low_rank_dim": args.lora("a"), "architectures": [self.architecture], "attn": None, "attn_mode": "chunk",
            "bos_token_id": 1, "decay_low_rank_dim": args.lora("decay"), "dtype": "float32", "eos_token_id": 2,
            "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False, "fuse_norm": True,
            "gate_low_rank_dim": args.lora("gate"), "head_dim": args.head_dim, "hidden_act": "sqrelu",
            "hidden_ratio": args.ffn_mult, "hidden_size": C, "initializer_range": 0.02,
            "intermediate_size": args.ffn_mult * C, "max_position_embeddings": 2048, "model_type": self.model_type,
            "norm_bias": True, "norm_eps": args.norm_eps, "norm_first": True, "num_heads": C // args.head_dim,
            "num_hidden_layers": L, "pad_token_id": None, "tie_word_embeddings": False, "use_cache": True,
            "use_l2warp": True, "v_low_rank_dim": args.lora("v"), "value_dim": [C] * L,
            "vocab_size": args.vocab_size,
        }

    def check_writable(self, args, source: str) -> None:
        """Every flame RWKV-7 has an FLA counterpart."""

    def notes(self, args) -> list[str]:
        eps = args.head_dim * args.norm_eps
        if math.isclose(eps, RWKV_LM_GROUP_NORM_EPS, rel_tol=1e-6):
            return []
        return [f"FLA's ln_x (g_norm) epsilon is head_dim * norm_eps = {eps:g}, flame's is "
                f"{RWKV_LM_GROUP_NORM_EPS:g}: logits differ slightly between the two"]

    def args(self, cfg: dict, file: Path):
        if cfg.get("attn") is not None:
            raise ConvertError(f"{file}: attn = {cfg['attn']!r}: hybrid models with attention layers are not "
                               f"supported")
        _require(cfg, "norm_first", True, file, True)
        _require(cfg, "norm_bias", True, file, True)
        _require(cfg, "hidden_act", "sqrelu", file, "sqrelu")
        C = _int(cfg, "hidden_size", 2048, file)
        L = _int(cfg, "num_hidden_layers", 24, file)
        head_dim = cfg.get("head_dim", 64)
        if head_dim is None:
            head_dim = C // _int(cfg, "num_heads", None, file)
        value_dim = cfg.get("value_dim")
        if value_dim is not None and any(v != C for v in (value_dim if isinstance(value_dim, list) else [value_dim])):
            raise ConvertError(f"{file}: value_dim = {value_dim!r} is not supported (flame's RWKV-7 has value "
                               f"width = hidden_size = {C})")
        factor = head_dim / 64   # FLA widens the decay, a and v paths for heads over 64 when it picks the widths

        def rank(key: str, config_default: int, sqrt_factor: float, head_factor: float) -> int:
            r = cfg.get(key, config_default)
            return max(32, int(round(sqrt_factor * C ** 0.5 * head_factor / 32) * 32)) if r is None else r

        ratio = cfg.get("hidden_ratio", 4) or 4
        ffn = cfg.get("intermediate_size") or 32 * math.ceil(C * ratio / 32)
        if ffn % C:
            raise ConvertError(f"{file}: intermediate_size {ffn} is not a multiple of hidden_size {C} (flame's "
                               f"channel mix is ffn_mult * hidden_size wide)")
        fields = {"vocab_size": _int(cfg, "vocab_size", 32000, file), "hidden_size": C, "num_layers": L,
                  "head_dim": head_dim, "decay_low_rank": rank("decay_low_rank_dim", 64, 2.5, factor),
                  "a_low_rank": rank("a_low_rank_dim", 64, 2.5, factor),
                  "v_low_rank": rank("v_low_rank_dim", 16, 1.7, factor),
                  "gate_low_rank": rank("gate_low_rank_dim", 128, 5.0, 1.0), "ffn_mult": ffn // C,
                  "norm_eps": float(cfg.get("norm_eps", 1e-5))}
        return build_args(self.flame_name, fields, file)

    def to_fla(self, state: dict, args) -> dict:
        out = {"model.embeddings.weight": state["embed.weight"]}
        _norm(out, "model.layers.0.pre_norm", state, "embed_norm")
        C = args.hidden_size
        for i in range(args.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            a, att = ours + "attn.", theirs + "attn."
            _norm(out, theirs + "attn_norm", state, ours + "attn_norm")
            for j, name in enumerate(self.LERP):
                out[att + name] = state[a + "lerp"][j].reshape(1, 1, C)
            for name in self.SAME:
                out[att + name] = state[a + name]
            for x, lora in self.LORA.items():
                if x == "v" and i == 0:
                    continue
                out[f"{att}{lora}.lora.0.weight"] = state[f"{a}{x}1"].t()
                out[f"{att}{lora}.lora.2.weight"] = state[f"{a}{x}2"].t()
                if x != "g":
                    out[f"{att}{lora}.lora.2.bias"] = state[f"{a}{x}0"]
            _norm(out, att + "g_norm", state, a + "ln_x")
            _norm(out, theirs + "ffn_norm", state, ours + "ffn_norm")
            for name in ("x_k", "key.weight", "value.weight"):
                out[f"{theirs}ffn.{name}"] = state[f"{ours}ffn.{name}"]
        _norm(out, "model.norm", state, "norm")
        out["lm_head.weight"] = state["lm_head.weight"]
        return out

    def from_fla(self, sd: dict, args) -> dict:
        out = {"embed.weight": sd["model.embeddings.weight"]}
        _norm(out, "embed_norm", sd, "model.layers.0.pre_norm")
        for i in range(args.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            a, att = ours + "attn.", theirs + "attn."
            _norm(out, ours + "attn_norm", sd, theirs + "attn_norm")
            out[a + "lerp"] = torch.stack([sd[att + name].reshape(-1) for name in self.LERP])
            for name in self.SAME:
                out[a + name] = sd[att + name]
            for x, lora in self.LORA.items():
                if x == "v" and i == 0:
                    continue
                out[f"{a}{x}1"] = sd[f"{att}{lora}.lora.0.weight"].t()
                out[f"{a}{x}2"] = sd[f"{att}{lora}.lora.2.weight"].t()
                if x != "g":
                    out[f"{a}{x}0"] = sd[f"{att}{lora}.lora.2.bias"]
            _norm(out, a + "ln_x", sd, att + "g_norm")
            _norm(out, ours + "ffn_norm", sd, theirs + "ffn_norm")
            for name in ("x_k", "key.weight", "value.weight"):
                out[f"{ours}ffn.{name}"] = sd[f"{theirs}ffn.{name}"]
        _norm(out, "norm", sd, "model.norm")
        out["lm_head.weight"] = sd["lm_head.weight"]
        return out


# ------------------------------------------------------------------------------------------------------ RWKV-6
class RWKV6Layout:
    """FLA's RWKV6ForCausalLM: model.embeddings, model.layers.i.{pre_norm (layer 0: flame's embed_norm), attn_norm,
    attn, ffn_norm, ffn}, model.norm, lm_head. Inside attn: x_proj.0 (mu = flame's maa_x, linear = maa_w1^T),
    x_proj.2 (maa_w2) and x_bias (maa) hold the five mixes in the order r, w, k, v, g (flame's and RWKV-LM's: w, k,
    v, r, g); {r,k,v,g}_proj.linear the projections; w_proj.linear the decay path as a LoRA (lora.0 = decay_w1^T,
    lora.2 = decay_w2^T with bias decay); bonus; g_norm = ln_x. The channel mix's key and receptance are lerps
    (mu = maa_k, maa_r).

    FLA normalizes the heads' output at its one norm_eps (the LayerNorms' 1e-5), flame at RWKV-LM's 64e-5. A
    GroupNorm of s * o at eps equals one of o at eps / s^2, and o is linear in v: FLA's v_proj holds flame's v_proj
    times s = sqrt(norm_eps / 64e-5), 1/8 at 1e-5, a power of two, so the conversion is exact both ways."""

    model_type, flame_name, architecture = "rwkv6", "rwkv6", "RWKV6ForCausalLM"
    FLA_MIXES = ("r", "w", "k", "v", "g")
    """FLA's order of the five mixes (flame's is flame.models.rwkv6.MIXES)."""

    def config(self, args) -> dict:
        C = args.hidden_size
        return {
            "architectures": [self.architecture], "attn": None, "attn_mode": "chunk", "bos_token_id": 1,
            "dtype": "float32", "eos_token_id": 2, "expand_k": 1.0, "expand_v": 1.0, "fuse_cross_entropy": True,
            "fuse_linear_cross_entropy": False, "fuse_norm": True, "gate_low_rank_dim": args.decay_low_rank,
            "hidden_act": "sqrelu", "hidden_ratio": 3.5, "hidden_size": C, "initializer_range": 0.02,
            "intermediate_size": args.ffn_width, "max_position_embeddings": 2048, "model_type": self.model_type,
            "norm_bias": True, "norm_eps": args.norm_eps, "norm_first": True, "num_heads": C // args.head_dim,
            "num_hidden_layers": args.num_layers, "pad_token_id": None, "proj_low_rank_dim": args.mix_low_rank,
            "tie_word_embeddings": False, "use_cache": True, "use_l2warp": True, "vocab_size": args.vocab_size,
        }

    def check_writable(self, args, source: str) -> None:
        """Every flame RWKV-6 has an FLA counterpart."""

    def notes(self, args) -> list[str]:
        return []

    def args(self, cfg: dict, file: Path):
        if cfg.get("attn") is not None:
            raise ConvertError(f"{file}: attn = {cfg['attn']!r}: hybrid models with attention layers are not "
                               f"supported")
        for key, want, default in (("expand_k", 1, 0.5), ("expand_v", 1, 1), ("norm_first", True, True),
                                   ("norm_bias", True, True), ("hidden_act", "sqrelu", "sqrelu")):
            _require(cfg, key, want, file, default)
        C = _int(cfg, "hidden_size", 2048, file)
        heads = _int(cfg, "num_heads", 4, file)
        if heads < 1 or C % heads:
            raise ConvertError(f"{file}: num_heads = {heads} does not divide hidden_size = {C}")
        ratio = cfg.get("hidden_ratio", 3.5) or 3.5
        ffn = cfg.get("intermediate_size") or 32 * math.ceil(int(C * ratio) / 32)   # FLA rounds an unset width up
        fields = {"vocab_size": _int(cfg, "vocab_size", 32000, file), "hidden_size": C,
                  "num_layers": _int(cfg, "num_hidden_layers", 24, file), "head_dim": C // heads,
                  "mix_low_rank": _int(cfg, "proj_low_rank_dim", 32, file),
                  "decay_low_rank": _int(cfg, "gate_low_rank_dim", 64, file),
                  "ffn_size": None if ffn == int(C * 3.5) // 32 * 32 else ffn,   # None: RWKV-LM's width
                  "norm_eps": float(cfg.get("norm_eps", 1e-5))}
        return build_args(self.flame_name, fields, file)

    @staticmethod
    def v_scale(args) -> float:
        """FLA's v_proj over flame's (class docstring)."""
        from flame.models.rwkv6 import LN_X_EPS
        return math.sqrt(args.norm_eps / LN_X_EPS)

    def _pairs(self, args) -> list:
        """(flame name, FLA name, flame -> FLA, FLA -> flame) of every tensor."""
        from flame.models.rwkv6 import MIXES
        C, D, s = args.hidden_size, args.mix_low_rank, self.v_scale(args)
        order = [MIXES.index(m) for m in self.FLA_MIXES]     # FLA's mix n is flame's order[n]
        back = [order.index(j) for j in range(5)]            # flame's mix j is FLA's back[j]
        same = lambda x: x  # noqa: E731
        t = lambda x: x.t()  # noqa: E731

        def norm(ours: str, theirs: str) -> list:
            return [(f"{ours}.{p}", f"{theirs}.{p}", same, same) for p in ("weight", "bias")]

        pairs = [("embed.weight", "model.embeddings.weight", same, same),
                 *norm("embed_norm", "model.layers.0.pre_norm"), *norm("norm", "model.norm"),
                 ("lm_head.weight", "lm_head.weight", same, same)]
        for i in range(args.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            a, att, f, ffn = ours + "attn.", theirs + "attn.", ours + "ffn.", theirs + "ffn."
            pairs += [
                *norm(ours + "attn_norm", theirs + "attn_norm"), *norm(ours + "ffn_norm", theirs + "ffn_norm"),
                (a + "maa_x", att + "x_proj.0.mu", same, same),
                (a + "maa_w1", att + "x_proj.0.linear.weight",
                 lambda x: x.view(C, 5, D)[:, order].reshape(C, 5 * D).t(),
                 lambda x: x.t().reshape(C, 5, D)[:, back].reshape(C, 5 * D)),
                (a + "maa_w2", att + "x_proj.2.weight", lambda x: x[order].permute(2, 0, 1).reshape(C, 5 * D),
                 lambda x: x.reshape(C, 5, D).permute(1, 2, 0)[back]),
                (a + "maa", att + "x_bias", lambda x: x[order], lambda x: x[back]),
                *[(f"{a}{x}_proj.weight", f"{att}{x}_proj.linear.weight", same, same) for x in ("r", "k", "g")],
                (a + "v_proj.weight", att + "v_proj.linear.weight", lambda x: x * s, lambda x: x / s),
                (a + "decay_w1", att + "w_proj.linear.lora.0.weight", t, t),
                (a + "decay_w2", att + "w_proj.linear.lora.2.weight", t, t),
                (a + "decay", att + "w_proj.linear.lora.2.bias", same, same),
                (a + "bonus", att + "bonus", same, same),
                *norm(a + "ln_x", att + "g_norm"),
                (a + "o_proj.weight", att + "o_proj.weight", same, same),
                (f + "maa_k", ffn + "key.mu", same, same),
                (f + "key.weight", ffn + "key.linear.weight", same, same),
                (f + "maa_r", ffn + "receptance.mu", same, same),
                (f + "receptance.weight", ffn + "receptance.linear.weight", same, same),
                (f + "value.weight", ffn + "value.weight", same, same),
            ]
        return pairs

    def to_fla(self, state: dict, args) -> dict:
        return {theirs: to(state[ours]) for ours, theirs, to, _ in self._pairs(args)}

    def from_fla(self, sd: dict, args) -> dict:
        return {ours: back(sd[theirs]) for ours, theirs, _, back in self._pairs(args)}


# --------------------------------------------------------------------------------------------------------- GSA
class GSALayout:
    """FLA's GSAForCausalLM. flame's GSA uses FLA's names inside each block, so only the prefixes differ: FLA's
    model.embeddings / model.layers / model.norm are flame's embed / layers / norm (lm_head is lm_head)."""

    model_type, flame_name, architecture = "gsa", "gsa", "GSAForCausalLM"
    PREFIXES = (("embed.", "model.embeddings."), ("layers.", "model.layers."), ("norm.", "model.norm."),
                ("lm_head.", "lm_head."))
    FLA_G_NORM_EPS = 1e-5
    """FLA 0.6.0 normalizes the attention output inside its fused norm + o_proj at that function's default eps,
    whatever norm_eps says."""

    def config(self, args) -> dict:
        normalizer = args.gate_logit_normalizer
        return {
            "architectures": [self.architecture], "attn": None, "attnres_block_size": None, "bos_token_id": 1,
            "clamp_max": None, "clamp_min": None, "conv_size": args.conv_size, "dtype": "float32",
            "elementwise_affine": True, "eos_token_id": 2, "expand_k": 1, "expand_v": 1, "feature_map": "swish",
            "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False, "fuse_norm": True, "fuse_swiglu": True,
            "gate_logit_normalizer": int(normalizer) if float(normalizer).is_integer() else normalizer,
            "hidden_act": "swish", "hidden_ratio": args.hidden_ratio, "hidden_size": args.hidden_size,
            "initializer_range": args.initializer_range, "intermediate_size": args.intermediate_size,
            "max_position_embeddings": 2048, "model_type": self.model_type, "norm_eps": args.norm_eps,
            "num_heads": args.num_heads, "num_hidden_layers": args.num_layers, "num_kv_heads": None,
            "num_slots": args.num_slots, "pad_token_id": None, "tie_word_embeddings": False, "use_cache": True,
            "use_l2warp": False, "use_norm": True, "use_output_gate": False, "use_short_conv": args.use_short_conv,
            "vocab_size": args.vocab_size,
        }

    def check_writable(self, args, source: str) -> None:
        if args.output_gate:
            raise ConvertError(f"{source}: model.output_gate = true (attn.g_proj) has no counterpart in FLA's GSA; "
                               f"it cannot be converted to FLA")

    def notes(self, args) -> list[str]:
        if math.isclose(args.g_norm_eps, self.FLA_G_NORM_EPS, rel_tol=1e-6):
            return []
        return [f"FLA's GSA normalizes the attention output at eps {self.FLA_G_NORM_EPS:g}, this model at "
                f"g_norm_eps = {args.g_norm_eps:g}: logits differ slightly between the two"]

    def args(self, cfg: dict, file: Path):
        if cfg.get("attn") is not None:
            raise ConvertError(f"{file}: attn = {cfg['attn']!r}: hybrid models with attention layers are not "
                               f"supported")
        for key, want, default in (("expand_k", 1, 1), ("expand_v", 1, 1), ("feature_map", "swish", "swish"),
                                   ("use_norm", True, True), ("elementwise_affine", True, True),
                                   ("hidden_act", "swish", "swish"), ("attnres_block_size", None, None)):
            _require(cfg, key, want, file, default)
        C = _int(cfg, "hidden_size", 2048, file)
        heads = _int(cfg, "num_heads", 4, file)
        if cfg.get("num_kv_heads") not in (None, heads):
            raise ConvertError(f"{file}: num_kv_heads = {cfg['num_kv_heads']!r} is not supported (flame's GSA has "
                               f"as many key/value heads as heads, {heads})")
        slots = cfg.get("num_slots", 64)
        fields = {"vocab_size": _int(cfg, "vocab_size", 32000, file), "hidden_size": C,
                  "num_layers": _int(cfg, "num_hidden_layers", 24, file), "num_heads": heads,
                  "num_slots": C // heads if slots is None else slots,   # FLA: one slot per key channel when unset
                  "gate_logit_normalizer": float(cfg.get("gate_logit_normalizer", 8) or 8),
                  "use_short_conv": bool(cfg.get("use_short_conv", False)), "conv_size": cfg.get("conv_size", 4),
                  "hidden_ratio": cfg.get("hidden_ratio", 4) or 4, "intermediate_size": cfg.get("intermediate_size"),
                  "norm_eps": float(cfg.get("norm_eps", 1e-6)), "g_norm_eps": self.FLA_G_NORM_EPS,
                  "initializer_range": float(cfg.get("initializer_range", 0.02)), "output_gate": False}
        return build_args(self.flame_name, fields, file)

    def to_fla(self, state: dict, args) -> dict:
        return {self._rename(k, 0, 1): v for k, v in state.items()}

    def from_fla(self, sd: dict, args) -> dict:
        return {self._rename(k, 1, 0): v for k, v in sd.items()}

    def _rename(self, name: str, src: int, dst: int) -> str:
        for pair in self.PREFIXES:
            if name.startswith(pair[src]):
                return pair[dst] + name[len(pair[src]):]
        return name


# ---------------------------------------------------------------------------------------------------- Transformer
class LlamaLayout:
    """transformers' LlamaForCausalLM, which loads without FLA: flame's Transformer is Llama's architecture exactly
    (RMSNorm before attention and MLP, no biases anywhere, SwiGLU, RoPE on every head's whole width, grouped-query
    attention, an optional tied head), so the logits are the same; Qwen2's q/k/v biases would have no counterpart.
    Names: embed = model.embed_tokens, layers.i.{attn_norm, attn, mlp_norm, mlp} = model.layers.i.{input_layernorm,
    self_attn, post_attention_layernorm, mlp}, norm = model.norm. flame rotates channel pairs (2i, 2i+1) of a head,
    Llama pairs (i, i + head_dim/2) at the same frequency: Llama's q_proj and k_proj hold flame's rows in that order
    (even rows, then odd rows, per head). Scores are q . k, so reordering both alike leaves them unchanged."""

    model_type, flame_name, architecture = "llama", "transformer", "LlamaForCausalLM"
    RENAMES = (("embed.", "model.embed_tokens."), ("norm.", "model.norm."), ("lm_head.", "lm_head."))
    BLOCK = (("attn_norm.", "input_layernorm."), ("attn.", "self_attn."), ("mlp_norm.", "post_attention_layernorm."),
             ("mlp.", "mlp."))

    def config(self, args) -> dict:
        return {
            "architectures": [self.architecture], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": None, "dtype": "float32", "eos_token_id": None,
            "head_dim": args.hidden_size // args.num_heads, "hidden_act": "silu", "hidden_size": args.hidden_size,
            "initializer_range": args.init_std,
            "intermediate_size": args.ffn_size, "max_position_embeddings": 2048, "mlp_bias": False,
            "model_type": self.model_type, "num_attention_heads": args.num_heads,
            "num_hidden_layers": args.num_layers, "num_key_value_heads": args.kv_heads, "pad_token_id": None,
            "pretraining_tp": 1, "rms_norm_eps": args.norm_eps, "rope_scaling": None, "rope_theta": args.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},   # transformers >= 5
            "tie_word_embeddings": args.tie_embeddings, "use_cache": True, "vocab_size": args.vocab_size,
        }

    def check_writable(self, args, source: str) -> None:
        """Every flame Transformer is a Llama."""

    def notes(self, args) -> list[str]:
        return []

    def args(self, cfg: dict, file: Path):
        for key, want, default in (("hidden_act", "silu", "silu"), ("attention_bias", False, False),
                                   ("mlp_bias", False, False), ("pretraining_tp", 1, 1)):
            _require(cfg, key, want, file, default)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConvertError(f"{file}: rope type {kind!r} is not supported (flame's Transformer has plain RoPE)")
        C = _int(cfg, "hidden_size", 4096, file)
        heads = _int(cfg, "num_attention_heads", 32, file)
        if cfg.get("head_dim") not in (None, C // heads):
            raise ConvertError(f"{file}: head_dim = {cfg['head_dim']} is not supported (flame's Transformer has "
                               f"heads of hidden_size / num_attention_heads = {C // heads})")
        fields = {"vocab_size": _int(cfg, "vocab_size", 32000, file), "hidden_size": C,
                  "num_layers": _int(cfg, "num_hidden_layers", 32, file), "num_heads": heads,
                  "num_kv_heads": cfg.get("num_key_value_heads") or heads,
                  "intermediate_size": _int(cfg, "intermediate_size", 11008, file),
                  "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                  "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                  "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                  "init_std": float(cfg.get("initializer_range", 0.02))}
        return build_args(self.flame_name, fields, file)

    @staticmethod
    def _rotary_rows(w: torch.Tensor, head_dim: int, to_llama: bool) -> torch.Tensor:
        """q_proj / k_proj rows per head: flame's pairs (2i, 2i+1) as Llama's halves (i, i + head_dim/2), or back."""
        rows, cols = w.shape
        split = (rows // head_dim, head_dim // 2, 2, cols) if to_llama else (rows // head_dim, 2, head_dim // 2, cols)
        return w.reshape(split).transpose(1, 2).reshape(rows, cols)

    def _rename(self, name: str, to_llama: bool) -> str:
        src, dst = (0, 1) if to_llama else (1, 0)
        prefix = ("layers.", "model.layers.")
        if name.startswith(prefix[src]):
            index, _, rest = name[len(prefix[src]):].partition(".")
            for pair in self.BLOCK:
                if rest.startswith(pair[src]):
                    return f"{prefix[dst]}{index}.{pair[dst]}{rest[len(pair[src]):]}"
        for pair in self.RENAMES:
            if name.startswith(pair[src]):
                return pair[dst] + name[len(pair[src]):]
        return name

    def _convert(self, state: dict, args, to_llama: bool) -> dict:
        head_dim = args.hidden_size // args.num_heads
        out = {}
        for name, tensor in state.items():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                tensor = self._rotary_rows(tensor, head_dim, to_llama)
            out[self._rename(name, to_llama)] = tensor
        return out

    def to_fla(self, state: dict, args) -> dict:
        return self._convert(state, args, True)

    def from_fla(self, sd: dict, args) -> dict:
        return self._convert(sd, args, False)


LAYOUTS = {layout.model_type: layout for layout in (RWKV7Layout(), RWKV6Layout(), GSALayout(), LlamaLayout())}
"""FLA model_type -> its layout."""


def _layout_for_flame(name: str, source: str):
    for layout in LAYOUTS.values():
        if layout.flame_name == name:
            return layout
    raise ConvertError(f"{source}: --to fla has no FLA model for flame's {name!r} "
                       f"(FLA models: {', '.join(sorted(LAYOUTS))})")


# ------------------------------------------------------------------------------------------------ folders
def is_fla_folder(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model_type" in cfg


def load_weights(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of an HF folder, whichever of the usual weight layouts it uses, and the file to name in
    messages about them."""
    for index_name, loader in (("model.safetensors.index.json", _load_safetensors),
                               ("pytorch_model.bin.index.json", _load_bin)):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError, TypeError):
                raise ConvertError(f"{index}: not a weight index (no weight_map)") from None
            sd = {}
            for shard in shards:
                sd.update(loader(folder / shard))
            return sd, index
    for name, loader in (("model.safetensors", _load_safetensors), ("pytorch_model.bin", _load_bin)):
        if (folder / name).is_file():
            return loader(folder / name), folder / name
    raise ConvertError(f"{folder}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ConvertError(f"{path}: cannot read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") \
            from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    sd = load_torch_file(path, "PyTorch weight file")
    if not isinstance(sd, dict):
        raise ConvertError(f"{path}: not a state dict")
    return sd


def read_fla(folder: Path) -> ModelState:
    path = folder / CONFIG
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    layout = LAYOUTS.get(model_type)
    if layout is None:
        raise ConvertError(f"{path}: model_type {model_type!r} is not supported (supported: "
                           f"{', '.join(sorted(LAYOUTS))})")
    args = layout.args(cfg, path)
    sd, file = load_weights(folder)
    notes = layout.notes(args)
    embed = sd.get("model.embed_tokens.weight", sd.get("model.embeddings.weight"))
    head = sd.get("lm_head.weight")
    if cfg.get("tie_word_embeddings") and head is not None and not (embed is not None and torch.equal(head, embed)):
        # transformers (>= 5) then does not tie them: the folder's lm_head is the output layer, and so it is here
        notes.append(f"{path}: tie_word_embeddings = true, but lm_head.weight differs from the embedding: kept as "
                     "its own output layer, as transformers 5 loads it")
        if getattr(args, "tie_embeddings", False):
            args = dataclasses.replace(args, tie_embeddings=False)
    elif cfg.get("tie_word_embeddings") and getattr(args, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)   # a copy of the embedding some writers keep: flame's tied head has none
    elif cfg.get("tie_word_embeddings") and head is None and embed is not None:
        sd["lm_head.weight"] = embed.clone()   # flame's head is its own tensor (saved apart from the embedding)
    check_tensors(file, sd, layout.to_fla(empty_state(args), args))
    state = {k: v.float().contiguous() for k, v in layout.from_fla(sd, args).items()}
    tokenizer = folder_tokenizer_files(folder)
    return ModelState(args, state, str(folder.resolve()), None, tokenizer,
                      f"{folder} holds no tokenizer files; none copied", notes)


def write_fla(dst: Path, model: ModelState) -> Path:
    """`dst` as an FLA folder (config.json, model.safetensors in fp32, the tokenizer files), complete or absent."""
    layout = _layout_for_flame(model.args.name, model.source)
    layout.check_writable(model.args, model.source)
    sd = standalone(layout.to_fla(model.state, model.args))
    config = layout.config(model.args)
    try:   # FLA's save_pretrained records it; loading does not need it
        config["transformers_version"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    with staged_output(dst) as tmp:
        tmp.mkdir()
        save_safetensors(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_tokenizer(model.tokenizer, tmp)
    model.notes.extend(layout.notes(model.args))
    return dst
