"""Pre-tokenization as llama.cpp does it: the regex list of a `tokenizer.ggml.pre` type splits text
into pieces before BPE; every regex is applied to every current piece, and both the matches and the
gaps between them are kept ("isolated" splitting).

llama.cpp does not run its regexes through a Unicode regex engine, and the ids differ from a
naive `regex` implementation for some inputs. What it does, and what `PreTokenizer` emulates:

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
"""

from __future__ import annotations

import regex

from ...errors import ModelError

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
PRE_TYPES: dict[str, tuple[list[str], bool, bool]] = {}
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
        PRE_TYPES[_n] = _spec

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
SURROGATE = regex.compile("[\ud800-\udfff]")


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


class PreTokenizer:
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
    if pre not in PRE_TYPES:
        raise ModelError(f"pre-tokenizer '{pre}' is not supported")
    return PreTokenizer(PRE_TYPES[pre][0]).split(text)
