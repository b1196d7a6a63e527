"""SentencePiece tokenizer (`tokenizer.ggml.model = llama`), token-for-token compatible with llama.cpp.

llama.cpp runs these vocabularies with its own score-driven merge (not the sentencepiece library):

1. Special-token partition, as for BPE (tokenizer.py): CONTROL/UNKNOWN tokens when `special=True`,
   USER_DEFINED tokens always; longest token text first.
2. Every text fragment gets a leading space when `add_space_prefix` is set (the default) and it
   opens the text or follows a special token; then every ' ' becomes the marker '▁' (U+2581).
   There is no pre-tokenizer: a fragment is merged as one piece.
3. The fragment's UTF-8 bytes are cut into symbols, one per character (a lead byte says how many
   bytes; an invalid byte is a symbol of its own length, cut short at the end).
4. Merge: of all adjacent symbol pairs whose concatenation is a token, merge the one whose token
   has the highest score (ties: leftmost), and repeat until no pair is a token.
5. A symbol that is a token is emitted; any other is emitted byte by byte as the byte-fallback
   tokens `<0xNN>` (or a token that is the byte itself).

Decoding: NORMAL tokens give their text with '▁' turned back into ' ', BYTE tokens their byte,
CONTROL/UNKNOWN tokens nothing unless `special=True`, USER_DEFINED tokens their text. `decode`
drops the one leading space the first token carries when `add_space_prefix` is set (llama.cpp's
detokenize); `stream()` keeps it, as llama.cpp's token-by-token output does.
"""

from __future__ import annotations

import heapq

from ...errors import ModelError
from .pretokenizer import SURROGATE
from .tokenizer import Tokenizer

SPACE = "\u2581"  # '▁', the space marker
# UTF-8 sequence length from a byte's high nibble (continuation and invalid bytes: 1)
_UTF8_LEN = (1,) * 12 + (2, 2, 3, 4)


class SentencePieceTokenizer(Tokenizer):
    """A GGUF SentencePiece vocabulary (tokens, scores, types). Build with `load_tokenizer`."""

    def __init__(self, meta: dict, where: str = "model"):
        self.pre = "default"
        self._read_vocab(meta, where)
        n = self.n_vocab
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) < n:
            raise ModelError(f"{where}: {len(scores)} token scores for {n} tokens")
        self._score = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        self._read_specials(meta, 1, 2, True)  # llama.cpp's SentencePiece defaults: <s> 1, </s> 2
        self.unk_id = self._special_id("unknown_token_id", 0)

        # the token of every byte value: <0xNN>, else the byte itself
        self._byte_ids = []
        for b in range(256):
            i = self._ids.get(f"<0x{b:02X}>")
            if i is None:
                i = self._ids.get(chr(b), self.unk_id) if b < 0x80 else self.unk_id  # llama.cpp fails
            self._byte_ids.append(i)
        self._bids: dict[bytes, int] | None = None  # ids by UTF-8 text, for text with invalid bytes

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of `text`. `special=True` also parses CONTROL tokens (USER_DEFINED always)."""
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        after_special = True  # the text start counts as following a special token
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                ids.append(frag)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                frag = " " + frag
            after_special = False
            ids.extend(self._encode_piece(frag.replace(" ", SPACE)))
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            if piece.isascii() or not SURROGATE.search(piece):
                ids = self._merge_ids(piece, self._ids)  # one symbol per character
            else:  # undecodable input bytes: merge the bytes llama.cpp would see
                if self._bids is None:
                    self._bids = {t.encode("utf-8"): i for t, i in self._ids.items()}
                ids = self._merge_ids(_utf8(piece), self._bids)
            if len(self._cache) > 200_000:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def _merge_ids(self, data: str | bytes, ids_of: dict) -> list[int]:
        """llama.cpp's llm_tokenizer_spm: highest-score merges with a heap over a linked list.

        `data` is text (a symbol per character) or UTF-8 bytes (a symbol per lead byte and the
        length it announces), with `ids_of` keyed alike."""
        score = self._score
        if isinstance(data, str):
            start, size = list(range(len(data))), [1] * len(data)
        else:
            start, size = [], []  # symbol k is data[start[k] : start[k] + size[k]]
            off, n = 0, len(data)
            while off < n:
                k = min(_UTF8_LEN[data[off] >> 4], n - off)
                start.append(off)
                size.append(k)
                off += k
        nxt = list(range(1, len(start))) + [-1]
        prv = list(range(-1, len(start) - 1))
        heap: list[tuple[float, int, int]] = []  # (-score, left, merged size): best score, then leftmost

        def push(a: int, b: int) -> None:
            if a >= 0 and b >= 0:
                i = ids_of.get(data[start[a] : start[a] + size[a] + size[b]])
                if i is not None:
                    heapq.heappush(heap, (-score[i], a, size[a] + size[b]))

        for k in range(len(start) - 1):
            push(k, k + 1)
        while heap:
            _, a, merged = heapq.heappop(heap)
            b = nxt[a]
            if b < 0 or size[a] == 0 or size[b] == 0 or size[a] + size[b] != merged:
                continue  # stale: one side was merged into something else since
            size[a], size[b] = merged, 0
            nxt[a] = nxt[b]
            if nxt[b] >= 0:
                prv[nxt[b]] = a
            push(prv[a], a)
            push(a, nxt[a])

        # Every merged symbol is a token; a single character that is not falls back to bytes.
        # (llama.cpp's resegment would also split a symbol along its recorded merge, but only
        # symbols that are tokens ever get merged.)
        out, k = [], 0 if start else -1
        while k >= 0:
            sym = data[start[k] : start[k] + size[k]]
            i = ids_of.get(sym)
            if i is not None:
                out.append(i)
            else:
                out.extend(self._byte_ids[c] for c in (sym.encode("utf-8") if isinstance(sym, str) else sym))
            k = nxt[k]
        return out

    # -- decoding ------------------------------------------------------------------------------

    @staticmethod
    def _normal_bytes(text: str) -> bytes:
        """A normal token's output bytes: the space marker is a space."""
        return text.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids, special: bool = False) -> str:
        pieces = [self.piece(int(i), special) for i in ids]
        if self.add_space_prefix and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]  # the space the encoder put in front of the text
        return b"".join(pieces).decode("utf-8", errors="replace")

    def __repr__(self):
        return (f"SentencePieceTokenizer(n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id}, "
                f"add_space_prefix={self.add_space_prefix})")


def _utf8(text: str) -> bytes:
    """The bytes llama.cpp would get: undecodable input bytes (kept as surrogates by
    surrogateescape) go back to themselves; other lone surrogates become U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return SURROGATE.sub("\ufffd", text).encode("utf-8", "surrogateescape")
