"""In-memory KV cache: one preallocated buffer of per-token records, laid out like the file record.

A record is: int32 token id, then for every layer `A` floats then `B` floats (no padding):
  MLA (deepseek2): A = c, the normalized latent (kv_lora_rank); B = k_pe, the roped shared key (qk_rope).
  GQA (llama):     A = roped keys (n_head_kv * head_dim);     B = values (n_head_kv * head_dim).
then, for sparse-attention MLA (deepseek32, glm-dsa), `Di` floats for each of the `nic` layers
that own a full indexer, in layer order: Ic, the token's indexer key (LayerNorm'd, roped).
This is exactly the COLIKV1 record, so persistence moves whole records with one read or write
(`records`), and the engine reads per-layer strided views (`a[l]`, `b[l]`) without copies.

Axis letters: engine/__init__.py (N cache rows, L layers, A/B the widths above, Di the indexer
key width).
"""

from __future__ import annotations

import numpy as np


def record_bytes(n_layer: int, a_width: int, b_width: int, index_hd: int = 0, n_index_layers: int = 0) -> int:
    """Bytes of one record: the int32 token, L x (A + B) f32, then nic x Di f32 (the Ic rows)."""
    return 4 + 4 * (n_layer * (a_width + b_width) + n_index_layers * index_hd)


class KVCache:
    def __init__(self, kind: str, n_layer: int, a_width: int, b_width: int, capacity: int,
                 index_hd: int = 0, n_index_layers: int = 0):
        assert kind in ("mla", "gqa")
        assert (index_hd > 0) == (n_index_layers > 0) and (kind == "mla" or not n_index_layers)
        self.kind = kind
        self.n_layer = n_layer
        self.a_width = a_width
        self.b_width = b_width
        self.index_hd = index_hd  # Di (0: no indexer)
        self.n_index_layers = n_index_layers  # nic
        self.capacity = capacity
        fields = [("token", "<i4"), ("kv", "<f4", (n_layer, a_width + b_width))]
        if n_index_layers:
            fields.append(("ic", "<f4", (n_index_layers, index_hd)))
        self.record = np.dtype(fields)
        # np.zeros maps fresh zero pages lazily: memory is touched only as rows are written.
        self.records = np.zeros(capacity, dtype=self.record)  # (N,) records
        self.tokens = self.records["token"]  # (N,) int32 view
        kv = self.records["kv"]  # (N, L, A+B) view
        self.a = [kv[:, l, :a_width] for l in range(n_layer)]  # L x (N, A) strided views
        self.b = [kv[:, l, a_width:] for l in range(n_layer)]  # L x (N, B) strided views
        ic = self.records["ic"] if n_index_layers else None  # (N, nic, Di) view
        self.ic = [ic[:, j] for j in range(n_index_layers)]  # nic x (N, Di) strided views
        self.length = 0

    @property
    def record_bytes(self) -> int:
        return self.record.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return self.record_bytes - 4  # all but the token id

    def room(self) -> int:
        return self.capacity - self.length

    def token_ids(self) -> list[int]:
        return self.tokens[: self.length].tolist()

    def truncate(self, n: int) -> None:
        """Keep the first n rows. Rows past n are dead and get overwritten by the next tokens."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def set_length(self, n: int) -> None:
        """After rows were filled from outside (resume): declare the first n rows valid."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"{n} rows do not fit a cache of {self.capacity}")
        self.length = n

    def raw(self, start: int, stop: int) -> memoryview:
        """The bytes of records [start, stop): what a file holds for those tokens."""
        return memoryview(self.records[start:stop]).cast("B")
