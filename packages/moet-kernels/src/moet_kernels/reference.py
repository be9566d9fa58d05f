"""Torch reference implementations of the moet ops: the CPU serving path and the GPU test oracle.

Weights are in the logical W2 layout of moet checkpoints (design.md, Formats; `layout.LAYOUT_ID`):

- codes uint8 [N, K/4]: code c of weight (n, k) is bits 2*(k % 4) .. 2*(k % 4) + 1 of byte
  codes[n, k // 4] (4 codes per byte, little-endian 2-bit fields along K);
- levels: c = 0, 1, 2, 3 -> -4, -1, +1, +4;
- scales uint8 [N, K/32]: UE8M0, byte b of block k // 32 is 2**(b - 127); b = 255 is NaN
  (as in OCP MX and `moet_quant.numerics.ue8m0_to_f64`);
- w[n, k] = level(c) * 2**(b - 127).

Every product level * 2**(b - 127) is a power of two, so the float32 result is exact wherever
float32 can hold it: from 2**-127 (a subnormal) up to 2**127; |w| = 2**128 and 2**129 (level 4 with
b = 253 or 254) overflow to +-inf. The references have two modes (design.md, Kernels): `exact`
(activations unquantized: the CPU serving path) and `kernel`, the GPU oracle, which mirrors what
the kernels (csrc/w2_moe.cu) quantize: activations to int8 with a float32 scale per token and
block of 128 along K (`ACT_BLOCK`, `quantize_activations`; a K that is not a multiple of 128 is
zero-padded, which leaves every amax as it is), before the gate/up and again before the down
projection, and a scale byte of 0 (2**-127, only in all-zero or sub-1e-37 blocks) read as 0. The
weights keep their exact scale per 32: a kernel promotes a 128-block's int32 partials with the
weight scales times the block's one activation scale (per 32, or once per 128 where the native
layout's fast tiles fold the 32-blocks' power-of-two ratios into the integer sum; the same value
either way, up to float32 accumulation).
Kernel mode computes each projection in float64 from those exact quantized operands; the kernels
accumulate in float32, so the two agree to float32 rounding, and rarely by one int8 step where a
value sits on a rounding boundary.

The FP4 tiers (`layout.TIERS`; docs/kernels.md, "FP4 tiers") have their own decoders, all exact in
float64: `fp4_dequant` (e2m1 nibbles, two per byte, low nibble = even k, times a UE8M0 scale per
32: `fp4r` and `fp4x-mxfp4`), `nvfp4_dequant` (e2m1 times an e4m3 scale per 16 times a float32
global scale per row: `fp4x-nvfp4`; at most 2 + 4 + 24 significant bits, so float64 holds every
product), `refined_codes` (the `fp4r` nibbles rebuilt from W2 codes and moet-quant's refinement
plane) and `tier_dequant` for any tier. The MoE references take the tier as a parameter (default
W2, unchanged): `exact` mode rounds the exact weights to float32 once and computes as for W2;
`kernel` mode takes what an int8 mma kernel computes, `kernel_operands`: 2 * e2m1 is an integer
level in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}, so a weight is an int8 level times half its
scale (UE8M0: 2**(b - 128), a scale byte of 0 read as 0 as for W2; NVFP4: e4m3 / 2 times the
row's global scale, per 16 along K). Activations are quantized per token and 128-block as for
W2 (the same `ACT_BLOCK`: the FP4 tiers' int8 mma kernels read the same activation blocks); the
int32 partial sums are per weight-scale group (32 along K; for NVFP4 per 16-half), each promoted
with its own weight scale times the 128-block's activation scale (kernel mode's float64 value is
the same whichever way the kernel groups these exact products).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moet_quant import fp4 as _quant_fp4
from moet_quant.numerics import E2M1_VALUES, E4M3_VALUES, pack_nibbles

from .layout import W2, Tier, tier_of

LEVELS = (-4.0, -1.0, 1.0, 4.0)  # by 2-bit code
BLOCK = 32  # weights per UE8M0 scale, along K
ACT_BLOCK = 128  # activations per float32 scale of the kernels' int8 quantization, along K
CODES_PER_BYTE = 4
MODES = ("exact", "kernel")
E2M1_LEVELS = tuple(int(2 * v) for v in E2M1_VALUES)  # int8 level (2 * e2m1) by nibble
NVFP4_BLOCK = 16  # weights per e4m3 scale, along K


def w2_dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize one W2 matrix: codes uint8 [N, K/4], scales uint8 [N, K/32] -> float32 [N, K].

    Exact (see the module docstring); leading batch dimensions (e.g. experts) are allowed:
    codes [..., N, K/4], scales [..., N, K/32] -> [..., N, K].
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() < 2 or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} must be [..., N, K/4] "
            "and [..., N, K/32] with the same leading dimensions"
        )
    k = codes.shape[-1] * CODES_PER_BYTE
    if k != scales.shape[-1] * BLOCK:
        raise ValueError(
            f"codes {tuple(codes.shape)} give K = {k}, scales {tuple(scales.shape)} give "
            f"K = {scales.shape[-1] * BLOCK}: expected codes [N, K/4] and scales [N, K/32]"
        )
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)  # field j at bit 2j
    fields = (codes.unsqueeze(-1) >> shifts) & 3  # [..., N, K/4, 4]: k = 4 * byte + j
    fields = fields.reshape(*codes.shape[:-1], k).long()
    levels = torch.tensor(LEVELS, dtype=torch.float64, device=codes.device)[fields]
    exps = scales.to(torch.float64) - 127.0
    block_scale = torch.where(scales == 255, torch.nan, torch.exp2(exps))  # exact powers of two
    w = levels * block_scale.repeat_interleave(BLOCK, dim=-1)
    return w.to(torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [T, K] -> (q int8 [T, K], s float32 [T, ceil(K/128)]), as the kernels do: per token
    and block of `ACT_BLOCK` = 128 along K, s = amax / 127 and q = round-half-even(x / s) in
    float32 (q = 0 where s = 0); a block holding NaN gets s = NaN. A K that is not a multiple of
    128 counts as zero-padded to the next one (the padding leaves amax as it is)."""
    t, k = x.shape
    nb = -(-k // ACT_BLOCK)
    xb = torch.zeros(t, nb * ACT_BLOCK, dtype=torch.float32, device=x.device)
    xb[:, :k] = x
    xb = xb.view(t, nb, ACT_BLOCK)
    nan = torch.isnan(xb).any(dim=-1)
    amax = xb.abs().nan_to_num(nan=0.0).amax(dim=-1)
    # a tensor divisor: CUDA turns a Python-scalar divisor into a multiply by its rounded
    # reciprocal, 1 ulp off the kernels' correctly rounded division for 4% of values
    s = amax / torch.full_like(amax, 127.0)
    s = torch.where(nan, torch.nan, s)
    safe = torch.where(s > 0, s, 1.0).unsqueeze(-1)
    q = torch.where(s.unsqueeze(-1) > 0, torch.round(xb / safe), 0.0).nan_to_num(nan=0.0)
    return q.to(torch.int8).view(t, -1)[:, :k].contiguous(), s


def _dequant_activations(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The exact float64 value of quantized activations: q [..., K], s [..., ceil(K/128)]."""
    scale = s.to(torch.float64).repeat_interleave(ACT_BLOCK, dim=-1)[..., : q.shape[-1]]
    return q.to(torch.float64) * scale


def _fp4_geometry(codes: torch.Tensor, scales: torch.Tensor, group: int, what: str) -> int:
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(
            f"{what}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}"
        )
    k = codes.shape[-1] * 2 if codes.dim() >= 2 else 0
    if codes.dim() < 2 or codes.shape[:-1] != scales.shape[:-1] or k != scales.shape[-1] * group:
        raise ValueError(
            f"{what}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} must be "
            f"[..., N, K/2] (two e2m1 nibbles per byte) and [..., N, K/{group}] with the same "
            "leading dimensions"
        )
    return k


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> nibbles int64 [..., K]; the low nibble holds the even k."""
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()


def fp4_dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles uint8 [..., N, K/2] (low nibble = even k) and UE8M0 scales uint8
    [..., N, K/32] -> float64 [..., N, K], exact: the `fp4r` and `fp4x-mxfp4` tiers
    (w = e2m1 * 2**(b - 127); b = 255 is NaN)."""
    _fp4_geometry(codes, scales, BLOCK, "fp4_dequant")
    values = torch.from_numpy(E2M1_VALUES).to(codes.device)[_nibbles(codes)]
    s = torch.where(scales == 255, torch.nan, torch.exp2(scales.to(torch.float64) - 127.0))
    return values * s.repeat_interleave(BLOCK, dim=-1)


def _row_scale_2(scale_2: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    s2 = torch.as_tensor(scale_2).to(torch.float64)
    if s2.dim() == 0 or s2.numel() == 1:
        return s2.reshape(()).expand(lead)
    if tuple(s2.shape) != tuple(lead):
        raise ValueError(
            f"NVFP4 scale_2 has shape {tuple(s2.shape)}: expected one float32 per row "
            f"{tuple(lead)} or a scalar"
        )
    return s2


def nvfp4_dequant(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """NVFP4 (`fp4x-nvfp4`): e2m1 nibbles uint8 [..., N, K/2], e4m3 scales uint8 [..., N, K/16],
    float32 global scale per row [..., N] (or a scalar) -> float64 [..., N, K], exact
    (w = e2m1 * e4m3 * scale_2; an e4m3 NaN byte gives NaN)."""
    _fp4_geometry(codes, scales, NVFP4_BLOCK, "nvfp4_dequant")
    values = torch.from_numpy(E2M1_VALUES).to(codes.device)[_nibbles(codes)]
    s1 = torch.from_numpy(E4M3_VALUES).to(codes.device)[scales.long()]
    s = s1 * _row_scale_2(scale_2, scales.shape[:-1]).unsqueeze(-1)
    return values * s.repeat_interleave(NVFP4_BLOCK, dim=-1)


def refined_codes(codes: torch.Tensor, refine: torch.Tensor) -> torch.Tensor:
    """W2 codes uint8 [..., N, K/4] + moet-quant's refinement plane uint8 [..., N, 5K/16] ->
    the `fp4r` e2m1 nibbles uint8 [..., N, K/2] (low nibble = even k), exactly as
    `moet_quant.fp4.nibbles_from_refinement` rebuilds them (it raises `FormatError` on a corrupt
    plane). Computed on the CPU, returned on the codes' device."""
    if codes.dtype != torch.uint8 or refine.dtype != torch.uint8 or codes.dim() < 2:
        raise TypeError(
            f"codes and refine must be uint8 [..., N, K/4] and [..., N, 5K/16], got "
            f"{codes.dtype} {tuple(codes.shape)} and {refine.dtype} {tuple(refine.shape)}"
        )
    if codes.shape[:-1] != refine.shape[:-1]:
        raise ValueError(
            f"codes {tuple(codes.shape)} and refine {tuple(refine.shape)} must have the same "
            "leading dimensions"
        )
    c = codes.cpu().numpy().reshape(-1, codes.shape[-1])
    r = refine.cpu().numpy().reshape(-1, refine.shape[-1])
    nib = pack_nibbles(_quant_fp4.nibbles_from_refinement(c, r))
    return torch.from_numpy(np.ascontiguousarray(nib)).view(*codes.shape[:-1], -1).to(codes.device)


def _own_parts(tier: Tier, parts: tuple) -> tuple:
    """A projection's weight parts (`Tier.weight_parts`) -> (codes, scales[, scale_2]) of its
    own format: the refinement tier's are the rebuilt nibbles and the base's scales."""
    if tier.base is not None:
        c, s, r = parts
        return refined_codes(c, r), s
    return tuple(parts)


def _tier_with_parts(tier: str | Tier, parts: tuple) -> Tier:
    """The tier, with one tensor per part of a projection (`Tier.weight_parts`)."""
    tier = tier_of(tier)
    if len(parts) != len(tier.weight_parts):
        raise ValueError(f"{tier.name} takes {tier.weight_parts}, got {len(parts)} tensors")
    return tier


def tier_dequant(tier: str | Tier, *parts: torch.Tensor) -> torch.Tensor:
    """Exact float64 weights [..., N, K] of one projection of any tier, from its parts in
    `Tier.weight_parts` order (w2: codes, scales; fp4r, fp4x-mxfp4: codes, scales; fp4x-nvfp4:
    codes, scales, scale_2; fp4r-refine: W2 codes, W2 scales, refine)."""
    tier = _tier_with_parts(tier, parts)
    if tier is W2:
        return w2_dequant(*parts).to(torch.float64)
    own = _own_parts(tier, parts)
    return nvfp4_dequant(*own) if tier.scale == "e4m3-16" else fp4_dequant(*own)


def fp4_levels(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles uint8 [..., K/2] -> int8 levels [..., K]: 2 * e2m1, in
    {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12} (what an int8 mma kernel multiplies)."""
    return torch.tensor(E2M1_LEVELS, dtype=torch.int8, device=codes.device)[_nibbles(codes)]


def kernel_operands(tier: str | Tier, *parts: torch.Tensor):
    """One projection as an int8 mma kernel reads it -> (levels int8 [..., N, K], weight scales
    float64 [..., N, K/group], group), with w = level * scale per group of K:

    - w2: levels {-4, -1, +1, +4}, scale 2**(b - 127), group 32;
    - fp4r, fp4r-refine, fp4x-mxfp4: levels 2 * e2m1, scale 2**(b - 128) (half the UE8M0 scale),
      group 32;
    - fp4x-nvfp4: levels 2 * e2m1, scale e4m3 / 2 * scale_2 (the row's global scale), group 16.

    A UE8M0 byte of 0 (2**-127) is read as 0, as the W2 kernels do (the byte shifted into a float32
    exponent field); 255 stays NaN. Where neither applies, level * scale is exactly
    `tier_dequant`'s weight."""
    tier = _tier_with_parts(tier, parts)
    if tier is W2:
        codes, scales = parts
        w2_dequant(codes, scales)  # validates
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)
        fields = ((codes.unsqueeze(-1) >> shifts) & 3).flatten(-2).long()
        levels = torch.tensor((-4, -1, 1, 4), dtype=torch.int8, device=codes.device)[fields]
        exps, half, group = scales.to(torch.float64) - 127.0, 1.0, BLOCK
    else:
        own = _own_parts(tier, parts)
        codes, scales = own[0], own[1]
        _fp4_geometry(codes, scales, NVFP4_BLOCK if tier.scale == "e4m3-16" else BLOCK, tier.name)
        levels = fp4_levels(codes)
        if tier.scale == "e4m3-16":
            s1 = torch.from_numpy(E4M3_VALUES).to(codes.device)[scales.long()]
            s2 = _row_scale_2(own[2], scales.shape[:-1]).unsqueeze(-1)
            return levels, s1 / 2.0 * s2, NVFP4_BLOCK
        exps, half, group = scales.to(torch.float64) - 127.0, 0.5, BLOCK
    s = torch.exp2(exps) * half
    s = torch.where(scales == 0, 0.0, torch.where(scales == 255, torch.nan, s))
    return levels, s, group


def _tier_kernel_weights(tier: Tier, parts: tuple) -> torch.Tensor:
    """float64 weights as an int8 mma kernel reads them (`kernel_operands`)."""
    if tier is W2:
        return _kernel_weights(*parts)
    levels, s, group = kernel_operands(tier, *parts)
    return levels.to(torch.float64) * s.repeat_interleave(group, dim=-1)


def _tier_exact_weights(tier: Tier, parts: tuple) -> torch.Tensor:
    """float32 weights for exact mode: W2's exactly as before; FP4's exact float64 values rounded
    to float32 once (exact for fp4r and MXFP4 within float32's range; NVFP4 products may carry up
    to 30 significant bits)."""
    if tier is W2:
        return w2_dequant(*parts)
    return tier_dequant(tier, *parts).to(torch.float32)


def _check_tier_weights(
    tier: Tier, name: str, parts: tuple, n: int | None, k: int | None
) -> tuple[int, int, int]:
    """Shapes and dtypes of one projection's parts [E, N, ...] of a non-W2 tier."""
    specs = tier.weight_specs
    if len(parts) != len(specs):
        raise ValueError(
            f"{name}: the {tier.name} tier takes ({', '.join(p for p, _ in specs)}), "
            f"got {len(parts)} tensors"
        )
    first, frac0 = parts[0], specs[0][1]
    if first.dim() != 3:
        raise ValueError(
            f"{name}: {specs[0][0]} must be [E, N, K*{frac0}], got {tuple(first.shape)}"
        )
    e, rows = first.shape[0], first.shape[1]
    kk = int(first.shape[2] / frac0)
    if kk % BLOCK or kk <= 0:
        raise ValueError(
            f"{name}: {specs[0][0]} {tuple(first.shape)} gives K={kk}, not a multiple of 32"
        )
    for (part, frac), t in zip(specs, parts, strict=True):
        shape = (e, rows) if frac is None else (e, rows, int(kk * frac))
        dtype = torch.float32 if frac is None else torch.uint8
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{name}: {tier.name} {part} must be {dtype} {list(shape)} (K={kk}), got "
                f"{t.dtype} {list(t.shape)}"
            )
    if (n is not None and rows != n) or (k is not None and kk != k):
        raise ValueError(f"{name}: expected [E, {n}, {k}] weights, got [E, {rows}, {kk}]")
    return e, rows, kk


def _check_expert_weights(
    name: str, codes: torch.Tensor, scales: torch.Tensor, n: int | None, k: int | None
) -> tuple[int, int, int]:
    if codes.dim() != 3 or scales.dim() != 3:
        raise ValueError(f"{name}: codes and scales must be [E, N, K/4] and [E, N, K/32]")
    e, rows, kk = codes.shape[0], codes.shape[1], codes.shape[2] * CODES_PER_BYTE
    if tuple(scales.shape) != (e, rows, kk // BLOCK) or kk % BLOCK:
        raise ValueError(
            f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} disagree "
            "(expected [E, N, K/4] and [E, N, K/32], K a multiple of 32)"
        )
    if (n is not None and rows != n) or (k is not None and kk != k):
        raise ValueError(f"{name}: expected [E, {n}, {k}] weights, got [E, {rows}, {kk}]")
    return e, rows, kk


def w2_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: tuple[torch.Tensor, ...],
    w2: tuple[torch.Tensor, ...],
    mode: str = "exact",
    tier: str | Tier = "w2",
) -> torch.Tensor:
    """The routed-experts part of one MoE layer with W2 weights -> float32 [T, H].

    x [T, H] (any float dtype); topk_ids [T, k] (integer expert ids); topk_weights [T, k];
    w13 = (codes uint8 [E, 2I, H/4], scales uint8 [E, 2I, H/32]): rows 0..I-1 are the gate
    projection, rows I..2I-1 the up projection (vLLM's fused w13 order);
    w2 = (codes uint8 [E, H, I/4], scales uint8 [E, H, I/32]), the down projection.

    `kernel` mode: the GPU kernels' arithmetic (module docstring).

    `exact` mode: weights are dequantized exactly to float32 and activations stay unquantized.
    For each (token t, slot j): a = SiLU(x W_gate^T) * (x W_up^T); y_j = a W_down^T, all in
    float32; then out[t] = sum over j = 0, 1, ..., k-1 in that fixed order of
    topk_weights[t, j] * y_j, accumulated in float32 (the routing weight is applied after the
    down projection). A slot routed to the same expert twice counts twice.

    `tier` (a `layout.TIERS` name or `Tier`, default "w2"): w13 and w2 are then the tier's
    per-projection parts in `Tier.weight_parts` order, each [E, N, ...] as in `RowLayout`'s
    sections (fp4r, fp4x-mxfp4: (codes [E, N, K/2], scales [E, N, K/32]); fp4x-nvfp4: (codes,
    scales [E, N, K/16], scale_2 float32 [E, N]); fp4r-refine: (W2 codes, W2 scales, refine
    [E, N, 5K/16])); weights as `_tier_exact_weights` / `kernel_operands` (module docstring).
    """
    tier = tier_of(tier)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a float [T, H] tensor, got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={t}, k]"
        )
    if tier is W2:
        e, two_i, _ = _check_expert_weights("w13", *w13, None, h)
    else:
        e, two_i, _ = _check_tier_weights(tier, "w13", tuple(w13), None, h)
    if two_i % 2:
        raise ValueError(f"w13 must have 2*I rows (gate then up), got {two_i}")
    inter = two_i // 2
    if tier is W2:
        e2, _, _ = _check_expert_weights("w2", *w2, h, inter)
    else:
        e2, _, _ = _check_tier_weights(tier, "w2", tuple(w2), h, inter)
    if e2 != e:
        raise ValueError(f"w13 has {e} experts but w2 has {e2}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
        raise ValueError(f"topk_ids must lie in [0, {e}), got [{topk_ids.min()}, {topk_ids.max()}]")

    def experts(i):
        return (*(p[i] for p in w13), *(p[i] for p in w2))

    return _moe(x, topk_ids, topk_weights, inter, experts, mode=mode, tier=tier)


def _kernel_weights(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weights as the kernels read them (a scale byte of 0 is 0), float64."""
    w = w2_dequant(codes, scales).to(torch.float64)
    return torch.where((scales == 0).repeat_interleave(BLOCK, dim=-1), 0.0, w)


def _moe(
    x, topk_ids, topk_weights, inter, experts, skip=None, mode="exact", tier="w2"
) -> torch.Tensor:
    """The MoE over experts given by `experts(e)` -> w13's then w2's parts of the tier (W2:
    (w13 codes, w13 scales, w2 codes, w2 scales)); `tier` is one tier, or a function of the expert
    id giving each expert's tier; experts for which `skip(e)` is true contribute zero."""
    one = None if callable(tier) else tier_of(tier)
    as_weights = _tier_kernel_weights if mode == "kernel" else _tier_exact_weights

    def weights(e):
        tier_e = one if one is not None else tier_of(tier(e))
        parts = tuple(experts(e))
        n13 = len(tier_e.weight_parts)
        return as_weights(tier_e, parts[:n13]), as_weights(tier_e, parts[n13:])

    return _moe_over(x, topk_ids, topk_weights, inter, weights, skip, mode)


def _moe_over(x, topk_ids, topk_weights, inter, weights, skip, mode) -> torch.Tensor:
    """The MoE over `weights(e)` -> (w13 [2I, H], w2 [H, I]) of the mode's precision (kernel:
    float64, exact: float32). Each expert's routed tokens go through one matmul in token order,
    and the top-k sum is in slot order, so the result for a token does not depend on which other
    experts were skipped: a replay after a fetch is bit-identical to a forward that never
    missed."""
    t, h = x.shape
    xf = x.to(torch.float32)
    if mode == "kernel":
        xf = _dequant_activations(*quantize_activations(xf))
    ids = topk_ids.long()
    slot_out = torch.zeros(t, ids.shape[1], h, dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():  # dequantize each routed expert once
        if skip is not None and skip(expert):
            continue
        tok, slot = torch.nonzero(ids == expert, as_tuple=True)
        w13_e, w2_e = weights(expert)
        gate_up = (xf[tok] @ w13_e.T).to(torch.float32)  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if mode == "kernel":
            act = _dequant_activations(*quantize_activations(act))
        slot_out[tok, slot] = (act @ w2_e.T).to(torch.float32)
    weights_f = topk_weights.to(torch.float32)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for j in range(ids.shape[1]):  # fixed-order top-k sum
        out += weights_f[:, j : j + 1] * slot_out[:, j]
    return out


def dense_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    mode: str = "exact",
) -> torch.Tensor:
    """`w2_moe_reference` over weights already dequantized: w13 [E, 2I, H] (gate rows, then up),
    w2 [E, H, I], any float dtype holding a tier's exact values (a transformers model's fused
    experts after moet_quant.quality.quantized_copy) -> float32 [T, H], in `mode`'s arithmetic
    (kernel: the kernels' int8 activations, float64 GEMMs over the weights as given)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dtype = torch.float64 if mode == "kernel" else torch.float32

    def weights(e):
        return w13[e].to(dtype), w2[e].to(dtype)

    return _moe_over(x, topk_ids, topk_weights, w13.shape[1] // 2, weights, None, mode)


def w2_moe_slots_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: torch.Tensor,
    slot_table: torch.Tensor,
    layout,
    n_real_tokens: int,
    miss_count: torch.Tensor,
    routed: torch.Tensor,
    mode: str = "exact",
    base: tuple | None = None,
) -> torch.Tensor:
    """`w2_moe_reference` over a pool of expert slots (tiered residency, design.md): the route
    op's semantics that the GPU kernels implement too.

    pool uint8 [n_slots, >= layout.row_bytes] holds expert rows (`moet_kernels.layout.RowLayout`
    or `NativeRowLayout`);
    slot_table int32 [E]: this layer's slot of each expert, -1 if not resident. A routed
    (token, expert) pair whose expert is not resident contributes zero; for the first
    `n_real_tokens` rows (padding rows never count) each such pair adds 1 to `miss_count`
    (int32 [1]), and every expert those rows route to is marked in `routed` (uint8 [E]), so the
    runner knows what to fetch. With every routed expert resident the output is bit-identical to
    `w2_moe_reference` on the same weights.

    The tier is the layout's (`RowLayout(hidden, inter, tier)`; W2 by default). The refinement
    tier's rows hold only the refinement plane: `base` = (pool, slot_table, layout) of the W2
    rows supplies codes and scales, and an expert counts as resident only when both its rows are
    (otherwise the pair is a miss: zero, counted, marked).
    """
    tier = getattr(layout, "tier", W2)
    t, h = x.shape
    _check_pool(pool, layout, "pool")
    if layout.hidden != h:
        raise ValueError(f"x has hidden size {h}, the rows {layout.hidden}")
    slots = slot_table.long()
    resident = slots >= 0
    if tier.base is not None:
        if base is None:
            raise ValueError(
                f"{tier.name} rows hold only the refinement plane: pass base=(pool, slot_table, "
                f"layout) of the {tier.base.name} rows, which supply codes and scales"
            )
        b_pool, b_table, b_layout = base
        if getattr(b_layout, "tier", W2) is not tier.base or (b_layout.hidden, b_layout.inter) != (
            layout.hidden,
            layout.inter,
        ):
            raise ValueError(
                f"base layout must be {tier.base.name} rows of hidden={layout.hidden}, "
                f"inter={layout.inter}"
            )
        _check_pool(b_pool, b_layout, "base pool")
        b_slots = b_table.long()
        resident = resident & (b_slots >= 0)
    elif base is not None:
        raise ValueError(f"base rows are for the refinement tier, not {tier.name}")
    ids = topk_ids.long()
    _count_misses(ids, resident, n_real_tokens, miss_count, routed)

    def experts(e):
        v = layout.views(pool[int(slots[e])])
        if tier.base is not None:
            v = {**b_layout.views(b_pool[int(b_slots[e])]), **v}
        return tuple(v[f"{proj}_{part}"] for proj in ("w13", "w2") for part in tier.weight_parts)

    return _moe(
        x,
        ids,
        topk_weights,
        layout.inter,
        experts,
        skip=lambda e: not resident[e],
        mode=mode,
        tier=tier,
    )


def tiered_moe_slots_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiers,
    n_real_tokens: int,
    miss_count: torch.Tensor,
    routed: torch.Tensor,
    mode: str = "exact",
) -> torch.Tensor:
    """`w2_moe_slots_reference` over several tiers at once (design.md, Residency: the FP4 tier
    where an expert is there, else its W2 row, else a miss): `tiers` is a sequence of
    (pool, slot_table, layout) in order of preference, e.g. [(fp4_pool, fp4_table, fp4_layout),
    (w2_pool, w2_table, w2_layout)], all of the same hidden and intermediate sizes. Each routed
    expert is computed from the first tier whose slot table holds it; a pair whose expert no tier
    holds contributes zero, and over the first `n_real_tokens` rows counts in `miss_count` and
    marks `routed`, as with one tier. Tiers whose rows need a base row (the refinement plane) are
    refused: their choice is `w2_moe_slots_reference(..., base=)`."""
    tiers = list(tiers)
    if not tiers:
        raise ValueError("tiers must hold at least one (pool, slot_table, layout)")
    t, h = x.shape
    first = tiers[0][2]
    slots = []
    for pool, table, layout in tiers:
        tier = getattr(layout, "tier", W2)
        if tier.base is not None:
            raise ValueError(
                f"{tier.name} rows need their {tier.base.name} row too: use "
                "w2_moe_slots_reference(..., base=) for them"
            )
        if (layout.hidden, layout.inter) != (h, first.inter):
            raise ValueError(
                f"every tier must have hidden={h}, inter={first.inter}; {tier.name} rows have "
                f"hidden={layout.hidden}, inter={layout.inter}"
            )
        _check_pool(pool, layout, f"{tier.name} pool")
        if table.shape != tiers[0][1].shape:
            raise ValueError(
                f"slot tables must all be [E={tiers[0][1].shape[0]}], {tier.name}'s is "
                f"{tuple(table.shape)}"
            )
        slots.append(table.long())
    choice = torch.full_like(slots[0], -1)
    for i in reversed(range(len(tiers))):  # the first tier holding an expert wins
        choice = torch.where(slots[i] >= 0, i, choice)
    ids = topk_ids.long()
    _count_misses(ids, choice >= 0, n_real_tokens, miss_count, routed)

    def experts(e):
        i = int(choice[e])
        pool, _, layout = tiers[i]
        v = layout.views(pool[int(slots[i][e])])
        return tuple(
            v[f"{proj}_{part}"]
            for proj in ("w13", "w2")
            for part in getattr(layout, "tier", W2).weight_parts
        )

    return _moe(
        x,
        ids,
        topk_weights,
        first.inter,
        experts,
        skip=lambda e: choice[e] < 0,
        mode=mode,
        tier=lambda e: getattr(tiers[int(choice[e])][2], "tier", W2),
    )


def _count_misses(ids, resident, n_real_tokens: int, miss_count, routed) -> None:
    """Marks every expert the real rows route to in `routed` and adds their pairs whose expert is
    not resident to `miss_count` (padding rows never count)."""
    real = ids[:n_real_tokens]
    routed[real.unique()] = 1
    miss_count += int((~resident[real]).sum())


def _check_pool(pool: torch.Tensor, layout, what: str) -> None:
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] < layout.row_bytes:
        raise ValueError(
            f"{what} must be uint8 [n_slots, >= {layout.row_bytes}], got {pool.dtype} "
            f"{tuple(pool.shape)}"
        )


SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How a MoE layer turns router logits into top-k experts and weights.

    scoring: "softmax" (Qwen3, Mixtral) or "sigmoid" (GLM-4.5, DeepSeek-V3); with
    `n_group` > 1 the experts are split into `n_group` equal groups and only the best `topk_group`
    groups compete (a group's score: the sum of its two best biased scores when there is a
    correction bias, else its best score); the correction bias steers selection only, the weights
    are the unbiased scores; `renormalize` makes the k weights sum to 1; `scaling` multiplies them
    last (DeepSeek's routed_scaling_factor).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.top_k < 1 or self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"need top_k >= 1 and 1 <= topk_group <= n_group, got top_k={self.top_k}, "
                f"n_group={self.n_group}, topk_group={self.topk_group}"
            )


def route_reference(
    logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights float32 [T, k], topk_ids int64 [T, k]).

    Computed in float32 whatever the logits' dtype (float64 logits: in float64, the oracle's
    precision). Ties between equal scores go to the lower expert id.
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if e % routing.n_group or routing.top_k > e:
        raise ValueError(f"{e} experts do not fit {routing}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dtype)
    scores = torch.softmax(z, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(z)
    select = scores if correction_bias is None else scores + correction_bias.to(dtype)
    if routing.n_group > 1:
        grouped = select.view(t, routing.n_group, e // routing.n_group)
        if correction_bias is None:
            group_score = grouped.max(dim=-1).values
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = _topk_ids(group_score, routing.topk_group)
        mask = torch.zeros(t, routing.n_group, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, keep, True)
        mask = mask.repeat_interleave(e // routing.n_group, dim=1)
        select = select.masked_fill(~mask, float("-inf"))
    ids = _topk_ids(select, routing.top_k)
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routing.scaling
    return weights.to(torch.float32) if dtype == torch.float32 else weights, ids


def _topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties to the lower index (a stable descending
    sort: torch.topk leaves tie order unspecified)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


__all__ = [
    "ACT_BLOCK",
    "BLOCK",
    "E2M1_LEVELS",
    "LEVELS",
    "MODES",
    "NVFP4_BLOCK",
    "SCORINGS",
    "Routing",
    "fp4_dequant",
    "fp4_levels",
    "kernel_operands",
    "nvfp4_dequant",
    "refined_codes",
    "route_reference",
    "tier_dequant",
    "w2_dequant",
    "w2_moe_reference",
    "quantize_activations",
    "tiered_moe_slots_reference",
    "w2_moe_slots_reference",
]
