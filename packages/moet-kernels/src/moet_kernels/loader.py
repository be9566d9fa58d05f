"""Loading the shipped cubins and launching their kernels (design.md, Kernels).

Cubins are package data (`moet_kernels/cubins/<name>.<arch>.cubin`), one per target: sm_90a
(validated on the H200), sm_100a and sm_120a (compiled and audited, not yet run on such a GPU).
They are loaded with `cuda.bindings.driver` (cuModuleLoadData) into the context torch made current,
and launched with cuLaunchKernelEx on torch's current stream, so torch.cuda.graph captures them.
Every launch allows programmatic dependent launch (PDL): a kernel may be scheduled while its
predecessor in the stream drains, and waits for it on the device (`pdl_enter` in the source) before
it touches memory; between the op's five kernels this hides most of each launch's latency.
Modules load once per device, on first use or through `load()`; loading during graph capture is
refused, because module loading is not capturable: call `load()` (or run once eagerly) first.
`MOET_KERNELS_CUBIN_DIR` points the loader at another folder of cubins (development builds).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from importlib import resources
from pathlib import Path

CUBIN_DIR = "cubins"  # package data folder: moet_kernels/cubins/*.cubin
MODULE = "w2_moe"  # csrc/w2_moe.cu
ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (12, 0): "sm_120a"}
VALIDATED = {"sm_90a"}


class KernelError(RuntimeError):
    """The kernels cannot run here; the message says why and what to do."""


def _cubin_folder() -> Path | None:
    override = os.environ.get("MOET_KERNELS_CUBIN_DIR")
    if override:
        return Path(override)
    folder = resources.files("moet_kernels").joinpath(CUBIN_DIR)
    return Path(str(folder)) if folder.is_dir() else None


def shipped_cubins() -> list[str]:
    """Names of the cubins this build ships (or MOET_KERNELS_CUBIN_DIR holds)."""
    folder = _cubin_folder()
    if folder is None or not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".cubin"))


def _cuda_device() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def arch_of(device) -> str:
    """The cubin target for a torch CUDA device, or a KernelError naming what is supported."""
    import torch

    cc = torch.cuda.get_device_capability(device)
    if cc not in ARCHS:
        supported = ", ".join(f"{a} (compute capability {m}.{n})" for (m, n), a in ARCHS.items())
        raise KernelError(
            f"{torch.cuda.get_device_name(device)} has compute capability {cc[0]}.{cc[1]}; "
            f"moet-kernels ships cubins for {supported}. Use the torch reference "
            "(moet_kernels.reference) on this GPU."
        )
    return ARCHS[cc]


def kernels_available(device=None) -> tuple[bool, str]:
    """Whether the GPU kernels can run here, and why not when they cannot."""
    if not _cuda_device():
        return False, "no CUDA device; ops fall back to the torch reference"
    try:
        arch = arch_of(device if device is not None else 0)
    except KernelError as e:
        return False, str(e)
    name = f"{MODULE}.{arch}.cubin"
    if name not in shipped_cubins():
        return False, (
            f"no {name} in {_cubin_folder()} (the cubins of moet_kernels at "
            f"{Path(__file__).parent}, or MOET_KERNELS_CUBIN_DIR): built without nvcc?; ops "
            "fall back to the torch reference. Reinstall moet-kernels from a wheel, or build it "
            "where nvcc is on PATH."
        )
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False, (
            "cuda.bindings is not installed (pip install cuda-bindings); ops fall back to the "
            "torch reference"
        )
    note = "" if arch in VALIDATED else f" ({arch}: compiled and audited, not validated on a GPU)"
    return True, note


def _check(result, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise KernelError(f"{what} failed: {err.name if hasattr(err, 'name') else err}: {text}")
    return rest[0] if len(rest) == 1 else rest


class Module:
    """One loaded cubin on one device: its functions, launched on torch's current stream."""

    def __init__(self, device_index: int):
        import torch
        from cuda.bindings import driver

        self.device = torch.device("cuda", device_index)
        arch = arch_of(self.device)
        folder = _cubin_folder()
        path = folder / f"{MODULE}.{arch}.cubin" if folder else None
        if path is None or not path.is_file():
            raise KernelError(
                f"{MODULE}.{arch}.cubin is not in {folder}: this moet-kernels was built "
                "without it. Reinstall from a wheel, or build where nvcc is on PATH."
            )
        if torch.cuda.is_current_stream_capturing():
            raise KernelError(
                "moet kernels must be loaded before CUDA graph capture: call "
                "moet_kernels.loader.load() (or run the op once eagerly) first"
            )
        with torch.cuda.device(self.device):
            torch.cuda.init()
            torch.empty(1, device=self.device)  # make torch's primary context current
            self._image = path.read_bytes()
            self.module = _check(driver.cuModuleLoadData(self._image), f"loading {path.name}")
        self.arch = arch
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._functions: dict[str, object] = {}
        self._grids: dict[tuple[str, int], int] = {}

    def function(self, name: str):
        from cuda.bindings import driver

        if name not in self._functions:
            self._functions[name] = _check(
                driver.cuModuleGetFunction(self.module, name.encode()), f"finding kernel {name}"
            )
        return self._functions[name]

    def persistent_grid(self, name: str, block: int, work: int) -> int:
        """CTAs for a persistent kernel: `work` items, at most as many CTAs of `block` threads
        as fit on the GPU at once (the driver's occupancy, asked once per kernel)."""
        from cuda.bindings import driver

        key = (name, block)
        if key not in self._grids:
            per_sm = _check(
                driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function(name), block, 0),
                f"occupancy of {name}",
            )
            self._grids[key] = int(per_sm) * self.sms
        return max(1, min(work, self._grids[key], self._grid_cap))

    _grid_cap = 1 << 30

    @contextlib.contextmanager
    def grid_cap(self, ctas: int):
        """Persistent kernels launched inside use at most `ctas` CTAs (validation checks that
        results do not depend on the grid)."""
        self._grid_cap = ctas
        try:
            yield
        finally:
            del self._grid_cap

    def launch(self, name: str, grid: int, block: int, args: list) -> None:
        """Launch kernel `name` with a 1-D grid on torch's current stream, PDL allowed (module
        docstring). `args` are ctypes values in the kernel's parameter order."""
        import torch
        from cuda.bindings import driver

        pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes = 0
        config.hStream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        config.attrs = [self._pdl]
        config.numAttrs = 1
        _check(
            driver.cuLaunchKernelEx(config, self.function(name), ctypes.addressof(pointers), 0),
            f"launching {name}",
        )

    @functools.cached_property
    def _pdl(self):
        from cuda.bindings import driver

        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        return attr


_modules: dict[int, Module] = {}


def load(device=None) -> Module:
    """The kernels' module on `device` (default: torch's current CUDA device), loaded once."""
    import torch

    index = torch.device(device).index if device is not None else torch.cuda.current_device()
    if index is None:
        index = torch.cuda.current_device()
    if index not in _modules:
        _modules[index] = Module(index)
    return _modules[index]


__all__ = ["KernelError", "Module", "arch_of", "kernels_available", "load", "shipped_cubins"]
