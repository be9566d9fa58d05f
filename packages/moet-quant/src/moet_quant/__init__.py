"""moet-quant: checkpoint readers, exact dequantizers and the 2-bit (W2) expert quantizer.

See README.md for the module map and docs/formats.md for the formats byte for byte.
"""

__version__ = "0.1.0"

from .errors import CheckpointError, FormatError, MoetError  # noqa: E402

__all__ = ["__version__", "MoetError", "CheckpointError", "FormatError"]
