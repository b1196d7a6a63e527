"""Byte-level BPE tokenizer read from GGUF metadata, token-for-token compatible with llama.cpp.

load.py's `load_tokenizer` picks the tokenizer by `tokenizer.ggml.model`: "gpt2" is this module's BPE,
"llama" is SentencePiece (spm.py, which shares the vocabulary, special-token and decoding parts).

Encoding (docs: mla-spec section 10.2) runs in four stages, each mirroring llama.cpp:

1. Special-token partition: CONTROL/UNKNOWN tokens (only when `special=True`) and USER_DEFINED
   tokens (always) are cut out of the text, longest token text first over the whole text.
2. Pre-tokenization: the regex list of the `tokenizer.ggml.pre` type splits each remaining
   fragment; every regex is applied to every current piece and both the matches and the gaps
   between them are kept ("isolated" splitting).
3. Every piece is UTF-8 encoded and mapped through the GPT-2 bytes-to-unicode table.
4. BPE merges inside a piece, lowest merge rank first (ties: leftmost).

Pre-tokenization (pretokenizer.py) mirrors how llama.cpp runs these regexes, which differs from a
plain Unicode regex engine for some inputs.

Decoding: NORMAL tokens map back through the byte table; CONTROL/UNKNOWN tokens produce nothing
unless `special=True` (then their text); USER_DEFINED tokens produce their text verbatim. Bytes
are joined before UTF-8 decoding because characters span tokens; `stream()` decodes incrementally.
llama.cpp's `clean_up_tokenization_spaces` pass (only for pre types that enable it, not the
DeepSeek, qwen2 or smollm ones) is not applied.
"""

from __future__ import annotations

import codecs
import heapq

from ...errors import ModelError
from .pretokenizer import PRE_TYPES, SURROGATE, PreTokenizer

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end of turn / message / generation (auto-detected by text).
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>")
# Fill-in-the-middle pad / repo / file-separator tokens, which llama.cpp also counts as EOG.
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)

def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: bytes([b]) for b, c in enumerate(_BYTE_TO_CHAR)}

# ---------------------------------------------------------------------------------------------
# tokenizer


class Tokenizer:
    """A GGUF byte-level BPE vocabulary. Build with load.py's `load_tokenizer` (or `tokenizer_from_metadata`).

    The vocabulary, special-token and decoding parts are shared with the SentencePiece tokenizer
    (spm.py), which subclasses this one and replaces the merging and the text form of tokens.
    """

    def __init__(self, meta: dict, where: str = "model"):
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(f"{where}: tokenizer model '{model}' is not byte-level BPE")
        self.pre = meta.get("tokenizer.ggml.pre") or "default"
        if self.pre not in PRE_TYPES:
            raise ModelError(f"{where}: pre-tokenizer '{self.pre}' is not supported (colichat knows "
                             "gpt-2, llama-bpe, deepseek-llm, deepseek-coder, deepseek-v3, qwen2, smollm, "
                             "kimi-k2 and their aliases)")
        exprs, self._ignore_merges, add_bos = PRE_TYPES[self.pre]
        self._pre = PreTokenizer(exprs)
        self._read_vocab(meta, where)
        merges = meta.get("tokenizer.ggml.merges") or []
        # rank by the merge string "left right" itself (byte-level tokens hold no spaces);
        # the first occurrence of a duplicate merge keeps its rank
        self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))
        self._read_specials(meta, 11, 11, add_bos)  # 11: llama.cpp's default BOS/EOS for BPE

    def _read_vocab(self, meta: dict, where: str) -> None:
        """Token texts and types (llama.cpp's llama_vocab::load, the part every model type shares)."""
        self.meta = meta  # the GGUF keys it was built from (kept for the prepared-model cache)
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelError(f"{where}: missing GGUF key 'tokenizer.ggml.tokens'")
        self._text = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.n_vocab = n = len(self._text)
        # first id wins for duplicate texts, like llama.cpp's token_to_id.emplace
        self._ids = dict(zip(reversed(self._text), range(n - 1, -1, -1), strict=True))
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise ModelError(f"{where}: {len(types)} token types for {n} tokens")
        self._type = list(types[:n]) if types is not None else [NORMAL] * n

    def _special_id(self, key: str, default: int | None) -> int | None:
        """A special token id from its key; out-of-range ids fall back to the (in-range) default."""
        v = self.meta.get(f"tokenizer.ggml.{key}")
        if v is not None and 0 <= int(v) < self.n_vocab:
            return int(v)
        return default if default is not None and 0 <= default < self.n_vocab else None

    def _read_specials(self, meta: dict, bos_default: int, eos_default: int, add_bos: bool) -> None:
        """BOS/EOS/EOG ids, the special-token partition list (llama.cpp's defaults per model type)."""

        def detect(key, texts):
            """A special token from its key, else (like llama.cpp) found by its text and made CONTROL."""
            i = self._special_id(key, None)
            found = [self._ids[t] for t in texts if t in self._ids]
            if i is None and found:
                i = min(found)
                self._type[i] = CONTROL
            return i

        self.bos_id = self._special_id("bos_token_id", bos_default)
        self.eos_id = self._special_id("eos_token_id", eos_default)
        self.eot_id = detect("eot_token_id", EOT_TEXTS)
        self.eom_id = detect("eom_token_id", EOM_TEXTS)
        fim = [detect(f"fim_{k}_token_id", texts)
               for k, texts in (("pad", FIM_PAD_TEXTS), ("rep", FIM_REP_TEXTS), ("sep", FIM_SEP_TEXTS))]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos)
        self.add_bos = bool(add_bos) and self.bos_id is not None

        # End of generation: eos, eot, eom, the FIM tokens, and every token with an EOG text
        # (which llama.cpp also forces to CONTROL).
        eog = {i for i in (self.eos_id, self.eot_id, self.eom_id, *fim) if i is not None}
        for t in EOG_TEXTS:
            i = self._ids.get(t)
            if i is not None:
                eog.add(i)
                self._type[i] = CONTROL
        self.eog_ids = frozenset(eog)

        # Special tokens for the partition, longest (in bytes) first. llama.cpp strips the
        # whitespace after every special token of Phi-3 models (chosen by the model's name),
        # except <unk>, <s> and <|endoftext|>.
        special = [i for i, t in enumerate(self._type) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: -len(self._text[i].encode("utf-8")))
        name = str(meta.get("general.name") or "").lower()
        rstrip = set()
        if "phi-3" in name or "phi3" in name:
            rstrip = set(special) | {self._ids.get("</s>")}
            rstrip -= {self._ids.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
        self._special = [(self._text[i], i, self._type[i] == USER_DEFINED, i in rstrip) for i in special]

        self.bos_text = self._text[self.bos_id] if self.bos_id is not None else ""
        self.eos_text = self._text[self.eos_id] if self.eos_id is not None else ""
        self.chat_template = meta.get("tokenizer.chat_template") or None
        self._cache: dict[str, list[int]] = {}
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of `text`. `special=True` also parses CONTROL tokens (USER_DEFINED always)."""
        if not text.isascii() and SURROGATE.search(text):
            # undecodable input bytes (surrogateescape) or lone surrogates: llama.cpp reads every
            # invalid UTF-8 byte as U+FFFD
            text = SURROGATE.sub("\ufffd", text)
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                ids.append(frag)
            else:
                for piece in self._pre.split(frag):
                    ids.extend(self._bpe_piece(piece))
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A rendered chat prompt: specials parsed, BOS added per the GGUF unless already there."""
        ids = self.encode(text, special=True)
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _partition(self, text: str, special: bool) -> list:
        """Split out special tokens like llama.cpp's tokenizer_st_partition: for each special
        token, longest first, cut every occurrence out of every remaining text fragment."""
        frags: list = [text] if text else []
        chars = set(text)
        for tok, tid, user_defined, rstrip in self._special:
            if not (special or user_defined) or tok[0] not in chars or tok not in text:
                continue
            out = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                parts = f.split(tok)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                        if rstrip:  # the whitespace after the token (C isspace) goes with it
                            part = part.lstrip(" \t\n\v\f\r")
                    if part:
                        out.append(part)
            frags = out
        return frags

    def _bpe_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            return ids
        word = "".join(_BYTE_TO_CHAR[b] for b in piece.encode("utf-8"))
        if self._ignore_merges and word in self._ids:
            ids = [self._ids[word]]
        else:
            ids = []
            for sym in self._merge(word):
                i = self._ids.get(sym)
                if i is not None:
                    ids.append(i)
                else:  # llama.cpp falls back to single-byte tokens of the symbol's UTF-8
                    ids.extend(self._ids[c] for c in sym if c.isascii() and c in self._ids)
        if len(self._cache) > 200_000:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def _merge(self, word: str) -> list[str]:
        """BPE: repeatedly merge the adjacent pair of lowest rank (ties: leftmost)."""
        return self._merge_simple(word) if len(word) <= 32 else self._merge_heap(word)

    def _merge_simple(self, word: str) -> list[str]:
        """Quadratic scan, fastest for the short pieces that make up almost all text."""
        ranks = self._ranks
        syms = list(word)
        while len(syms) > 1:
            best, at = None, -1
            for k in range(len(syms) - 1):
                r = ranks.get(syms[k] + " " + syms[k + 1])
                if r is not None and (best is None or r < best):
                    best, at = r, k
            if best is None:
                break
            syms[at:at + 2] = [syms[at] + syms[at + 1]]
        return syms

    def _merge_heap(self, word: str) -> list[str]:
        """The same merge order with a heap and a linked list (llama.cpp's algorithm), for long pieces."""
        ranks = self._ranks
        syms = list(word)
        nxt = list(range(1, len(syms))) + [-1]
        prv = list(range(-1, len(syms) - 1))
        heap = []

        def push(a, b):
            if a >= 0 and b >= 0:
                r = ranks.get(syms[a] + " " + syms[b])
                if r is not None:
                    heapq.heappush(heap, (r, a, b, syms[a] + syms[b]))

        for k in range(len(syms) - 1):
            push(k, k + 1)
        while heap:
            _, a, b, text = heapq.heappop(heap)
            if not syms[a] or not syms[b] or syms[a] + syms[b] != text:
                continue  # stale entry
            syms[a], syms[b] = text, ""
            nxt[a] = nxt[b]
            if nxt[b] >= 0:
                prv[nxt[b]] = a
            push(prv[a], a)
            push(a, nxt[a])
        return [s for s in syms if s]

    # -- decoding ------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of a token (byte-level form, e.g. 'Ġhello'; specials as written)."""
        return self._text[token_id]

    def piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a token stands for in output text (llama.cpp token_to_piece)."""
        key = (token_id, special)
        b = self._pieces.get(key)
        if b is None:
            t, text = self._type[token_id], self._text[token_id]
            if t in (CONTROL, UNKNOWN):
                b = text.encode("utf-8") if special else b""
            elif t == USER_DEFINED:
                b = text.encode("utf-8")
            elif t == NORMAL:
                b = self._normal_bytes(text)
            elif t == BYTE and text.startswith("<0x") and len(text) == 6:
                b = bytes([int(text[3:5], 16)])
            else:
                b = b""
            self._pieces[key] = b
        return b

    @staticmethod
    def _normal_bytes(text: str) -> bytes:
        """A normal token's output bytes: byte-level BPE maps each character back to its byte."""
        return b"".join(_CHAR_TO_BYTE.get(c) or c.encode("utf-8") for c in text)

    def decode(self, ids, special: bool = False) -> str:
        return b"".join(self.piece(int(i), special) for i in ids).decode("utf-8", errors="replace")

    def stream(self, special: bool = False) -> TokenStream:
        return TokenStream(self, special)

    def __repr__(self):
        return f"Tokenizer(pre={self.pre!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


class TokenStream:
    """Incremental detokenizer: `push(id)` returns the text completed by that token (a UTF-8
    character split over several tokens comes out whole once its last byte arrives)."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tok = tokenizer
        self._special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending_tokens = 0  # the last tokens pushed whose bytes are not yet a whole character

    def push(self, token_id: int) -> str:
        out = self._dec.decode(self._tok.piece(int(token_id), self._special))
        # a token whose bytes end a character (text out) counts as shown, even if it starts another
        self.pending_tokens = self.pending_tokens + 1 if self.pending and not out else 0
        return out

    @property
    def pending(self) -> bool:
        """Whether bytes of a character not yet whole are held (not in any text returned so far)."""
        return bool(self._dec.getstate()[0])

    def flush(self) -> str:
        """Whatever is pending (an incomplete character becomes U+FFFD); the stream is reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        self.pending_tokens = 0
        return out
