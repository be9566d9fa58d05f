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

LAYOUT_ID = "logical-v0"

__all__ = ["LAYOUT_ID"]
