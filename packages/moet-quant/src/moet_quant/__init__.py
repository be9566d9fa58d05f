"""moet-quant: checkpoint readers, exact dequantizers and the 2-bit (W2) expert quantizer.

See README.md for the module map and docs/formats.md for the formats byte for byte.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _dist_version

try:  # the pyproject's version, as installed: its one place
    __version__ = _dist_version("moet-quant")
except _NotInstalled:  # imported from a source tree (PYTHONPATH), not installed
    __version__ = "0+source"

from .errors import CheckpointError, FormatError, MoetError  # noqa: E402

__all__ = ["__version__", "MoetError", "CheckpointError", "FormatError"]
