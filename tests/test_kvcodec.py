"""colichat's compact KV row codecs against colibri's own bytes: tests/data/kvcodec holds rows, the bytes
colibri's encoder wrote for them and the floats colibri's loader gives back (see its README.md)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from colichat.engine import kvcodec
from colichat.engine.cache import record_bytes as f32_record_bytes
from colichat.engine.kvcodec import (
    decode_row,
    decode_rows,
    encode_row,
    encode_rows,
    record_bytes,
    round_trip,
    row_bytes,
)

DATA = Path(__file__).parent / "data" / "kvcodec"
CASES = [(512, "fp8"), (512, "int4"), (64, "fp8"), (64, "int4"), (80, "fp8")]


def ref(width: int) -> dict:
    with np.load(DATA / f"w{width}.npz") as z:
        return {k: z[k] for k in z.files}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)  # compares -0.0, inf and NaN exactly


def differing_rows(a: np.ndarray, b: np.ndarray) -> list[int]:
    return np.nonzero((a != b).reshape(len(a), -1).any(axis=1))[0].tolist()


def scale_of(stored: np.ndarray) -> np.ndarray:
    return stored[:, -4:].copy().view("<f4")[:, 0]


def test_fp8_code_values_are_colibris():
    with np.load(DATA / "fp8_scalar.npz") as z:
        assert bits(kvcodec.FP8_VALUES).tolist() == bits(z["lut"]).tolist()


def test_fp8_encoder_gives_colibris_code_for_every_reference_value():
    """Every code's value, every tie between two codes and the floats either side of it, +-448 and past
    it, inf, NaN, zeros of both signs, subnormals, and random values over 22 binades."""
    with np.load(DATA / "fp8_scalar.npz") as z:
        values, codes = z["values"], z["codes"]
    mine = kvcodec.fp8_encode(values)
    wrong = np.nonzero(mine != codes)[0]
    assert not len(wrong), [(float(values[i]), int(mine[i]), int(codes[i])) for i in wrong[:10]]


@pytest.mark.parametrize("width,codec", CASES)
def test_encoder_gives_colibris_bytes(width, codec):
    r = ref(width)
    assert r[f"{codec}_bytes"].shape == (len(r["rows"]), row_bytes(width, codec))
    assert differing_rows(encode_rows(r["rows"], codec), r[f"{codec}_bytes"]) == []
    for i in (0, 5, len(r["rows"]) - 1):  # the one-row form is the same
        assert encode_row(r["rows"][i], codec).tobytes() == r[f"{codec}_bytes"][i].tobytes()


@pytest.mark.parametrize("width,codec", CASES)
def test_decoder_gives_colibris_floats(width, codec):
    """colibri's bytes for the reference rows, and random bytes (NaN codes, and scales colibri's loader
    refuses: 0, negative, NaN, inf, 3.4e38), read back to exactly the floats colibri reads."""
    r = ref(width)
    assert differing_rows(bits(decode_rows(r[f"{codec}_bytes"], width, codec)), bits(r[f"{codec}_decoded"])) == []
    got = decode_rows(r[f"{codec}_random_bytes"], width, codec)
    assert differing_rows(bits(got), bits(r[f"{codec}_random_decoded"])) == []
    assert bits(decode_row(r[f"{codec}_bytes"][3], width, codec)).tolist() == bits(r[f"{codec}_decoded"][3]).tolist()


# rows 5..22 of every reference file (the generator's order; the rest are random)
ZERO, NEG_ZERO, SUBNORMAL, BELOW_1E35, INF, NEG_INF, ALL_NAN, ONE_NAN, TIES = 5, 6, 7, 8, 10, 11, 12, 13, 14
NORM_PAST_3E38, AT_3_4E38, FLT_MAX = 19, 21, 22


@pytest.mark.parametrize("width,codec", CASES)
def test_reference_rows_cover_the_edges(width, codec):
    """Inert rows are zero codes with scale 1 (fp8) or radius 0 (int4): zero, -0.0, subnormal, inf and
    NaN rows, fp8 rows whose amax is at most 1e-35 or past 3.4e38, int4 rows whose norm is past 3.4e38.
    A NaN among finite values is code 0 in fp8 and makes an int4 row inert."""
    stored = ref(width)[f"{codec}_bytes"]
    scale = scale_of(stored)
    inert = [ZERO, NEG_ZERO, SUBNORMAL, INF, NEG_INF, ALL_NAN, FLT_MAX]
    inert += [BELOW_1E35] if codec == "fp8" else [ONE_NAN, NORM_PAST_3E38]
    assert (stored[inert, :-4] == 0).all() and (scale[inert] == (1.0 if codec == "fp8" else 0.0)).all()
    live = [i for i in range(len(stored)) if i not in inert]
    assert (scale[live] > 0).all() and (stored[live, :-4] != 0).any(axis=1).all()
    if codec == "fp8":
        assert stored[ONE_NAN, 1] == 0 and scale[ONE_NAN] != 1.0
        assert scale[TIES] == 1.0 and stored[TIES, 0] == 0x7E  # amax 448: scale 1, code 0x7E
    else:
        # a radius of exactly 3.4e38 is written, and colibri's loader reads it back as a zero row
        assert scale[AT_3_4E38] == np.float32(3.4e38)
        assert not decode_rows(stored[AT_3_4E38], width, codec).any()


def test_nan_codes_are_never_written():
    rng = np.random.default_rng(3)
    rows = [ref(w)["rows"] for w in (512, 64, 80)]
    rows += [(rng.standard_normal((64, 96)) * 10.0 ** rng.uniform(-38, 38, (64, 1))).astype(np.float32)]
    for x in rows:
        with np.errstate(over="ignore"):
            codes = encode_rows(x, "fp8")[:, :-4]
        assert not ((codes & 0x7F) == 0x7F).any()
    for w in (512, 64, 80):
        assert not ((ref(w)["fp8_bytes"][:, :-4] & 0x7F) == 0x7F).any()  # nor does colibri


def test_fp8_rounding_is_idempotent():
    """A decoded fp8 row encodes to the same bytes, so memory rounded through the codec is a fixed point."""
    rng = np.random.default_rng(5)
    for x in [ref(w)["rows"] for w in (512, 64, 80)] + [
            (rng.standard_t(3, (300, 576)) * 10.0 ** rng.uniform(-30, 30, (300, 1))).astype(np.float32)]:
        stored = encode_rows(x, "fp8")
        once = round_trip(x, "fp8")
        assert differing_rows(encode_rows(once, "fp8"), stored) == []
        assert differing_rows(bits(round_trip(once, "fp8")), bits(once)) == []


def test_int4_is_not_idempotent_so_a_cache_keeps_the_bytes():
    """colibri's int4 stores ||x||, and a decoded row's norm is not ||x||: encoding a decoded row gives
    another radius (and, for a row with values past the outermost level, other codes). So a cache keeps
    the bytes it wrote, whose decoding is round_trip, and never re-encodes the rows it decoded."""
    for width in (512, 64):
        r = ref(width)
        stored = r["int4_bytes"]
        radius = scale_of(stored)
        live = (radius > 0) & (radius < np.float32(3.4e38)) & np.isfinite(r["int4_decoded"]).all(axis=1)
        assert live.sum() >= 20
        again = encode_rows(decode_rows(stored, width, "int4"), "int4")
        assert (scale_of(again)[live] != radius[live]).mean() > 0.9
        assert differing_rows(bits(round_trip(r["rows"], "int4")), bits(decode_rows(stored, width, "int4"))) == []


def test_int4_refuses_a_width_that_is_not_a_power_of_two():
    for width in (80, 576, 3, 1, 4096):
        with pytest.raises(ValueError, match="power of two"):
            row_bytes(width, "int4")
        with pytest.raises(ValueError, match="power of two"):
            encode_rows(np.ones((2, width), np.float32), "int4")
    with pytest.raises(ValueError, match="power of two"):
        decode_rows(np.zeros((1, 44), np.uint8), 80, "int4")
    assert row_bytes(80, "fp8") == 84 and row_bytes(2, "int4") == 5 and row_bytes(2048, "int4") == 1028
    with pytest.raises(ValueError, match="unknown KV format"):
        row_bytes(64, "int8")


def test_row_and_record_sizes():
    assert [row_bytes(512, c) for c in ("f32", "fp8", "int4")] == [2048, 516, 260]
    L, lora, rope, hd, nic = 3, 512, 64, 128, 2
    assert record_bytes(L, lora, rope, "fp8") == 4 + L * (lora + rope + 8)
    assert record_bytes(L, lora, rope, "fp8", hd, nic) == 4 + L * (lora + rope + 8) + nic * hd * 4
    assert record_bytes(L, lora, rope, "int4", hd, nic) == 4 + L * (lora // 2 + rope // 2 + 8) + nic * hd * 4
    assert record_bytes(L, lora, rope, "f32", hd, nic) == f32_record_bytes(L, lora, rope, hd, nic)
    assert kvcodec.TAGS == {"f32": (b"COLIKV1\0", 0), "fp8": (b"COLIKV2\0", 1), "int4": (b"COLIKV3\0", 0x104)}


def test_row_layout_is_codes_then_little_endian_scale():
    x = np.zeros(64, np.float32)
    x[0], x[1], x[2] = 448.0, -17.0, 0.25
    stored = encode_row(x, "fp8")
    assert stored[-4:].tobytes() == struct.pack("<f", 1.0)
    assert stored[:3].tolist() == [0x7E, 0x80 | 0x58, 0x28]  # 448, -16 (17 ties to even), 0.25
    y = np.zeros(64, np.float32)
    y[7] = -3.0
    stored = encode_row(y, "int4")
    assert stored[-4:].tobytes() == struct.pack("<f", 3.0)  # the radius, ||y||
    assert stored.shape == (36,)
    assert encode_row(x, "f32").tobytes() == x.astype("<f4").tobytes()
    assert bits(decode_row(encode_row(x, "f32"), 64, "f32")).tolist() == bits(x).tolist()


def test_round_trip_keeps_the_shape():
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    for codec in ("f32", "fp8", "int4"):
        y = round_trip(x, codec)
        assert y.shape == x.shape and y.dtype == np.float32
        again = decode_rows(encode_rows(x.reshape(6, 64), codec), 64, codec)
        assert bits(y.reshape(6, 64)).tolist() == bits(again).tolist()
    assert bits(round_trip(x, "f32")).tolist() == bits(x).tolist()
