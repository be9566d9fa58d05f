"""moet, the meta-package: pins the tested set of moet-quant, moet-store, moet-kernels and
moet-vllm, and ships the project's trained fixture model (``moet.models``).

The components are imported under their own names (``moet_quant``, ``moet_vllm``, ...); this
module holds only what belongs to the set as a whole.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _dist_version

try:  # the pyproject's version, as installed: its one place
    __version__ = _dist_version("moet")
except _NotInstalled:  # imported from a source tree (PYTHONPATH), not installed
    __version__ = "0+source"

__all__ = ["__version__"]
