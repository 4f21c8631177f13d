"""Each model's configuration (the [model] table): its Args dataclass, checked by validate() when a config loads.

Apart from the models and their kernels (no torch here), so that reading and checking a config, as scripts/launch.sh
does before every run (flame.check_config), imports no torch; flame.models maps each model.name to its Args.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from flame.config import ModelArgs, check
from kernels.limits import GSA_MAX_SLOTS, RWKV6_MAX_K, RWKV7_MAX_K


@dataclass
class TransformerArgs(ModelArgs):
    name: str = "transformer"
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    num_kv_heads: int | None = None
    """Grouped-query attention; None = num_heads (plain multi-head)."""
    intermediate_size: int | None = None
    """SwiGLU width; None = 8/3 * hidden rounded up to a multiple of 256."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    loss_chunk_size: int = 4096
    """Tokens per chunk of the output projection + cross entropy."""

    def validate(self) -> None:
        super().validate()
        for key in ("hidden_size", "num_layers", "num_heads"):
            check(getattr(self, key) >= 1, f"model.{key}", "an integer >= 1", getattr(self, key))
        check(self.hidden_size % self.num_heads == 0, "model.num_heads", "a divisor of model.hidden_size",
              self.num_heads)
        check((self.hidden_size // self.num_heads) % 2 == 0, "model.num_heads", "an even head dim for RoPE",
              self.num_heads)
        kv = self.kv_heads
        check(kv >= 1 and self.num_heads % kv == 0, "model.num_kv_heads", "a divisor of model.num_heads", kv)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 256 * math.ceil(8 * self.hidden_size / 3 / 256)


def _lora_dim(hidden: int, factor: float) -> int:
    """RWKV-LM's default low-rank width: factor * sqrt(hidden), rounded to a multiple of 32, at least 32."""
    return max(32, int(round(factor * math.sqrt(hidden) / 32)) * 32)


@dataclass
class RWKVArgs(ModelArgs):
    """What RWKV-7 and RWKV-6 share, with their checks; each adds its own widths and its kernel's head-size limit."""

    hidden_size: int = 1024
    num_layers: int = 24
    head_dim: int = 64
    norm_eps: float = 1e-5
    loss_chunk_size: int = 4096
    """Tokens per chunk of the output projection + cross entropy."""
    l2wrap: bool = True
    """RWKV-LM trains RWKV-7 and RWKV-6 with L2Wrap (see ModelArgs.l2wrap)."""
    max_head_dim: ClassVar[int] = 0
    """The largest head size the model's Triton kernel builds (kernels/limits.py)."""

    def validate(self, positive: tuple[str, ...] = ()) -> None:
        """positive: the subclass's own keys that must be >= 1, checked beside the shared ones."""
        super().validate()
        for key in ("hidden_size", "num_layers", "head_dim", *positive):
            check(getattr(self, key) >= 1, f"model.{key}", "an integer >= 1", getattr(self, key))
        check(self.hidden_size % self.head_dim == 0, "model.head_dim", "a divisor of model.hidden_size",
              self.head_dim)
        check(self.head_dim <= self.max_head_dim, "model.head_dim",
              f"at most {self.max_head_dim} (the largest the Triton kernel builds)", self.head_dim)
        check(self.num_layers >= 2, "model.num_layers", "an integer >= 2 (the init interpolates over depth)",
              self.num_layers)


@dataclass
class RWKV7Args(RWKVArgs):
    name: str = "rwkv7"
    decay_low_rank: int | None = None
    """Low-rank width of the decay path; None = RWKV-LM's max(32, round(2.5 sqrt(hidden) / 32) * 32)."""
    a_low_rank: int | None = None
    """In-context learning rate path; None = 2.5 sqrt(hidden), as above."""
    v_low_rank: int | None = None
    """Value-residual path; None = 1.7 sqrt(hidden), as above."""
    gate_low_rank: int | None = None
    """Output gate path; None = 5 sqrt(hidden), as above."""
    ffn_mult: int = 4
    """Channel-mixing width = ffn_mult * hidden_size."""
    max_head_dim: ClassVar[int] = RWKV7_MAX_K

    def validate(self) -> None:
        super().validate(("ffn_mult",))

    def lora(self, which: str) -> int:
        given = getattr(self, f"{which}_low_rank")
        return given or _lora_dim(self.hidden_size, {"decay": 2.5, "a": 2.5, "v": 1.7, "gate": 5.0}[which])


@dataclass
class RWKV6Args(RWKVArgs):
    name: str = "rwkv6"
    mix_low_rank: int = 32
    """Width of each of the five token-shift mix paths (RWKV-LM's D_MIX_LORA)."""
    decay_low_rank: int = 64
    """Width of the decay path (RWKV-LM's D_DECAY_LORA)."""
    ffn_size: int | None = None
    """Channel-mixing width; None = RWKV-LM's int(3.5 * hidden_size) // 32 * 32."""
    max_head_dim: ClassVar[int] = RWKV6_MAX_K

    def validate(self) -> None:
        super().validate(("mix_low_rank", "decay_low_rank"))
        if self.ffn_size is not None:
            check(self.ffn_size >= 1, "model.ffn_size", "an integer >= 1 (or unset)", self.ffn_size)

    @property
    def ffn_width(self) -> int:
        return self.ffn_size or int(self.hidden_size * 3.5) // 32 * 32


@dataclass
class GSAArgs(ModelArgs):
    name: str = "gsa"
    hidden_size: int = 1024
    """Model width; also the total key and value width (head dims = hidden_size / num_heads)."""
    num_layers: int = 24
    """Number of blocks (FLA's num_hidden_layers)."""
    num_heads: int = 4
    """GSA heads; each holds M slots of a (hidden_size / num_heads)-dim key and value."""
    num_slots: int = 64
    """M, memory slots per head."""
    gate_logit_normalizer: float = 8.0
    """Forget gate = logsigmoid(W_f x) / this: larger keeps the slots longer (the paper's damping tau)."""
    use_short_conv: bool = False
    """Causal depthwise convolutions (then silu) on q, k, v before their feature maps."""
    conv_size: int = 4
    """Kernel length of the short convolutions."""
    hidden_ratio: int = 4
    """SwiGLU width if intermediate_size is unset: int(hidden * hidden_ratio * 2/3) up to a multiple of 256."""
    intermediate_size: int | None = None
    """SwiGLU width; None = from hidden_ratio."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon of the blocks and the final norm."""
    g_norm_eps: float = 1e-5
    """Epsilon of the attention output RMSNorm: FLA's fused norm + o_proj runs at its default 1e-5, not norm_eps."""
    initializer_range: float = 0.02
    """Std of the normal init of every matrix, convolution and the embedding (no residual rescaling)."""
    output_gate: bool = False
    """Not in FLA: per-head RMSNorm(o) * silu(g_proj(x)) (one more hidden^2 matrix) in place of RMSNorm(silu(o))."""
    loss_chunk_size: int = 4096
    """Tokens per chunk of the output projection + cross entropy."""

    def validate(self) -> None:
        super().validate()
        for key in ("hidden_size", "num_layers", "num_heads", "num_slots", "conv_size", "hidden_ratio"):
            check(getattr(self, key) >= 1, f"model.{key}", "an integer >= 1", getattr(self, key))
        check(self.hidden_size % self.num_heads == 0, "model.num_heads", "a divisor of model.hidden_size",
              self.num_heads)
        check(self.num_slots <= GSA_MAX_SLOTS, "model.num_slots",
              f"at most {GSA_MAX_SLOTS} (the largest the Triton kernel builds)", self.num_slots)
        check(self.gate_logit_normalizer > 0, "model.gate_logit_normalizer", "a number > 0",
              self.gate_logit_normalizer)
        check(self.intermediate_size is None or self.intermediate_size >= 1, "model.intermediate_size",
              "an integer >= 1 or unset", self.intermediate_size)
        check(self.norm_eps > 0, "model.norm_eps", "a number > 0", self.norm_eps)
        check(self.g_norm_eps > 0, "model.g_norm_eps", "a number > 0", self.g_norm_eps)
        check(self.initializer_range > 0, "model.initializer_range", "a number > 0", self.initializer_range)

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 256 * math.ceil(int(self.hidden_size * self.hidden_ratio * 2 / 3) / 256)
