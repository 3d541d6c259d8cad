"""A decoder-only transformer's shape: read from an HF ``config.json`` or shardline's GPT, with its FLOPs.

FLOPs count multiply-adds as two. Per token, a forward pass costs ``2 * P_mm`` for the matmul
weights ``P_mm`` (every block's projections and the output head; embedding lookups are not
matmuls) plus attention's two ``seq x seq`` products, ``4 * seq * d_attn`` per layer, counted
for the full (non-causal) square as the published runs count them. Backward costs twice the
forward. Activation checkpointing adds forward work again: ``full`` each block's whole forward,
``selective`` each block's MLP (the widest activations, the cheapest to store again).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from shardline.errors import ConfigurationError

if TYPE_CHECKING:
    from shardline.models.gpt import GPTConfig

__all__ = ["ActivationCheckpointing", "Architecture", "from_gpt_config", "load_hf_config"]


class ActivationCheckpointing(str, enum.Enum):
    """What backward recomputes: nothing, each block's MLP, or each whole block."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @classmethod
    def parse(cls, value: ActivationCheckpointing | str) -> ActivationCheckpointing:
        """The member for ``value`` (a member or its name, any case)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ConfigurationError(
                f"unknown activation checkpointing {value!r}; choose one of {[m.value for m in cls]}"
            ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    """The shape of a pre-norm decoder-only transformer.

    Attributes:
        name: What it is called in tables.
        vocab_size: Token ids.
        dim: Width of the residual stream.
        n_layers: Decoder blocks (the units shardline shards and checkpoints).
        n_heads: Query heads.
        n_kv_heads: Key/value heads (grouped-query attention; ``n_heads`` for plain attention).
        ffn_dim: Hidden width of the MLP.
        gated_mlp: SwiGLU-style MLP (three projections) instead of two with a GELU.
        rms_norm: RMSNorm (one weight) instead of LayerNorm (weight and bias).
        bias: Linear layers have biases.
        tied_embeddings: The output head shares the token embedding.
        max_positions: Learned position embeddings of this many positions (0: rotary, no parameters).
        shardline_gpt: It is :class:`shardline.models.gpt.GPT` (the memory estimate builds that
            module itself rather than the planner's stand-in).
    """

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    gated_mlp: bool = False
    rms_norm: bool = False
    bias: bool = True
    tied_embeddings: bool = True
    max_positions: int = 0
    shardline_gpt: bool = False

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, key) < 1:
                raise ConfigurationError(f"model {self.name}: {key} must be >= 1, got {getattr(self, key)}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ConfigurationError(
                f"model {self.name}: n_heads={self.n_heads} must divide dim={self.dim} and be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.dim // self.n_heads * self.n_kv_heads

    @property
    def attention_matmul_params(self) -> int:
        """Weights of one block's attention projections (q, k, v, output)."""
        return self.dim * (2 * self.dim + 2 * self.kv_dim)

    @property
    def mlp_matmul_params(self) -> int:
        """Weights of one block's MLP projections."""
        return (3 if self.gated_mlp else 2) * self.dim * self.ffn_dim

    @property
    def block_params(self) -> int:
        """Parameters of one block: projections, their biases, two norms."""
        biases = (2 * self.dim + 2 * self.kv_dim) + (self.ffn_dim * (2 if self.gated_mlp else 1) + self.dim)
        norms = 2 * self.dim * (1 if self.rms_norm else 2)
        return self.attention_matmul_params + self.mlp_matmul_params + (biases if self.bias else 0) + norms

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks: embeddings, final norm, untied head."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.dim
        norm = self.dim * (1 if self.rms_norm else 2)
        return self.vocab_size * self.dim + self.max_positions * self.dim + norm + head

    @property
    def num_params(self) -> int:
        """All parameters (tied embeddings counted once)."""
        return self.n_layers * self.block_params + self.root_params

    def forward_flops(self, seq_len: int, *, blocks_only: bool = False) -> float:
        """Forward FLOPs per token: matmuls and attention (``blocks_only``: without the output head)."""
        per_block = 2 * (self.attention_matmul_params + self.mlp_matmul_params) + 4 * seq_len * self.dim
        head = 0 if blocks_only else 2 * self.vocab_size * self.dim
        return float(self.n_layers * per_block + head)

    def model_flops(self, seq_len: int) -> float:
        """Training FLOPs per token without recomputation (forward + backward): what MFU divides."""
        return 3.0 * self.forward_flops(seq_len)

    def recompute_flops(self, seq_len: int, ac: ActivationCheckpointing | str) -> float:
        """Forward FLOPs per token that backward repeats under activation checkpointing ``ac``."""
        ac = ActivationCheckpointing.parse(ac)
        if ac is ActivationCheckpointing.FULL:
            return self.forward_flops(seq_len, blocks_only=True)
        if ac is ActivationCheckpointing.SELECTIVE:
            return float(self.n_layers * 2 * self.mlp_matmul_params)
        return 0.0


_LLAMA_LIKE = ("llama", "mistral", "qwen2")
_UNDERSTOOD = (*_LLAMA_LIKE, "gpt2", "gpt_neox")


def _get(cfg: dict[str, Any], path: Path, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is not None:
        return default
    raise ConfigurationError(f"{path}: no {' or '.join(keys)} in the config; a {cfg.get('model_type')} config has it")


class _Common(TypedDict):
    """The fields every Llama-like config.json names the same way."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int


def load_hf_config(path: str | Path) -> Architecture:
    """The :class:`Architecture` of an HF ``config.json`` (Llama/Mistral/Qwen2, GPT-2, GPT-NeoX decoders)."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigurationError(f"cannot read --hf-config {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"--hf-config {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in _UNDERSTOOD or cfg.get("is_encoder_decoder"):
        raise ConfigurationError(
            f"--hf-config {path} has model_type {kind!r}, not a decoder shardline plan understands "
            f"({', '.join(_UNDERSTOOD)}); describe the model with overrides (model.dim=... model.n_layers=...) instead"
        )
    name = str(cfg.get("_name_or_path") or path.parent.name or kind)
    if kind == "gpt2":
        dim = int(_get(cfg, path, "n_embd"))
        return Architecture(
            name=name,
            vocab_size=int(_get(cfg, path, "vocab_size")),
            dim=dim,
            n_layers=int(_get(cfg, path, "n_layer")),
            n_heads=int(_get(cfg, path, "n_head")),
            n_kv_heads=int(_get(cfg, path, "n_head")),
            ffn_dim=int(cfg.get("n_inner") or 4 * dim),
            max_positions=int(_get(cfg, path, "n_positions", "n_ctx")),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )
    heads = int(_get(cfg, path, "num_attention_heads"))
    common: _Common = {
        "name": name,
        "vocab_size": int(_get(cfg, path, "vocab_size")),
        "dim": int(_get(cfg, path, "hidden_size")),
        "n_layers": int(_get(cfg, path, "num_hidden_layers")),
        "n_heads": heads,
        "ffn_dim": int(_get(cfg, path, "intermediate_size")),
    }
    if kind == "gpt_neox":
        return Architecture(n_kv_heads=heads, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), **common)
    return Architecture(
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        gated_mlp=True,
        rms_norm=True,
        bias=bool(cfg.get("attention_bias", kind == "qwen2") or cfg.get("mlp_bias", False)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **common,
    )


def from_gpt_config(cfg: GPTConfig, *, name: str = "GPT") -> Architecture:
    """The :class:`Architecture` of shardline's own :class:`~shardline.models.gpt.GPTConfig`."""
    return Architecture(
        name=name,
        vocab_size=cfg.vocab_size,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        ffn_dim=cfg.mlp_ratio * cfg.dim,
        max_positions=cfg.seq_len,
        tied_embeddings=cfg.tie_embeddings,
        shardline_gpt=True,
    )
