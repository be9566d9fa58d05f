"""The weight layout the ops of this version read, named for the ABI string (design.md, Identity).

`LAYOUT_ID` enters moet-vllm's ABI string (`<format>+<layout>+<row sections>`), which keys every
persistent cache (pack files). This version has no GPU kernels, so its ops read the *logical* layout
of moet checkpoints as is (a passthrough):

- `w2_codes` uint8 [N, K/4]: 4 two-bit codes per byte, little-endian 2-bit fields along K;
- `w2_scales` uint8 [N, K/32]: one UE8M0 byte per block of 32 along K.

The kernel-native plane layout (fragment-major codes for the sm_90 streaming loop) comes with the
kernels issue, under a new id. Bump the id whenever the byte layout an op reads changes.
"""

from __future__ import annotations

import numpy as np

LAYOUT_ID = "logical-v0"

__all__ = ["LAYOUT_ID", "RowLayout", "SECTIONS", "SECTION_ALIGN"]


# --- expert rows: one expert of one rank, as pack files and GPU slots hold it (design.md) -------

SECTION_ALIGN = 256  # every section starts on a 256-byte boundary
SECTIONS = ("w13_codes", "w13_scales", "w2_codes", "w2_scales")


class RowLayout:
    """Where each section of an expert row lives: [w13 codes | w13 scales | w2 codes | w2 scales].

    w13 stacks gate over up ([2I, H] logically), w2 is down ([H, I]); I is this rank's share of the
    expert intermediate size. A GPU slot holds a row's first `row_bytes` verbatim, so fetching an
    expert is one copy.
    """

    def __init__(self, hidden: int, inter: int):
        if hidden % 32 or inter % 32 or hidden <= 0 or inter <= 0:
            raise ValueError(
                f"expert rows need hidden and intermediate sizes that are positive "
                f"multiples of 32, got hidden={hidden}, intermediate={inter}"
            )
        self.hidden, self.inter = hidden, inter
        shapes = {
            "w13_codes": (2 * inter, hidden // 4),
            "w13_scales": (2 * inter, hidden // 32),
            "w2_codes": (hidden, inter // 4),
            "w2_scales": (hidden, inter // 32),
        }
        self.sections: dict[str, tuple[int, tuple[int, int]]] = {}
        offset = 0
        for name in SECTIONS:
            self.sections[name] = (offset, shapes[name])
            offset += -(-shapes[name][0] * shapes[name][1] // SECTION_ALIGN) * SECTION_ALIGN
        self.row_bytes = offset

    @property
    def spec(self) -> str:
        """The row-section part of the ABI string."""
        parts = [f"{n}@{o}:{s[0]}x{s[1]}" for n, (o, s) in self.sections.items()]
        return f"rows-a{SECTION_ALIGN}[{','.join(parts)}]"

    def pack(self, **arrays) -> np.ndarray:
        """Four uint8 arrays [E, *section shape] (names as SECTIONS) -> rows uint8 [E, row_bytes]."""
        n_experts = next(iter(arrays.values())).shape[0]
        rows = np.zeros((n_experts, self.row_bytes), dtype=np.uint8)
        for name, (offset, shape) in self.sections.items():
            a = np.asarray(arrays[name])
            if a.dtype != np.uint8 or a.shape != (n_experts, *shape):
                raise ValueError(
                    f"{name}: expected uint8 {[n_experts, *shape]}, found {a.dtype} {list(a.shape)}"
                )
            rows[:, offset : offset + a[0].size] = a.reshape(n_experts, -1)
        return rows

    def unpack(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """rows uint8 [E, >= row_bytes] -> the four sections as views [E, *shape]."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] < self.row_bytes:
            raise ValueError(
                f"rows of shape {list(rows.shape)} are shorter than a row ({self.row_bytes} bytes)"
            )
        out = {}
        for name, (offset, shape) in self.sections.items():
            out[name] = rows[:, offset : offset + shape[0] * shape[1]].reshape(-1, *shape)
        return out

    def views(self, row):
        """One row (numpy or torch, 1-D, >= row_bytes) -> its four sections as views, unpadded.
        What an op reads from a GPU pool slot."""
        return {
            name: row[offset : offset + shape[0] * shape[1]].reshape(shape)
            for name, (offset, shape) in self.sections.items()
        }
