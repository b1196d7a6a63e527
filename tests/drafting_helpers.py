"""Helpers of the speculative-decoding tests (test_speculative.py, test_mtp_drafts.py)."""

from __future__ import annotations

import math

from colichat.engine import load as engine_load
from colichat.engine.threads import ThreadPolicy


def load(*args, **kwargs):
    """engine.load with decode pinned to one thread: how many drafts a step checks weighs a verify pass
    against decode at its measured speed (speculative.gain's speedup), so with the default policy the
    draft counts would follow the machine's load; with one thread they are the same on every run."""
    model = engine_load(*args, **kwargs)
    model.threads = ThreadPolicy(one_token=(1,))
    return model


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
