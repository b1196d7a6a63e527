"""The on-disk side of colichat: sessions as KV-cache files plus JSON sidecars (see FORMAT.md).

persist/ knows nothing about the forward pass: it moves the cache's records and the turn list.

    from colichat.persist import Store, CacheLayout, Turn, model_identity, paths, SessionError
    ident = model_identity(gguf_path, cfg.arch, cfg.name, model.rope_factors)  # None for most models
    layout = CacheLayout.from_cache(model.cache, cfg.n_vocab)
    store = Store()
    sess = store.open(ident, name, layout)          # or store.create(ident, layout) for a new one,
                                                    # or store.claim(ident, name, layout): locked, no files yet
    res = sess.load(model.cache, ctx_limit, detokenize)   # res.summary(), res.warnings, res.turns
    sess.append(model.cache, turns)                 # after every turn (whole turn list is fine)
    sess.truncate(n_turns)                          # /rewind, /regen
    sess.close()
"""

from ..paths import Paths, paths
from .identity import model_identity, title, weights_fingerprint
from .kvfile import CacheLayout, SessionError
from .listing import SessionInfo
from .loading import LoadResult
from .locks import SessionBusy
from .names import check_name, slug
from .session import SaveFailed, Session
from .sidecar import Turn
from .store import SessionExists, Store

__all__ = [
    "CacheLayout", "LoadResult", "Paths", "SaveFailed", "Session", "SessionBusy", "SessionError", "SessionExists",
    "SessionInfo", "Store", "Turn", "check_name", "model_identity", "paths", "slug", "title", "weights_fingerprint",
]
