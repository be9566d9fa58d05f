"""Expert rows: section placement, alignment, and pack/unpack round trips."""

import numpy as np
import pytest

from moet_kernels.layout import SECTION_ALIGN, RowLayout


def test_sections_are_aligned_ordered_and_sized():
    lay = RowLayout(hidden=96, inter=64)
    offsets = [lay.sections[n][0] for n in ("w13_codes", "w13_scales", "w2_codes", "w2_scales")]
    assert offsets == sorted(offsets) and all(o % SECTION_ALIGN == 0 for o in offsets)
    # w13 codes: 2*64 rows x 96/4 = 3072 bytes; scales 128 x 3 = 384 -> 512 aligned; ...
    assert offsets == [0, 3072, 3072 + 512, 3072 + 512 + 1536]
    assert lay.row_bytes == 3072 + 512 + 1536 + 256
    assert "w13_codes@0:128x24" in lay.spec and lay.spec.startswith("rows-a256[")


def test_pack_unpack_round_trip_and_padding_zero():
    lay = RowLayout(hidden=64, inter=32)
    rng = np.random.default_rng(0)
    arrays = {
        n: rng.integers(0, 256, size=(5, *s), dtype=np.uint8) for n, (_, s) in lay.sections.items()
    }
    rows = lay.pack(**arrays)
    assert rows.shape == (5, lay.row_bytes)
    back = lay.unpack(rows)
    for n, a in arrays.items():
        assert np.array_equal(back[n], a)
    used = np.zeros(lay.row_bytes, bool)
    for o, s in lay.sections.values():
        used[o : o + s[0] * s[1]] = True
    assert (rows[:, ~used] == 0).all()


def test_bad_shapes_are_refused():
    lay = RowLayout(hidden=64, inter=32)
    arrays = {n: np.zeros((2, *s), np.uint8) for n, (_, s) in lay.sections.items()}
    arrays["w2_scales"] = np.zeros((2, 64, 2), np.uint8)
    with pytest.raises(ValueError, match=r"w2_scales: expected uint8 \[2, 64, 1\]"):
        lay.pack(**arrays)
    with pytest.raises(ValueError, match="multiples of 32"):
        RowLayout(hidden=48, inter=32)
