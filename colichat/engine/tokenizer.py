"""Byte-level BPE tokenizer read from GGUF metadata, token-for-token compatible with llama.cpp.

Encoding (docs: mla-spec section 10.2) runs in four stages, each mirroring llama.cpp:

1. Special-token partition: CONTROL/UNKNOWN tokens (only when `special=True`) and USER_DEFINED
   tokens (always) are cut out of the text, longest token text first over the whole text.
2. Pre-tokenization: the regex list of the `tokenizer.ggml.pre` type splits each remaining
   fragment; every regex is applied to every current piece and both the matches and the gaps
   between them are kept ("isolated" splitting).
3. Every piece is UTF-8 encoded and mapped through the GPT-2 bytes-to-unicode table.
4. BPE merges inside a piece, lowest merge rank first (ties: leftmost).

llama.cpp does not run its regexes through a Unicode regex engine, and the ids differ from a
naive `regex` implementation for some inputs. What it does, and what `_PreTokenizer` emulates:

* The GPT-2 regex, the llama3 regex and the Kimi-K2 pattern are hand-written splitters over
  Unicode category flags. The first two behave exactly like the regexes; the Kimi splitter
  ignores the upper/lower-case split of the original tiktoken pattern, so "HelloWorld" stays one
  piece. We use `regex` patterns equivalent to those splitters.
* Any other regex that uses `\\p{N}`, `\\p{L}`, `\\p{P}`, `\\p{M}` or `\\p{S}` runs with
  std::regex on a "collapsed" copy of the text: ASCII stays as is, non-ASCII whitespace becomes
  `\\v`, every other non-ASCII code point becomes one byte standing for its category (0xD1
  number, 0xD2 letter, 0xD3 punctuation, 0xD4 mark, 0xD5 symbol, 0xD0 anything else), and the
  regex's `\\p{X}` becomes `[<category byte><ASCII members>]`. Note the ASCII table for `\\p{S}`
  leaves out `~`. We build the same collapsed text and regex.
* Regexes without categories run with std::wregex on the code points, with non-ASCII
  whitespace replaced by `\\v`; ECMAScript `$` is end of input only (`\\Z` here).

llama.cpp's category tables are generated with the `regex` package, so `\\p{..}` and `\\s` agree
with it up to Unicode version differences.

Decoding: NORMAL tokens map back through the byte table; CONTROL/UNKNOWN tokens produce nothing
unless `special=True` (then their text); USER_DEFINED tokens produce their text verbatim. Bytes
are joined before UTF-8 decoding because characters span tokens; `stream()` decodes incrementally.
llama.cpp's `clean_up_tokenization_spaces` pass (only for pre types that enable it, not the
DeepSeek, qwen2 or smollm ones) is not applied.
"""

from __future__ import annotations

import codecs
import heapq
import mmap
import os
import struct

import regex

from .gguf import ModelError, field, open_gguf

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

# ---------------------------------------------------------------------------------------------
# pre-tokenizer regexes (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")  # not a hand-written splitter in llama.cpp
_KIMI_K2 = r"\p{Han}+"  # llama.cpp's trigger for its hand-written Kimi-K2 splitter
_CJK_DS = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Non-ASCII characters are written as escapes: several of them (U+1F7D, U+1FBE, U+2126, U+212A...)
# would silently turn into other characters under Unicode normalization of the source file.
_DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    r"\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    r"\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    r"\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    r"\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    r"\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    r"\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    r"\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    r"\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    r"\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    r"\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    r"\U0001e900-\U0001e943]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_DS,
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DS, r"\p{N}"]
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]

# pre name -> (regex list, ignore_merges, default add_bos)
_PRE_TYPES: dict[str, tuple[list[str], bool, bool]] = {}
for _names, _spec in (
    (("default",), (_DEFAULT, False, False)),
    (("gpt-2", "phi-2", "gigachat", "mpt", "olmo", "jais", "exaone4"), ([_GPT2], False, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     ([_LLAMA3], True, True)),
    (("dbrx", "smaug-bpe"), ([_LLAMA3], False, False)),
    (("deepseek-llm",), (_DEEPSEEK_LLM, False, False)),
    (("deepseek-coder",), (_DEEPSEEK_CODER, False, False)),
    (("deepseek-v3",), (_DEEPSEEK_V3, False, False)),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), ([_QWEN2], False, False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     ([r"\p{N}", _GPT2], False, False)),
    (("kimi-k2",), ([_KIMI_K2], False, False)),
):
    for _n in _names:
        _PRE_TYPES[_n] = _spec

# Regexes for which llama.cpp uses a hand-written splitter instead of std::regex.
_HAN = ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
        "\U00020000-\U0002a6df\U0002a700-\U0002ebef\U0002f800-\U0002fa1f")
_CUSTOM = {
    _GPT2: _GPT2 + r"|\s+",
    _LLAMA3: _LLAMA3,
    _LLAMA3.replace("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
                    "(?i:'s|'t|'re|'ve|'m|'ll|'d)"): _LLAMA3,
    # Kimi-K2 as llama.cpp splits it: Han runs (fixed ranges), then letter runs without Han
    # (no case distinction) with an optional contraction, then the llama3 tail.
    _KIMI_K2: (rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?(?:(?![{_HAN}])\p{{L}})+"
               r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

# llama.cpp's collapsed-category substitutes: category byte + ASCII members.
_CAT_CLASS = {
    "N": "\xd1" + "0-9",
    "L": "\xd2" + "A-Za-z",
    "P": "\xd3" + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "\xd4",
    "S": "\xd5" + r"\$\+<->\^`\|",
}
_CAT_PROPS = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L",
              "Lo": "L"}
_CAT_OF = regex.compile(r"(\p{N})|(\p{L})|(\p{P})|(\p{M})|(\p{S})")
_WHITESPACE = regex.compile(r"\s")
_SURROGATE = regex.compile("[\ud800-\udfff]")


def _collapse_regex(expr: str) -> str:
    """llama.cpp's rewrite of `\\p{X}` into the collapsed category classes (unicode_regex_split)."""
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif inside and c == "]" and expr[i - 1] != "\\":
            inside = False
        elif expr.startswith("\\p{", i):
            j = expr.find("}", i + 3)
            prop = expr[i + 3:j] if j > 0 else None
            if prop in _CAT_PROPS:
                cls = _CAT_CLASS[_CAT_PROPS[prop]]
                out.append(cls if inside else f"[{cls}]")
                i = j + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _ecmascript_to_python(expr: str) -> str:
    """ECMAScript `$` (outside a class) means end of input only."""
    out, inside, escaped = [], False, False
    for c in expr:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "[":
            inside = True
        elif c == "]":
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"
        out.append(c)
    return "".join(out)


class _CollapseTable(dict):
    """str.translate table for the collapsed text; non-ASCII entries are filled on first use."""

    def __init__(self):
        super().__init__((i, i) for i in range(128))

    def __missing__(self, cp: int) -> int:
        ch = chr(cp)
        if _WHITESPACE.match(ch):
            v = 0x0B
        else:
            m = _CAT_OF.match(ch)
            v = 0xD0 + (m.lastindex if m else 0)
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable()
_WIDE = {cp: 0x0B for cp in range(0x80, 0x3001) if _WHITESPACE.match(chr(cp))}


class _PreTokenizer:
    """Sequential isolated splitting with llama.cpp's per-regex semantics (see module docstring)."""

    def __init__(self, exprs: list[str]):
        self.steps = []
        for e in exprs:
            if e in _CUSTOM:
                self.steps.append((regex.compile(_CUSTOM[e]), "unicode"))
            elif any(f"\\p{{{p}}}" in e for p in _CAT_PROPS):
                self.steps.append((regex.compile(_ecmascript_to_python(_collapse_regex(e))), "collapsed"))
            else:
                self.steps.append((regex.compile(_ecmascript_to_python(e)), "wide"))

    def split(self, text: str) -> list[str]:
        ascii_only = text.isascii()
        views = {"unicode": text}
        if ascii_only:
            views["wide"] = views["collapsed"] = text
        pieces = [(0, len(text))] if text else []
        for pattern, mode in self.steps:
            view = views.get(mode)
            if view is None:
                view = views[mode] = text.translate(_COLLAPSE if mode == "collapsed" else _WIDE)
            out = []
            for s, e in pieces:
                last = 0
                for m in pattern.finditer(view[s:e]):
                    ms, me = m.span()
                    if me == ms:
                        continue
                    if ms > last:
                        out.append((s + last, s + ms))
                    out.append((s + ms, s + me))
                    last = me
                if s + last < e:
                    out.append((s + last, e))
            pieces = out
        return [text[s:e] for s, e in pieces]


def pretokenize(text: str, pre: str) -> list[str]:
    """The pieces llama.cpp's pre-tokenizer `pre` cuts `text` into (for tests and debugging)."""
    if pre not in _PRE_TYPES:
        raise ModelError(f"pre-tokenizer '{pre}' is not supported")
    return _PreTokenizer(_PRE_TYPES[pre][0]).split(text)


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
# GGUF metadata


def _read_metadata(path: str) -> dict:
    """The `tokenizer.*` and `general.*` keys of a little-endian GGUF v2/v3 file, read directly.

    gguf-py's reader builds numpy views for every string of the token and merge arrays, which
    takes seconds for large vocabularies; this walks the key/value section once (~25 ms for
    SmolLM2). Anything unexpected raises, and the caller falls back to gguf-py.
    """
    import numpy as np

    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
    u64 = struct.Struct("<Q").unpack_from
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError("not a little-endian GGUF v2/v3 file")
        off, out = 24, {}
        for _ in range(n_kv):
            (n,) = u64(buf, off)
            key = buf[off + 8:off + 8 + n].decode("utf-8")
            (vtype,) = struct.unpack_from("<I", buf, off + 8 + n)
            off += 12 + n
            keep = key.startswith(("tokenizer.", "general."))
            if vtype == 8:
                (n,) = u64(buf, off)
                if keep:
                    out[key] = buf[off + 8:off + 8 + n].decode("utf-8", "replace")
                off += 8 + n
            elif vtype == 9:
                itype, count = struct.unpack_from("<IQ", buf, off)
                off += 12
                if itype == 8:
                    values = []
                    for _ in range(count):
                        (n,) = u64(buf, off)
                        if keep:
                            values.append(buf[off + 8:off + 8 + n].decode("utf-8", "replace"))
                        off += 8 + n
                elif itype in scalars:
                    dtype = np.dtype(scalars[itype])
                    values = np.frombuffer(buf, dtype, count, off).tolist() if keep else None
                    off += dtype.itemsize * count
                else:
                    raise ValueError(f"unsupported array type {itype}")
                if keep:
                    out[key] = values
            elif vtype in scalars:
                (value,) = struct.unpack_from(scalars[vtype], buf, off)
                off += struct.calcsize(scalars[vtype])
                if keep:
                    out[key] = value
            else:
                raise ValueError(f"unsupported value type {vtype}")
        return out


def _metadata(path_or_reader) -> tuple[dict, str]:
    if hasattr(path_or_reader, "fields"):
        reader = path_or_reader
        keys = [k for k in reader.fields if k.startswith(("tokenizer.", "general."))]
        return {k: field(reader, k) for k in keys}, str(getattr(reader, "path", "model"))
    path = os.fspath(path_or_reader)
    try:
        return _read_metadata(path), path
    except Exception:
        reader = open_gguf(path)  # raises a one-line ModelError for missing/damaged files
        return _metadata(reader)[0], path


# ---------------------------------------------------------------------------------------------
# tokenizer


class Tokenizer:
    """A GGUF byte-level BPE vocabulary. Build with `load_tokenizer`."""

    def __init__(self, meta: dict, where: str = "model"):
        self.meta = meta  # the GGUF keys it was built from (kept for the prepared-model cache)
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError(f"{where}: no tokenizer in this GGUF (missing 'tokenizer.ggml.model')")
        if model != "gpt2":
            kind = " (SentencePiece)" if model == "llama" else ""
            raise ModelError(f"{where}: tokenizer model '{model}'{kind} is not supported; colichat reads "
                             "byte-level BPE ('gpt2') vocabularies")
        self.pre = meta.get("tokenizer.ggml.pre") or "default"
        if self.pre not in _PRE_TYPES:
            raise ModelError(f"{where}: pre-tokenizer '{self.pre}' is not supported (colichat knows "
                             "gpt-2, llama-bpe, deepseek-llm, deepseek-coder, deepseek-v3, qwen2, smollm, "
                             "kimi-k2 and their aliases)")
        exprs, self._ignore_merges, add_bos = _PRE_TYPES[self.pre]
        self._pre = _PreTokenizer(exprs)

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
        merges = meta.get("tokenizer.ggml.merges") or []
        # rank by the merge string "left right" itself (byte-level tokens hold no spaces);
        # the first occurrence of a duplicate merge keeps its rank
        self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))

        def special_id(key, default):
            v = meta.get(f"tokenizer.ggml.{key}")
            if v is not None and 0 <= int(v) < n:
                return int(v)
            return default if default is not None and 0 <= default < n else None

        def detect(key, texts):
            """A special token from its key, else (like llama.cpp) found by its text and made CONTROL."""
            i = special_id(key, None)
            found = [self._ids[t] for t in texts if t in self._ids]
            if i is None and found:
                i = min(found)
                self._type[i] = CONTROL
            return i

        self.bos_id = special_id("bos_token_id", 11)  # 11: llama.cpp's default for BPE vocabularies
        self.eos_id = special_id("eos_token_id", 11)
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

        # Special tokens for the partition, longest (in bytes) first.
        special = [i for i, t in enumerate(self._type) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: -len(self._text[i].encode("utf-8")))
        self._special = [(self._text[i], i, self._type[i] == USER_DEFINED) for i in special]

        self.bos_text = self._text[self.bos_id] if self.bos_id is not None else ""
        self.eos_text = self._text[self.eos_id] if self.eos_id is not None else ""
        self.chat_template = meta.get("tokenizer.chat_template") or None
        self._cache: dict[str, list[int]] = {}
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of `text`. `special=True` also parses CONTROL tokens (USER_DEFINED always)."""
        if not text.isascii() and _SURROGATE.search(text):
            # undecodable input bytes (surrogateescape) or lone surrogates: llama.cpp reads every
            # invalid UTF-8 byte as U+FFFD
            text = _SURROGATE.sub("\ufffd", text)
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
        for tok, tid, user_defined in self._special:
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
                b = b"".join(_CHAR_TO_BYTE.get(c) or c.encode("utf-8") for c in text)
            elif t == BYTE and text.startswith("<0x") and len(text) == 6:
                b = bytes([int(text[3:5], 16)])
            else:
                b = b""
            self._pieces[key] = b
        return b

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

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.piece(int(token_id), self._special))

    def flush(self) -> str:
        """Whatever is pending (an incomplete character becomes U+FFFD); the stream is reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


def load_tokenizer(path_or_reader) -> Tokenizer:
    """The tokenizer of a GGUF file: a path (metadata read directly, fast) or an open GGUFReader."""
    meta, where = _metadata(path_or_reader)
    return Tokenizer(meta, where)
