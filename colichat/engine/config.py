"""What the forward pass needs to know about a model: one frozen ModelConfig, built once from GGUF
metadata by architectures.load_config (the keys every architecture has, then the architecture's own).

Axis letters in the comments: engine/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CTX = 16  # the smallest context a conversation has room in (a template's frame and a few words)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs, read once from GGUF metadata (and tensor presence)."""

    path: str
    arch: str
    name: str
    n_layer: int          # L
    n_embd: int           # D
    n_head: int           # H
    n_head_kv: int        # G: GQA KV heads (llama); informational for MLA
    n_ff: int             # F: dense FFN width
    n_vocab: int          # V
    n_ctx_train: int
    rms_eps: float
    # attention head sizes
    head_dim: int         # E: llama q/k/v head size
    rope_dim: int         # n_rot = 2I (deepseek2: R)
    rope_base: float
    rope_scaling: str     # "none" | "linear" | "yarn"
    rope_factor: float    # scaling factor (1.0 = none)
    rope_orig_ctx: int    # YaRN original context
    yarn_log_mul: float   # deepseek2: 0.1 * mscale_all_dim, as stored
    rope_attn_factor: float
    tied_output: bool     # no output.weight: logits use token_embd
    # MLA (deepseek2); zero for llama
    q_lora_rank: int = 0      # Q (0: attn_q, "lite")
    kv_lora_rank: int = 0     # C
    qk_nope: int = 0          # Dn
    qk_head: int = 0          # K = Dn + R
    v_head_dim: int = 0       # Dv
    mla_split: bool = False   # attn_k_b/attn_v_b present (else legacy attn_kv_b)
    n_dense: int = 0          # leading dense layers
    n_expert: int = 0         # X
    n_expert_used: int = 0    # U
    n_expert_shared: int = 0  # shared experts
    n_ff_exp: int = 0         # F of one routed expert
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating: int = 1    # 1 softmax, 2 sigmoid
    n_group: int = 0          # Y
    n_group_used: int = 0
    attn_temp_scale: float = 0.0  # Mistral-Large-3 query temperature tuning (0 = off)
    attn_temp_length: int = 0
    n_nextn: int = 0          # MTP (NextN) blocks after the trunk: blk.{n_layer}.. (never in the cache)
    sampling: tuple = ()      # the model's own sampling defaults (general.sampling.*): ((setting, value), ...)
    # sparse-attention MLA (deepseek32, glm-dsa): the lightning indexer; zero without one
    index_n_head: int = 0     # Hi
    index_head_dim: int = 0   # Di
    index_top_k: int = 0      # K keys attended per query
    index_types: tuple = ()   # per layer: 1 full indexer (owns Ic rows), 0 shared (reuses a selection)
    index_neox: bool = False  # indexer rope pairing: NEOX (deepseek32) or NORM (glm-dsa)
    index_eps: float = 0.0    # LayerNorm eps of the indexer key

    def __post_init__(self):
        object.__setattr__(self, "index_types", tuple(int(v) for v in self.index_types))  # JSON gives a list

    @property
    def output_weight(self) -> str:
        """The weight the logits multiply by: "output", or "token_embd" when tied (no output.weight)."""
        return "token_embd" if self.tied_output else "output"

    @property
    def n_index_layers(self) -> int:
        """Layers that own a full indexer: the nic of the cache record (0 without DSA)."""
        return sum(self.index_types)
