"""In-memory KV cache: one preallocated buffer of per-token records, laid out like the file record.

The record, one token's entry, is the same bytes here and in a session's KV file (this is where it
is described; FORMAT.md and persist/kvfile.py, which frame it in a file, point here):

    int32 token id
    for each layer 0..L-1:
        the A rows   MLA (deepseek2): c, the normalized latent (A = kv_lora_rank)
                     GQA (llama):     K, the roped keys, head-major (A = n_head_kv * head_dim)
        the B rows   MLA: k_pe, the roped shared key (B = qk_rope_head_dim);  GQA: V (B = A)
    for each of the nic layers that own a full indexer, in layer order (sparse-attention MLA:
    deepseek32 every layer, glm-dsa those whose indexer type is 1):
        Di f32       Ic, the token's indexer key (after LayerNorm and RoPE, not Hadamard-rotated)

Little-endian, no padding; MTP (NextN) blocks are never part of it. In f32 a layer's rows are A then
B floats, so a record is 4 + 4 x (L x (A + B) + nic x Di) bytes (`record_bytes`): for MLA exactly
colibri's COLIKV1 record. So persistence moves whole records with one read or write (`records`),
and the engine reads per-layer strided views (`a[l]`, `b[l]`) without copies.

A compact cache (`codec` fp8 or int4: colibri's COLIKV2 and COLIKV3 rows, kvcodec.py says each bit)
stores every row as its codes and an f32 scale, in the same order (`stored_record_bytes`): MLA's c
and k_pe are one row each (an fp8 record is colibri's COLIKV2 record exactly); a GQA layer is one
row per head (`row_width` = head_dim), K heads then V heads; the token and the Ic rows stay as they
are. It keeps that stored record too (`stored`): a row is encoded as it enters (`round_rows`, called
by the layer that wrote it, before attention reads it) and the f32 row is replaced by what the codes
decode to. So the engine attends over exactly what a file gives back, and a resumed conversation is
the one that never stopped.

Axis letters: engine/__init__.py (N cache rows, L layers, A/B the widths above, Di the indexer
key width).
"""

from __future__ import annotations

import numpy as np

from . import kvcodec


def record_bytes(n_layer: int, a_width: int, b_width: int, index_hd: int = 0, n_index_layers: int = 0) -> int:
    """Bytes of one record: the int32 token, L x (A + B) f32, then nic x Di f32 (the Ic rows)."""
    return 4 + 4 * (n_layer * (a_width + b_width) + n_index_layers * index_hd)


def stored_record_bytes(n_layer: int, a_width: int, b_width: int, codec: str, row_width: int = 0,
                        index_hd: int = 0, n_index_layers: int = 0) -> int:
    """Bytes of one record as a file in `codec` stores it: the int32 token, per layer the A rows then
    the B rows (each `row_width` wide; 0: A and B are one row each, MLA's c and k_pe), then the f32
    Ic rows. ValueError for a codec the widths cannot take (int4 rows need a power of two)."""
    if codec == "f32":
        return record_bytes(n_layer, a_width, b_width, index_hd, n_index_layers)
    wa, wb = (row_width, row_width) if row_width else (a_width, b_width)
    per_layer = a_width // wa * kvcodec.row_bytes(wa, codec) + b_width // wb * kvcodec.row_bytes(wb, codec)
    return 4 + n_layer * per_layer + 4 * n_index_layers * index_hd


class KVCache:
    def __init__(self, kind: str, n_layer: int, a_width: int, b_width: int, capacity: int,
                 index_hd: int = 0, n_index_layers: int = 0, row_width: int = 0):
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
        self.row_width = row_width  # GQA: head_dim, the width of one compact row (0: A and B whole)
        self.codec = "f32"
        self.stored = None  # (N,) stored records, for a compact codec

    def set_codec(self, codec: str) -> None:
        """Keep rows as `codec` stores them from now on (the cache is emptied: its rows were not).
        ValueError for a codec these widths cannot take."""
        if codec == self.codec:
            return
        self.length = 0
        if codec == "f32":
            self.codec, self.stored = codec, None
            return
        wa, wb = self._row_widths()
        ba, bb = self.a_width // wa * kvcodec.row_bytes(wa, codec), self.b_width // wb * kvcodec.row_bytes(wb, codec)
        fields = [("token", "<i4"), ("kv", "u1", (self.n_layer, ba + bb))]
        if self.n_index_layers:
            fields.append(("ic", "<f4", (self.n_index_layers, self.index_hd)))
        self.stored = np.zeros(self.capacity, dtype=np.dtype(fields))  # (N,) records as the file holds them
        self.codec, self._split = codec, ba

    def codec_problem(self, codec: str) -> str | None:
        """Why this cache's rows cannot be kept in `codec` (int4 rows must be a power of two wide), or None."""
        return next(filter(None, (kvcodec.width_problem(w, codec) for w in self._row_widths())), None)

    def _row_widths(self) -> tuple[int, int]:
        return (self.row_width, self.row_width) if self.row_width else (self.a_width, self.b_width)

    def round_rows(self, l: int, start: int, stop: int) -> None:
        """Rows [start, stop) of layer l were just written: store them in the codec and put back in
        their place what the stored bytes decode to (a no-op for f32)."""
        if self.stored is None or stop <= start:
            return
        (wa, wb), kv = self._row_widths(), self.stored["kv"][start:stop, l]  # (T, bytes)
        t = stop - start
        for rows, w, out in ((self.a[l], wa, kv[:, : self._split]), (self.b[l], wb, kv[:, self._split :])):
            codes = kvcodec.encode_rows(rows[start:stop].reshape(-1, w), self.codec)  # (T*rows, row bytes)
            out[:] = codes.reshape(t, -1)
            rows[start:stop] = kvcodec.decode_rows(codes, w, self.codec).reshape(t, -1)

    def loaded(self, n: int) -> None:
        """Records [0, n) were read into `raw` from a file: make the rows the engine reads from them."""
        if self.stored is None or n == 0:
            return
        s, (wa, wb) = self.stored[:n], self._row_widths()
        self.tokens[:n] = s["token"]
        if self.n_index_layers:
            self.records["ic"][:n] = s["ic"]
        for l in range(self.n_layer):
            codes = s["kv"][:, l]  # (n, bytes)
            self.a[l][:n] = kvcodec.decode_rows(codes[:, : self._split].reshape(-1, kvcodec.row_bytes(wa, self.codec)),
                                                wa, self.codec).reshape(n, -1)
            self.b[l][:n] = kvcodec.decode_rows(codes[:, self._split :].reshape(-1, kvcodec.row_bytes(wb, self.codec)),
                                                wb, self.codec).reshape(n, -1)

    @property
    def stored_bytes(self) -> int:
        """Bytes of one record as a file holds it (`raw`)."""
        return self.record_bytes if self.stored is None else self.stored.dtype.itemsize

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
        """The bytes of records [start, stop): what a file holds for those tokens (also where a load
        reads them to, then `loaded`)."""
        if self.stored is None:
            return memoryview(self.records[start:stop]).cast("B")
        s = self.stored[start:stop]
        s["token"] = self.tokens[start:stop]  # (the token and the Ic rows are kept as they are)
        if self.n_index_layers:
            s["ic"] = self.records["ic"][start:stop]
        return memoryview(s).cast("B")
