"""Expert row layouts, named for the ABI string (design.md, Identity).

Two layouts of a W2 expert row [w13 codes | w13 scales | w2 codes | w2 scales]:

- `RowLayout` (`LAYOUT_ID`, the CPU serving path today): the *logical* layout of moet checkpoints
  as is: codes uint8 [N, K/4], 4 two-bit codes per byte, little-endian 2-bit fields along K;
  scales uint8 [N, K/32], one UE8M0 byte per block of 32 along K.
- `NativeRowLayout` (`NATIVE_LAYOUT_ID`, v2): what the GPU kernels (csrc/w2_moe.cu) stream. Rows
  come in groups of 64 (w13: 32 gate rows then the same 32 up rows, so one work item sees both
  halves of SiLU(gate) * up), K in chunks of 128 (padded with zero activations). Per (group rg,
  chunk cc):

  - codes, 2048 bytes: 4 row tiles rt x 32 lanes x 16 bytes. Lane L = 4g + t (g = L >> 2, t =
    L & 3) holds 4 little-endian 32-bit words tt = 0..3, each the 16 codes of an int8
    mma.sync m16n8k32 A fragment: the code of register j (0..3), byte i (0..3) sits at bit
    16*(j//2) + 4i + 2*(j%2) and stands for row 16rt + g + 8*(j%2) of the group and
    k = 32t + 8tt + 4*(j//2) + i of the chunk. So lane group t covers exactly block t (k in
    [32t, 32t + 32)) of the chunk, whose scale it applies once per 128 ("promotion once per
    128").
  - scales, 264 bytes (`SCALE_CHUNK_BYTES`): bytes [0, 256) are 4 row tiles rt x 8 lane groups g
    x [word of row 16rt + g, word of row 16rt + g + 8] (little-endian 32-bit words, at byte
    rt*64 + g*8); bytes 256 + rt (rt = 0..3) are 1 where row tile rt is *slow*, else 0; bytes
    260..263 are 0. A row-chunk with block scale bytes b_0..b_3 is *fast-eligible* iff
    min b_j >= 1 and max b_j - min b_j <= 4; a row tile (16 rows) of a (group, chunk) is slow iff
    one of its rows is not fast-eligible. The words of a fast tile are
    (b_min << 23) | sum_j 2**(b_j - b_min) << 5j (one-hot multipliers 1..16 in 5-bit fields at
    bits 0..19, b_min at bits 23..30); those of a slow tile hold the raw bytes
    b_0 | b_1 << 8 | b_2 << 16 | b_3 << 24 (a scale byte of 0 reads as weight 0; 255 is refused).

  Padding: rows past N have code 0 and block scales 127 (1.0); blocks past K have code 0 and the
  minimum of the row-chunk's real block scales (127 where it has none), so padded weights are
  finite, meet zero activations and never make a tile slow by themselves. `logical_matrix`
  inverts the packing exactly for every scale byte 0..254. A matrix of rows_p x k_p (padded)
  takes rows_p/64 * k_p/128 * 2048 code bytes and rows_p/64 * k_p/128 * 264 scale bytes;
  `slow_tile_fraction` counts the slow tiles of scale sections.

- `NativeRowLayout(hidden, inter, "fp4r")` (or `"fp4x-mxfp4"`, the same bytes;
  `NATIVE_FP4_LAYOUT_ID`): the FP4 kernels' variant of v2 for e2m1 codes with UE8M0 scales per
  32. Rows, groups of 64 (the same w13 interleave), chunks of 128, padding and the (row, k) each
  code stands for are v2's; only the packing of the codes and the fast spread differ. Per
  (group, chunk):

  - codes, 4096 bytes: 4 row tiles rt x 32 lanes x 32 bytes. Lane L = 4g + t holds 8
    little-endian 32-bit words w = 2tt + (j % 2) (k-tile tt = 0..3, register j = 0..3): the e2m1
    code (4 bits: bit 3 the sign, bits 0..2 the magnitude index) of register j, byte i (0..3)
    sits at bit 16*(j//2) + 4i of word 2tt + (j%2) and stands for row 16rt + g + 8*(j%2) of the
    group and k = 32t + 8tt + 4*(j//2) + i of the chunk, as in v2 (rows g and g + 8 now go to
    separate words). So each logical byte (codes k and k + 1, k even) is one native byte, and
    padded codes are 0 (e2m1 +0). A matrix of rows_p x k_p takes rows_p/64 * k_p/128 * 4096
    code bytes.
  - scales, 264 bytes: v2's format, except that a row-chunk is fast-eligible only with
    max b_j - min b_j <= 3 (`FP4_FAST_SPREAD`; still min b_j >= 1): the kernels' int8 levels
    are 2*e2m1 (up to 12) times 2**(b_j - b_min), which must stay <= 127 (12 * 8 = 96).

- `NativeRowLayout(hidden, inter, "fp4x-nvfp4")` (`NATIVE_NVFP4_LAYOUT_ID`): NVFP4 rows (e2m1
  codes, an e4m3 scale per 16 along K, a float32 `scale_2` per row) in k16 tiles: one k16 tile is
  one 16-block of every row, so its int32 sum (the kernels: one mma.sync m16n8k32 with the
  positive weights in k 0..15 and the negative ones in k 16..31) is promoted with that block's
  scale (no fold, no slow tiles). Rows, groups of 64, the w13 interleave, chunks of 128 and row
  padding are v2's. Per (group, chunk):

  - codes, 4096 bytes: 4 row tiles rt x 32 lanes x 8 little-endian 32-bit words kt = 0..7 (the
    chunk's k16 tiles). Nibble i (0..3) of word kt stands for row 16rt + g, nibble 4 + i for row
    16rt + g + 8, both at k = 16kt + 4t + i of the chunk (lane L = 4g + t): the A registers of
    m16n8k16 in its two 16-bit halves. Each logical byte moves whole.
  - scales, 512 bytes: 4 row tiles rt x 8 lane groups g x 8 blocks kt x [row 16rt + g, row
    16rt + g + 8], one e4m3 byte each (at byte rt*128 + g*16 + 2kt + j).

  Each group's scale bytes start with a 256-byte head: the float32 `scale_2` of its 64 rows in
  group order (little-endian), then its chunks' 512 bytes each. Padding is 0 throughout (code
  +0, scale 0, scale_2 0): padded weights are 0.

`RowLayout(hidden, inter, tier)` also lays out the FP4 tiers' logical rows (`TIERS`: `fp4r`,
`fp4r-refine`, `fp4x-nvfp4`, `fp4x-mxfp4`; docs/kernels.md, "FP4 tiers"), each with its own
layout id (`FP4R_LAYOUT_ID`, ...); `fp4r`, `fp4x-mxfp4` and `fp4x-nvfp4` have the kernel-native
layouts above (`NATIVE_TIERS`), `fp4r-refine` reaches the kernels as expanded fp4r rows.

`LAYOUT_ID` enters moet-vllm's ABI string (`<format>+<layout>+<row sections>`), which keys every
persistent cache (pack files). Bump an id whenever the byte layout it names changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from moet_quant.w2 import BIG_FROM  # the e2m1 grid index of 3.0: where +-4 codes' magnitudes start

LAYOUT_ID = "logical-v0"
NATIVE_LAYOUT_ID = "mma-s8-m16k32-g64c128-v2"
NATIVE_FP4_LAYOUT_ID = "mma-s8-m16k32-g64c128-e2m1-v1"
NATIVE_NVFP4_LAYOUT_ID = "mma-s8-m16k16-g64c128-e2m1-e4m3b16-v1"

__all__ = [
    "expand_refinement",
    "FAST_SPREAD",
    "FP4R",
    "FP4R_LAYOUT_ID",
    "FP4R_REFINE",
    "FP4R_REFINE_LAYOUT_ID",
    "FP4_FAST_SPREAD",
    "LAYOUT_ID",
    "MXFP4",
    "MXFP4_LAYOUT_ID",
    "NATIVE_FP4_LAYOUT_ID",
    "NATIVE_LAYOUT_ID",
    "NATIVE_NVFP4_LAYOUT_ID",
    "NATIVE_TIERS",
    "NVFP4",
    "NVFP4_LAYOUT_ID",
    "NativeRowLayout",
    "RowLayout",
    "SECTIONS",
    "SCALE_CHUNK_BYTES",
    "SECTION_ALIGN",
    "TIERS",
    "Tier",
    "W2",
    "slow_tile_fraction",
    "tier_of",
]


# --- expert rows: one expert of one rank, as pack files and GPU slots hold it (design.md) -------

SECTION_ALIGN = 256  # every section starts on a 256-byte boundary
SECTIONS = ("w13_codes", "w13_scales", "w2_codes", "w2_scales")  # the W2 tier's sections
PROJECTIONS = ("w13", "w2")  # a row holds w13's sections, then w2's

FP4R_LAYOUT_ID = "logical-fp4r-e2m1-ue8m0b32-v0"
FP4R_REFINE_LAYOUT_ID = "logical-fp4r-refine-b5x4-v0"
NVFP4_LAYOUT_ID = "logical-fp4x-nvfp4-e4m3b16-f32row-v0"
MXFP4_LAYOUT_ID = "logical-fp4x-mxfp4-e2m1-ue8m0b32-v0"


@dataclass(frozen=True)
class Tier:
    """One tier's logical per-projection sections and how its weights decode.

    `parts`: (suffix, bytes per weight along K) per section of a projection, in row order; a
    fraction of None is one float32 per output row (NVFP4's global scale, `scale_2`).
    `codes`: "w2" (2-bit codes, 4 per byte) or "e2m1" (FP4 nibbles, 2 per byte, low nibble =
    even k); `scale`: "ue8m0-32" (one UE8M0 byte per 32 along K) or "e4m3-16" (one e4m3 byte per
    16, times the row's float32 `scale_2`). `base`: a tier whose row must be resident too and
    whose sections come first in the reference's weight tuples (the refinement plane reads the
    W2 row's codes and scales). `tag`: the pack files' tier tag (design.md, Pack files).
    """

    name: str
    tag: str
    layout_id: str
    parts: tuple[tuple[str, Fraction | None], ...]
    codes: str
    scale: str
    base: Tier | None = None

    @property
    def weight_specs(self) -> tuple[tuple[str, Fraction | None], ...]:
        """The per-projection sections a reference takes, in order (base sections first)."""
        return (self.base.weight_specs + self.parts) if self.base else self.parts

    @property
    def weight_parts(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.weight_specs)

    def section_shape(self, part: str, n: int, k: int) -> tuple[int, ...]:
        frac = dict(self.parts)[part]
        return (n,) if frac is None else (n, int(k * frac))


_UE8M0 = ("scales", Fraction(1, 32))
_NIBBLES = ("codes", Fraction(1, 2))
W2 = Tier("w2", "w2", LAYOUT_ID, (("codes", Fraction(1, 4)), _UE8M0), codes="w2", scale="ue8m0-32")
# fp4r and MXFP4 rows are alike byte for byte; their ids differ because their data do
FP4R = Tier("fp4r", "fp4r", FP4R_LAYOUT_ID, (_NIBBLES, _UE8M0), codes="e2m1", scale="ue8m0-32")
FP4R_REFINE = Tier(
    "fp4r-refine",
    "fp4r",
    FP4R_REFINE_LAYOUT_ID,
    (("refine", Fraction(5, 16)),),
    codes="e2m1",
    scale="ue8m0-32",
    base=W2,
)
NVFP4 = Tier(
    "fp4x-nvfp4",
    "fp4x",
    NVFP4_LAYOUT_ID,
    (_NIBBLES, ("scales", Fraction(1, 16)), ("scale_2", None)),
    codes="e2m1",
    scale="e4m3-16",
)
MXFP4 = Tier("fp4x-mxfp4", "fp4x", MXFP4_LAYOUT_ID, FP4R.parts, codes="e2m1", scale="ue8m0-32")
TIERS = {t.name: t for t in (W2, FP4R, FP4R_REFINE, NVFP4, MXFP4)}


def tier_of(tier: str | Tier) -> Tier:
    """A tier by name (`TIERS`) or as is."""
    if isinstance(tier, Tier):
        return tier
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known tiers: {', '.join(TIERS)}")
    return TIERS[tier]


def check_scale_values(tier: Tier, name: str, a) -> None:
    """Refuse scales no FP4 row may hold: UE8M0 255 (NaN), e4m3 NaN or negative, a non-finite or
    negative float32 `scale_2`. (W2 rows are not checked here, as before; the native packer
    refuses UE8M0 255.)"""
    a = np.asarray(a)
    if name.endswith("_scale_2"):
        bad = ~np.isfinite(a) | (a < 0)
        what = "a non-finite or negative float32 global scale"
    elif name.endswith("_scales") and tier.scale == "e4m3-16":
        bad = (a & 0x7F == 0x7F) | (a > 0x80)  # NaN (s.1111.111), or negative (not -0)
        what = "an e4m3 scale byte that is NaN (0x7f, 0xff) or negative"
    elif name.endswith("_scales"):
        bad = a == 255
        what = "a UE8M0 scale byte of 255 (NaN)"
    else:
        return
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        raise ValueError(
            f"{name}: {what} at {idx} (expert, row, ...); {tier.name} rows hold finite, "
            "non-negative scales only: the tier data is corrupt"
        )


class RowLayout:
    """Where each section of an expert row lives: for the W2 tier (the default)
    [w13 codes | w13 scales | w2 codes | w2 scales]; for another tier (`TIERS`) its parts of w13
    then its parts of w2, each section 256-byte aligned:

    - `w2` (`LAYOUT_ID`): codes uint8 [N, K/4], scales uint8 [N, K/32] (UE8M0);
    - `fp4r` (`FP4R_LAYOUT_ID`) and `fp4x-mxfp4` (`MXFP4_LAYOUT_ID`): codes uint8 [N, K/2]
      (e2m1 nibbles, low nibble = even k), scales uint8 [N, K/32] (UE8M0; fp4r shares the W2
      scales). The bytes are alike; the ids differ because the data does (re-quantized vs the
      checkpoint's own);
    - `fp4r-refine` (`FP4R_REFINE_LAYOUT_ID`): refine uint8 [N, 5K/16], moet-quant's base-5
      refinement plane only; the W2 row of the same expert supplies codes and scales;
    - `fp4x-nvfp4` (`NVFP4_LAYOUT_ID`): codes uint8 [N, K/2], scales uint8 [N, K/16] (e4m3),
      scale_2 float32 [N] (the global scale per output row: a per-projection scalar is repeated
      over the projection's rows, so gate and up keep their own in the fused w13).

    w13 stacks gate over up ([2I, H] logically), w2 is down ([H, I]); I is this rank's share of the
    expert intermediate size. A GPU slot holds a row's first `row_bytes` verbatim, so fetching an
    expert is one copy.
    """

    def __init__(self, hidden: int, inter: int, tier: str | Tier = "w2"):
        if hidden % 32 or inter % 32 or hidden <= 0 or inter <= 0:
            raise ValueError(
                f"expert rows need hidden and intermediate sizes that are positive "
                f"multiples of 32, got hidden={hidden}, intermediate={inter}"
            )
        self.hidden, self.inter = hidden, inter
        self.tier = tier_of(tier)
        self.layout_id = self.tier.layout_id
        dims = {"w13": (2 * inter, hidden), "w2": (hidden, inter)}
        self.sections: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        offset = 0
        for proj in PROJECTIONS:
            for part, frac in self.tier.parts:
                name = f"{proj}_{part}"
                shape = self.tier.section_shape(part, *dims[proj])
                self.sections[name] = (offset, shape)
                self.dtypes[name] = np.dtype("<f4") if frac is None else np.dtype(np.uint8)
                offset += _ceil(self._nbytes(name), SECTION_ALIGN)
        self.row_bytes = offset

    def _nbytes(self, name: str) -> int:
        return int(np.prod(self.sections[name][1])) * self.dtypes[name].itemsize

    @property
    def spec(self) -> str:
        """The row-section part of the ABI string (W2: `rows-a256[...]`, as before; other tiers
        start with their layout id)."""

        def shape(n, s):
            dims = "x".join(str(d) for d in s)
            return dims if self.dtypes[n] == np.uint8 else f"{dims}f32"

        parts = [f"{n}@{o}:{shape(n, s)}" for n, (o, s) in self.sections.items()]
        head = "rows" if self.tier is W2 else self.layout_id
        return f"{head}-a{SECTION_ALIGN}[{','.join(parts)}]"

    def pack(self, **arrays) -> np.ndarray:
        """The tier's sections [E, *section shape] (names as `sections`; uint8, float32 for
        scale_2) -> rows uint8 [E, row_bytes]. FP4 tiers refuse NaN or negative scales and
        sections of another tier."""
        missing = set(self.sections) - set(arrays)
        extra = set(arrays) - set(self.sections) if self.tier is not W2 else ()  # W2: as before
        if missing or extra:
            raise ValueError(
                f"{self.tier.name} rows take the sections {list(self.sections)}, got {list(arrays)}"
            )
        n_experts = next(iter(arrays.values())).shape[0]
        rows = np.zeros((n_experts, self.row_bytes), dtype=np.uint8)
        for name, (offset, shape) in self.sections.items():
            a = np.asarray(arrays[name])
            dtype = self.dtypes[name]
            if a.dtype != dtype or a.shape != (n_experts, *shape):
                want = "uint8" if dtype == np.uint8 else "float32"
                raise ValueError(
                    f"{name}: expected {want} {[n_experts, *shape]}, found {a.dtype} {list(a.shape)}"
                )
            if self.tier is not W2:
                check_scale_values(self.tier, name, a)
            flat = np.ascontiguousarray(a).reshape(n_experts, -1).view(np.uint8)
            rows[:, offset : offset + flat.shape[1]] = flat
        return rows

    def unpack(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """rows uint8 [E, >= row_bytes] -> the sections as views [E, *shape]."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] < self.row_bytes:
            raise ValueError(
                f"rows of shape {list(rows.shape)} are shorter than a row ({self.row_bytes} bytes)"
            )
        out = {}
        for name, (offset, shape) in self.sections.items():
            raw = rows[:, offset : offset + self._nbytes(name)]
            out[name] = raw.view(self.dtypes[name]).reshape(-1, *shape)
        return out

    def views(self, row):
        """One row (numpy or torch, 1-D, >= row_bytes) -> its sections as views, unpadded.
        What an op reads from a GPU pool slot (scale_2 as float32: a view where the row's
        address allows it, else a copy)."""
        out = {}
        for name, (offset, shape) in self.sections.items():
            raw = row[offset : offset + self._nbytes(name)]
            if self.dtypes[name] != np.uint8:
                if isinstance(raw, torch.Tensor):
                    if raw.storage_offset() % 4:
                        raw = raw.clone()
                    raw = raw.view(torch.float32)
                else:
                    raw = np.ascontiguousarray(raw).view(self.dtypes[name])
            out[name] = raw.reshape(shape)
        return out


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


# --- the kernel-native layout ---------------------------------------------------------------------

GROUP_ROWS = 64  # rows per work item: 4 mma row tiles of 16
TILE_ROWS = 16  # rows per mma row tile: the unit of the fast/slow choice
CHUNK_K = 128  # K per 16-byte load of a lane: 4 blocks of 32, one per lane group t
PAD_SCALE = 127  # UE8M0 1.0: padded rows stay finite (and fast)
SCALE_WORDS_BYTES = 256  # per (group, chunk): 4 row tiles x 8 lane groups x 2 rows x 4 bytes
SCALE_CHUNK_BYTES = 264  # ... then 4 slow-flag bytes (one per row tile) and 4 zero bytes
FAST_SPREAD = 4  # W2: a fast row-chunk's block scales lie within b_min .. b_min + 4
FP4_FAST_SPREAD = 3  # FP4: int8 levels 2*e2m1 (<= 12) times 2**spread stay <= 127 (12 * 8 = 96)
CODE_FORMATS = ("w2", "e2m1")  # `Tier.codes` of the tiers with a native layout
_LOG2_ONE_HOT = torch.tensor([max(f.bit_length() - 1, 0) for f in range(32)])  # 2**m -> m


def _unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/4] -> codes 0..3 [..., K] (k = 4 * byte + field)."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)
    return ((codes.unsqueeze(-1) >> shifts) & 3).flatten(-2)


def _repack_codes(fields: torch.Tensor) -> torch.Tensor:
    """codes 0..3 [..., K] -> uint8 [..., K/4]."""
    f = fields.unflatten(-1, (-1, 4)).to(torch.uint8)
    return f[..., 0] | f[..., 1] << 2 | f[..., 2] << 4 | f[..., 3] << 6


def _padded_scales(scales: torch.Tensor, rows_p: int, k_p: int) -> torch.Tensor:
    """Logical scales [E, N, K/32] -> [E, rows_p, k_p/32]: padded rows 127 throughout; a row's
    padded blocks the minimum of its chunk's real blocks (127 in a chunk with none), so padding
    never makes a row-chunk slow (the padded weights are 0 and meet zero activations)."""
    e, n, kb = scales.shape
    s = torch.full((e, rows_p, k_p // 32), PAD_SCALE, dtype=torch.uint8, device=scales.device)
    s[:, :n, :kb] = scales
    first = kb - kb % 4  # the first block of the last, partly real chunk
    if kb % 4 and kb < k_p // 32:
        s[:, :n, kb : first + 4] = scales[:, :, first:].amin(dim=-1, keepdim=True)
    return s


def native_scale_words(
    scales: torch.Tensor, spread: int = FAST_SPREAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales [E, rows, chunks, 4] (rows a multiple of 16) -> (words int64 [E, rows, chunks],
    slow bool [E, rows / 16, chunks]): the v2 scale word of each row-chunk (module docstring),
    fast-eligible with min b_j >= 1 and max b_j - min b_j <= `spread` (`FAST_SPREAD` for W2,
    `FP4_FAST_SPREAD` for the FP4 tiers)."""
    if not 0 <= spread <= 4:  # one-hot multipliers up to 16 fit the 5-bit fields
        raise ValueError(f"a fast spread of {spread} does not fit the scale word (0..4)")
    b = scales.to(torch.int64)
    b_min, b_max = b.amin(dim=-1), b.amax(dim=-1)
    eligible = (b_min >= 1) & (b_max - b_min <= spread)
    e, rows, cc = eligible.shape
    slow = ~eligible.view(e, rows // TILE_ROWS, TILE_ROWS, cc).all(dim=2)
    fields = 5 * torch.arange(4, device=b.device)
    shift = (b - b_min.unsqueeze(-1)).clamp(0, spread)  # only read where eligible
    fast = (b_min << 23) | (torch.ones_like(b) << (shift + fields)).sum(dim=-1)
    raw = (b << (8 * torch.arange(4, device=b.device))).sum(dim=-1)
    slow_rows = slow.repeat_interleave(TILE_ROWS, dim=1)
    return torch.where(slow_rows, raw, fast), slow


def _check_code_format(code_format: str) -> None:
    if code_format not in CODE_FORMATS:
        raise ValueError(f"unknown code format {code_format!r}; known: {', '.join(CODE_FORMATS)}")


def _native_w2_codes(codes: torch.Tensor, rows_p: int, k_p: int) -> torch.Tensor:
    """Logical 2-bit codes uint8 [E, N, K/4] -> native v2 codes [E, rows_p*k_p/4]."""
    e, n, k = codes.shape[0], codes.shape[1], codes.shape[2] * 4
    c = torch.zeros(e, rows_p, k_p, dtype=torch.uint8, device=codes.device)
    c[:, :n, :k] = _unpack_codes(codes)
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    # rows: rg, rt, jl, g (row = 16 rt + 8 jl + g); k: cc, t, tt, jh, ih, il (k = 32 t + 8 tt
    # + 4 jh + 2 ih + il); register j = 2 jh + jl, byte i = 2 ih + il sits at bit 16 jh + 4 i + 2 jl
    c = c.view(e, rg, 4, 2, 8, cc, 4, 4, 2, 2, 2)
    byte = (
        c[:, :, :, 0, ..., 0]
        | c[:, :, :, 1, ..., 0] << 2
        | c[:, :, :, 0, ..., 1] << 4
        | c[:, :, :, 1, ..., 1] << 6
    )
    # byte dims: e, rg, rt, g, cc, t, tt, jh, ih -> e, rg, cc, rt, g, t, tt, jh, ih
    return byte.permute(0, 1, 4, 2, 3, 5, 6, 7, 8).reshape(e, -1)


def _native_e2m1_codes(codes: torch.Tensor, rows_p: int, k_p: int) -> torch.Tensor:
    """Logical e2m1 nibbles uint8 [E, N, K/2] (low nibble = even k) -> native FP4 codes
    [E, rows_p*k_p/2]. The code of k (i = 2 ih + il) sits at bit 16 jh + 4 i of its word, i.e. in
    byte 2 jh + ih of the word, nibble il: each logical byte moves whole."""
    e, n, kh = codes.shape
    c = torch.zeros(e, rows_p, k_p // 2, dtype=torch.uint8, device=codes.device)
    c[:, :n, :kh] = codes
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    # rows: rg, rt, jl, g (row = 16 rt + 8 jl + g); bytes: cc, t, tt, jh, ih (k / 2 = 16 t + 4 tt
    # + 2 jh + ih within the chunk) -> e, rg, cc, rt, g, t (lane 4g + t), tt, jl (word 2tt + jl),
    # jh, ih (byte 2 jh + ih of the word)
    c = c.view(e, rg, 4, 2, 8, cc, 4, 4, 2, 2)
    return c.permute(0, 1, 5, 2, 4, 6, 7, 3, 8, 9).reshape(e, -1)


def native_matrix(
    codes: torch.Tensor,
    scales: torch.Tensor,
    rows_p: int,
    k_p: int,
    *,
    code_format: str = "w2",
    spread: int = FAST_SPREAD,
):
    """Logical codes uint8 [E, N, K/4] (`code_format` "w2") or [E, N, K/2] ("e2m1") and scales
    [E, N, K/32] (N <= rows_p, K <= k_p, rows_p a multiple of 64 and k_p of 128) -> native
    (codes [E, rows_p*k_p/4] or [E, rows_p*k_p/2], scales [E, rows_p/64 * k_p/128 * 264]), fast
    row-chunks within `spread` (`native_scale_words`)."""
    _check_code_format(code_format)
    e = codes.shape[0]
    if bool((scales == 255).any()):
        raise ValueError("a UE8M0 scale of 255 (NaN) cannot be packed for the kernels")
    dev = codes.device
    if code_format == "w2":
        native_c = _native_w2_codes(codes, rows_p, k_p)
    else:
        native_c = _native_e2m1_codes(codes, rows_p, k_p)
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    s = _padded_scales(scales, rows_p, k_p).view(e, rows_p, cc, 4)
    words, slow = native_scale_words(s, spread)
    # words: e, rg, rt, jl, g, cc -> e, rg, cc, rt, g, jl; 4 little-endian bytes each
    words = words.view(e, rg, 4, 2, 8, cc).permute(0, 1, 5, 2, 4, 3)
    shifts = 8 * torch.arange(4, device=dev)
    word_bytes = ((words.unsqueeze(-1) >> shifts) & 255).to(torch.uint8).reshape(e, rg, cc, -1)
    flags = torch.zeros(
        e, rg, cc, SCALE_CHUNK_BYTES - SCALE_WORDS_BYTES, dtype=torch.uint8, device=dev
    )
    flags[..., :4] = slow.view(e, rg, 4, cc).permute(0, 1, 3, 2)
    native_s = torch.cat([word_bytes, flags], dim=-1).reshape(e, -1)
    return native_c, native_s


def _logical_w2_codes(native_c: torch.Tensor, n: int, k: int, rows_p: int, k_p: int):
    e = native_c.shape[0]
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    # native dims e, rg, cc, rt, g, t, tt, jh, ih -> e, rg, rt, g, cc, t, tt, jh, ih
    byte = native_c.reshape(e, rg, cc, 4, 8, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5, 6, 7, 8)
    fields = torch.stack(
        [
            torch.stack([(byte >> (4 * il + 2 * jl)) & 3 for il in range(2)], dim=-1)
            for jl in range(2)
        ],
        dim=3,
    )  # e, rg, rt, jl, g, cc, t, tt, jh, ih, il
    c = fields.reshape(e, rows_p, k_p)[:, :n, :k]
    return _repack_codes(c)


def _logical_e2m1_codes(native_c: torch.Tensor, n: int, k: int, rows_p: int, k_p: int):
    e = native_c.shape[0]
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    # native dims e, rg, cc, rt, g, t, tt, jl, jh, ih -> e, rg, rt, jl, g, cc, t, tt, jh, ih
    c = native_c.reshape(e, rg, cc, 4, 8, 4, 4, 2, 2, 2).permute(0, 1, 3, 7, 4, 2, 5, 6, 8, 9)
    return c.reshape(e, rows_p, k_p // 2)[:, :n, : k // 2].contiguous()


def logical_matrix(
    native_c: torch.Tensor,
    native_s: torch.Tensor,
    n: int,
    k: int,
    rows_p: int,
    k_p: int,
    *,
    code_format: str = "w2",
):
    """The inverse of `native_matrix`: -> logical (codes [E, n, k/4] or, "e2m1", [E, n, k/2],
    scales [E, n, k/32]). The scale words decode alike whatever the fast spread was."""
    _check_code_format(code_format)
    e = native_c.shape[0]
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    if code_format == "w2":
        codes = _logical_w2_codes(native_c, n, k, rows_p, k_p)
    else:
        codes = _logical_e2m1_codes(native_c, n, k, rows_p, k_p)
    chunk = native_s.reshape(e, rg, cc, SCALE_CHUNK_BYTES)
    shifts = 8 * torch.arange(4, device=native_s.device)
    words = chunk[..., :SCALE_WORDS_BYTES].reshape(e, rg, cc, 4, 8, 2, 4).to(torch.int64)
    words = (words << shifts).sum(dim=-1)  # e, rg, cc, rt, g, jl
    slow = chunk[..., SCALE_WORDS_BYTES : SCALE_WORDS_BYTES + 4].bool()  # e, rg, cc, rt
    raw = (words.unsqueeze(-1) >> shifts) & 255
    b_min = ((words >> 23) & 255).unsqueeze(-1)
    one_hot = (words.unsqueeze(-1) >> (5 * torch.arange(4, device=words.device))) & 31
    fast = b_min + _LOG2_ONE_HOT.to(words.device)[one_hot]
    s = torch.where(slow[..., None, None, None], raw, fast)  # e, rg, cc, rt, g, jl, j
    s = s.permute(0, 1, 3, 5, 4, 2, 6).reshape(e, rows_p, k_p // 32)[:, :n, : k // 32]
    return codes, s.to(torch.uint8).contiguous()


NVFP4_SCALE_HEAD = 256  # per group: 64 float32 scale_2, then the chunks' e4m3 scales
NVFP4_SCALE_CHUNK = 512  # per (group, chunk): 4 row tiles x 8 lane groups x 8 blocks x 2 rows


def native_nvfp4_matrix(
    codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor, rows_p: int, k_p: int
):
    """NVFP4 logical sections (e2m1 nibbles uint8 [E, N, K/2], e4m3 scales uint8 [E, N, K/16],
    float32 scale_2 [E, N]) -> native (codes [E, rows_p*k_p/2], scales [E, rows_p/64 * (256 +
    k_p/128 * 512)]) in the `NATIVE_NVFP4_LAYOUT_ID` layout (module docstring)."""
    e, n, kh = codes.shape
    dev = codes.device
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    c = torch.zeros(e, rows_p, k_p // 2, dtype=torch.uint8, device=dev)
    c[:, :n, :kh] = codes
    # rows: rg, rt, jl, g (row = 16 rt + 8 jl + g); bytes: cc, kt, t, ih (k / 2 = 8 kt + 2 t + ih
    # within the chunk) -> e, rg, cc, rt, g, t (lane 4g + t), kt (word), jl, ih (byte 2 jl + ih)
    c = c.view(e, rg, 4, 2, 8, cc, 8, 4, 2).permute(0, 1, 5, 2, 4, 7, 6, 3, 8)
    s = torch.zeros(e, rows_p, k_p // 16, dtype=torch.uint8, device=dev)
    s[:, :n, : scales.shape[2]] = scales
    # rows: rg, rt, jl, g; blocks: cc, kt -> e, rg, cc, rt, g, kt, jl
    s = s.view(e, rg, 4, 2, 8, cc, 8).permute(0, 1, 5, 2, 4, 6, 3).reshape(e, rg, -1)
    s2 = torch.zeros(e, rows_p, dtype=torch.float32, device=dev)
    s2[:, :n] = scale_2
    head = s2.view(e, rg, GROUP_ROWS).view(torch.uint8)  # little-endian float32 bytes
    return c.reshape(e, -1), torch.cat([head, s], dim=-1).reshape(e, -1)


def logical_nvfp4_matrix(
    native_c: torch.Tensor, native_s: torch.Tensor, n: int, k: int, rows_p: int, k_p: int
):
    """The inverse of `native_nvfp4_matrix` -> (codes [E, n, k/2], scales [E, n, k/16], scale_2
    float32 [E, n])."""
    e = native_c.shape[0]
    rg, cc = rows_p // GROUP_ROWS, k_p // CHUNK_K
    # native dims e, rg, cc, rt, g, t, kt, jl, ih -> e, rg, rt, jl, g, cc, kt, t, ih
    c = native_c.reshape(e, rg, cc, 4, 8, 4, 8, 2, 2).permute(0, 1, 3, 7, 4, 2, 6, 5, 8)
    codes = c.reshape(e, rows_p, k_p // 2)[:, :n, : k // 2].contiguous()
    grp = native_s.reshape(e, rg, NVFP4_SCALE_HEAD + cc * NVFP4_SCALE_CHUNK)
    # a copy: the head's bytes may sit at any offset of a pool, and a float32 view needs 4-aligned
    scale_2 = grp[..., :NVFP4_SCALE_HEAD].clone().view(torch.float32).reshape(e, rows_p)
    # native dims e, rg, cc, rt, g, kt, jl -> e, rg, rt, jl, g, cc, kt
    s = grp[..., NVFP4_SCALE_HEAD:].reshape(e, rg, cc, 4, 8, 8, 2).permute(0, 1, 3, 6, 4, 2, 5)
    scales = s.reshape(e, rows_p, k_p // 16)[:, :n, : k // 16].contiguous()
    return codes, scales, scale_2[:, :n].contiguous()


def slow_tile_fraction(native_scales) -> float:
    """The fraction of slow (row tile, chunk) pairs in native scale sections (numpy or torch,
    uint8 [..., groups * chunks * 264], e.g. one `NativeRowLayout` scale section or several;
    W2 and FP4 rows alike)."""
    s = torch.as_tensor(native_scales).reshape(-1, SCALE_CHUNK_BYTES)
    flags = s[:, SCALE_WORDS_BYTES : SCALE_WORDS_BYTES + 4]
    return int(flags.bool().sum()) / flags.numel()


NATIVE_TIERS = (W2, FP4R, MXFP4, NVFP4)  # the tiers with a kernel-native layout


def expand_refinement(codes: torch.Tensor, refine: torch.Tensor) -> torch.Tensor:
    """The `fp4r` e2m1 nibbles, packed uint8 [..., N, K/2] (low nibble = even k), rebuilt in torch
    on the tensors' device from W2 codes uint8 [..., N, K/4] and the refinement plane uint8
    [..., N, 5K/16] (moet_quant.fp4: a base-5 digit per weight picks the magnitude inside the class
    the 2-bit code gives; 4 digits per 10-bit group, 4 groups per 5 bytes, little-endian). This is
    how the refinement tier reaches the kernels: hosts keep the 2.5-bit plane, a fetch expands it
    next to the W2 row into an fp4r row (`NativeRowLayout.pack_refined`). A corrupt plane (a group
    >= 625, a digit > 2 under a +-4 code) raises ValueError; nothing is returned then. The numpy
    original stays the oracle (`reference.refined_codes`); the tests hold the two equal."""
    if codes.dtype != torch.uint8 or refine.dtype != torch.uint8 or codes.dim() < 2:
        raise ValueError(
            f"codes and refine must be uint8 [..., N, K/4] and [..., N, 5K/16], got "
            f"{codes.dtype} {tuple(codes.shape)} and {refine.dtype} {tuple(refine.shape)}"
        )
    k = 4 * codes.shape[-1]
    if k % 16 or tuple(refine.shape) != (*codes.shape[:-1], 5 * k // 16):
        raise ValueError(
            f"a refinement plane for codes {tuple(codes.shape)} (K={k}) must be "
            f"{[*codes.shape[:-1], 5 * k // 16]} (K a multiple of 16), got {list(refine.shape)}"
        )
    lead = codes.shape[:-1]
    shifts = torch.arange(0, 8, 2, device=codes.device, dtype=torch.uint8)
    c = ((codes.unsqueeze(-1) >> shifts) & 3).reshape(*lead, k)
    b = refine.reshape(*lead, k // 16, 5).long()
    word = sum(b[..., i] << (8 * i) for i in range(5))  # 40 bits: 4 groups of 10
    group = (word.unsqueeze(-1) >> torch.arange(0, 40, 10, device=codes.device)) & 0x3FF
    if bool((group >= 625).any()):
        raise ValueError("refinement plane: a 10-bit group >= 625 (corrupt data)")
    powers = torch.tensor([1, 5, 25, 125], device=codes.device)
    digit = ((group.unsqueeze(-1) // powers) % 5).reshape(*lead, k)
    big = (c == 0) | (c == 3)  # codes -4, +4: magnitudes from the grid index BIG_FROM (3.0) up
    if bool((big & (digit > 2)).any()):
        raise ValueError("refinement plane: a digit > 2 under a +-4 code (corrupt data)")
    nib = ((c < 2).long() << 3) | (digit + torch.where(big, BIG_FROM, 0))
    nib = nib.to(torch.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def _native_tier(tier: str | Tier) -> Tier:
    t = TIERS.get(tier) if isinstance(tier, str) else tier
    if t not in NATIVE_TIERS:
        name = tier.name if isinstance(tier, Tier) else tier
        supported = ", ".join(repr(n.name) for n in NATIVE_TIERS)
        raise ValueError(
            f"tier {name!r} has no kernel-native layout; NativeRowLayout supports the tiers "
            f"{supported}"
        )
    return TIERS[t.name]


class NativeRowLayout:
    """Expert rows in the kernel-native layout (module docstring) of one tier: "w2" (the default,
    `NATIVE_LAYOUT_ID`), "fp4r" or "fp4x-mxfp4" (the same bytes, `NATIVE_FP4_LAYOUT_ID`),
    "fp4x-nvfp4" (`NATIVE_NVFP4_LAYOUT_ID`); others raise ValueError. The same interface as
    `RowLayout`: `pack` takes the tier's logical sections [E, ...] (names, shapes and dtypes as
    `RowLayout(hidden, inter, tier).sections`: codes [N, K/4] for W2, e2m1 nibbles [N, K/2] for
    FP4; UE8M0 scales [N, K/32], or for NVFP4 e4m3 scales [N, K/16] and float32 scale_2 [N]) and
    `views` returns them, unpacked, from one native row (a copy, not a view);
    `slow_tile_fractions` tells how much of a row the kernels read on the slow path.
    `fast_spread` is the tier's fast-eligibility spread limit (`FAST_SPREAD`, `FP4_FAST_SPREAD`;
    None for NVFP4, which has no fast/slow split). Every section's name is `<w13|w2>_<codes|
    scales>` (NVFP4's scale_2 lives in its scales section)."""

    tier = W2
    layout_id = NATIVE_LAYOUT_ID

    def __init__(self, hidden: int, inter: int, tier: str | Tier = "w2"):
        self.tier = _native_tier(tier)
        self.logical = RowLayout(hidden, inter, self.tier)  # the same size checks
        w2, nv = self.tier is W2, self.tier is NVFP4
        self.layout_id = (
            NATIVE_LAYOUT_ID if w2 else NATIVE_NVFP4_LAYOUT_ID if nv else NATIVE_FP4_LAYOUT_ID
        )
        self.code_format = self.tier.codes  # "w2" or "e2m1"
        self.fast_spread = FAST_SPREAD if w2 else None if nv else FP4_FAST_SPREAD
        codes_per_byte = 4 if w2 else 2
        self.hidden, self.inter = hidden, inter
        self.hidden_p, self.inter_p = _ceil(hidden, CHUNK_K), _ceil(inter, CHUNK_K)
        self.w13_rows = 2 * inter  # 32-row units of gate and up: a multiple of 64
        self.w2_rows = _ceil(hidden, GROUP_ROWS)

        def scale_bytes(rows, k_p):  # per matrix: per group (head + chunks)
            chunks = k_p // CHUNK_K
            per_group = (
                NVFP4_SCALE_HEAD + chunks * NVFP4_SCALE_CHUNK if nv else chunks * SCALE_CHUNK_BYTES
            )
            return rows // GROUP_ROWS * per_group

        sizes = {
            "w13_codes": self.w13_rows * self.hidden_p // codes_per_byte,
            "w13_scales": scale_bytes(self.w13_rows, self.hidden_p),
            "w2_codes": self.w2_rows * self.inter_p // codes_per_byte,
            "w2_scales": scale_bytes(self.w2_rows, self.inter_p),
        }
        self.offsets: dict[str, int] = {}
        offset = 0
        for name in SECTIONS:
            self.offsets[name] = offset
            offset += _ceil(sizes[name], SECTION_ALIGN)
        self.sizes = sizes
        self.row_bytes = offset
        u = torch.arange(inter // 32).view(-1, 1)
        q = torch.arange(GROUP_ROWS).view(1, -1)
        # native w13 row 64u + q: gate row 32u + q for q < 32, else up row inter + 32u + q - 32
        self._w13_rows = torch.where(q < 32, 32 * u + q, inter + 32 * u + q - 32).flatten()
        self._w13_inverse = torch.argsort(self._w13_rows)

    @property
    def spec(self) -> str:
        """The row-section part of the ABI string (starting with `layout_id`)."""
        parts = [f"{n}@{self.offsets[n]}:{self.sizes[n]}" for n in SECTIONS]
        return f"{self.layout_id}-a{SECTION_ALIGN}[{','.join(parts)}]"

    def pack(self, **arrays) -> np.ndarray:
        """The tier's logical arrays [E, *shape] (names, shapes and dtypes as
        `RowLayout(hidden, inter, tier).sections`) -> rows uint8 [E, row_bytes]: numpy in, numpy
        out; torch tensors in, a tensor out on their device (pack on the GPU). A UE8M0 scale of
        255 is refused, and for NVFP4 a NaN or negative e4m3 scale or scale_2."""
        sections = self.logical.sections
        missing = set(sections) - set(arrays)
        extra = set(arrays) - set(sections) if self.tier is not W2 else ()  # W2: as before
        if missing or extra:
            raise ValueError(
                f"{self.tier.name} rows take the sections {list(sections)}, got {list(arrays)}"
            )
        t = {}
        n_experts = next(iter(arrays.values())).shape[0]
        as_numpy = not all(isinstance(a, torch.Tensor) for a in arrays.values())
        for name, (_, shape) in sections.items():
            a = torch.as_tensor(arrays[name])
            want = torch.float32 if self.logical.dtypes[name] != np.uint8 else torch.uint8
            if a.dtype != want or tuple(a.shape) != (n_experts, *shape):
                raise ValueError(
                    f"{name}: expected {str(want)[6:]} {[n_experts, *shape]}, found "
                    f"{str(a.dtype).replace('torch.', '')} {list(a.shape)}"
                )
            if self.tier is NVFP4 and name.endswith(("_scales", "_scale_2")):  # not the codes
                check_scale_values(self.tier, name, a.cpu())
            t[name] = a
        perm = self._w13_rows.to(t["w13_codes"].device)
        if self.tier is NVFP4:
            w13 = native_nvfp4_matrix(
                *(t[f"w13_{p}"][:, perm] for p in ("codes", "scales", "scale_2")),
                self.w13_rows,
                self.hidden_p,
            )
            w2 = native_nvfp4_matrix(
                t["w2_codes"], t["w2_scales"], t["w2_scale_2"], self.w2_rows, self.inter_p
            )
        else:
            fmt = {"code_format": self.code_format, "spread": self.fast_spread}
            w13 = native_matrix(
                t["w13_codes"][:, perm], t["w13_scales"][:, perm], self.w13_rows, self.hidden_p,
                **fmt,
            )  # fmt: skip
            w2 = native_matrix(t["w2_codes"], t["w2_scales"], self.w2_rows, self.inter_p, **fmt)
        rows = torch.zeros(n_experts, self.row_bytes, dtype=torch.uint8, device=perm.device)
        for name, data in zip(SECTIONS, (*w13, *w2)):
            rows[:, self.offsets[name] : self.offsets[name] + data.shape[1]] = data
        return rows.numpy() if as_numpy else rows

    def pack_refined(self, **arrays) -> torch.Tensor:
        """fp4r rows from the refinement tier: the W2 sections (w13_codes, w13_scales, w2_codes,
        w2_scales) and the refinement planes (w13_refine, w2_refine), tensors [E, ...] ->
        native fp4r rows on their device (`expand_refinement`, then `pack`)."""
        if self.tier is not FP4R:
            raise ValueError(f"pack_refined makes fp4r rows; this layout is {self.tier.name}'s")
        want = {"w13_codes", "w13_scales", "w2_codes", "w2_scales", "w13_refine", "w2_refine"}
        if set(arrays) != want:
            raise ValueError(f"pack_refined takes the sections {sorted(want)}, got {list(arrays)}")
        return self.pack(
            w13_codes=expand_refinement(arrays["w13_codes"], arrays["w13_refine"]),
            w13_scales=arrays["w13_scales"],
            w2_codes=expand_refinement(arrays["w2_codes"], arrays["w2_refine"]),
            w2_scales=arrays["w2_scales"],
        )

    def slow_tile_fractions(self, row) -> dict[str, float]:
        """One native row (numpy or torch, 1-D) -> the fraction of slow (row tile, chunk) pairs of
        w13 and of w2 (`slow_tile_fraction`); 0 for NVFP4 rows, which have no slow path."""
        if self.tier is NVFP4:
            return {"w13": 0.0, "w2": 0.0}
        return {
            proj: slow_tile_fraction(
                row[self.offsets[name] : self.offsets[name] + self.sizes[name]]
            )
            for proj, name in (("w13", "w13_scales"), ("w2", "w2_scales"))
        }

    def views(self, row):
        """One native row (numpy or torch, 1-D, >= row_bytes) -> the tier's logical sections
        (numpy for numpy, else tensors on the row's device)."""
        as_numpy = isinstance(row, np.ndarray)
        r = torch.as_tensor(row).view(1, -1)

        def sec(name):
            return r[:, self.offsets[name] : self.offsets[name] + self.sizes[name]]

        h, i = self.hidden, self.inter
        dims = {
            "w13": (2 * i, h, self.w13_rows, self.hidden_p),
            "w2": (h, i, self.w2_rows, self.inter_p),
        }
        out = {}
        for proj, (n, k, rows_p, k_p) in dims.items():
            if self.tier is NVFP4:
                parts = logical_nvfp4_matrix(
                    sec(f"{proj}_codes"), sec(f"{proj}_scales"), n, k, rows_p, k_p
                )
                names = ("codes", "scales", "scale_2")
            else:
                parts = logical_matrix(
                    sec(f"{proj}_codes"), sec(f"{proj}_scales"), n, k, rows_p, k_p,
                    code_format=self.code_format,
                )  # fmt: skip
                names = ("codes", "scales")
            if proj == "w13":
                inverse = self._w13_inverse.to(r.device)
                parts = [p[:, inverse] for p in parts]
            out.update({f"{proj}_{name}": p[0] for name, p in zip(names, parts)})
        if as_numpy:
            return {k: v.numpy() for k, v in out.items()}
        return out
