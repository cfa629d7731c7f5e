"""Compiling and launching our FP4 kernels (``fp4_gemv.cu``, the GEMV of
:mod:`qerl.kernels.fp4_gemv`, and ``fp4_rows.cu``, :mod:`qerl.kernels.fp4_rows`): NVRTC once per
process and variant, the driver's module and function per CUDA context, and the launch (with
programmatic dependent launch when asked) on torch's current stream."""

from __future__ import annotations

import ctypes
import functools
import threading
from importlib import resources

import torch

__all__ = ["ROWS_ARG_TYPES", "compiled", "kernel_function", "launch", "loaded"]

_LOCK = threading.Lock()

_ARG_TYPES = ((ctypes.c_void_p,) * 7 + (ctypes.c_int,) * 2 + (ctypes.c_void_p,) * 2
              + (ctypes.c_int,) * 5 + (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 5
              + (ctypes.c_void_p,) * 2 + (ctypes.c_int,))
# fp4_rows.cu: x, three (weight, scale) pairs, end0, end1, colscale, out, M, N, K, ldo, mx_bias,
# the split's workspace and counters, ks
ROWS_ARG_TYPES = ((ctypes.c_void_p,) * 7 + (ctypes.c_int,) * 2 + (ctypes.c_void_p,) * 2
                  + (ctypes.c_int,) * 5 + (ctypes.c_void_p,) * 2 + (ctypes.c_int,))


def _check(result, what: str):
    """cuda-bindings calls return ``(status, *values)``: the values, or an error naming ``what``."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise RuntimeError(f"fp4_gemv: {what} failed ({status!r})")
    return values[0] if len(values) == 1 else (values or None)


@functools.cache
def compiled(source: str, defines: tuple[tuple[str, int], ...], arch: str) -> bytes:
    """``source`` (a ``.cu`` file of this package, with the shared ``fp4_common.cuh``) compiled by
    NVRTC for ``arch`` (e.g. ``sm_90``) with the ``-D`` macros ``defines``."""
    from cuda.bindings import nvrtc

    files = resources.files("qerl.kernels")
    src = files.joinpath(source).read_bytes()
    header = files.joinpath("fp4_common.cuh").read_bytes()
    prog = _check(nvrtc.nvrtcCreateProgram(src, source.encode(), 1, [header],
                                           [b"fp4_common.cuh"]), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    opts += [f"-D{name}={value}".encode() for name, value in defines]
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    if int(status) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        nvrtc.nvrtcDestroyProgram(prog)
        raise RuntimeError(f"fp4_gemv: NVRTC could not compile {source}:\n{log.decode()}")
    size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    image = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    return image


def kernel_function(mx: bool, warps: int, unr: int, pipe: int, ft: int, mrows: int,
                    device: int, block: int, lora: int = 0, splitk: int = 0):
    """The loaded GEMV for the current CUDA context (compiled once per process and variant)
    and how many of its CTAs of ``block`` threads one multiprocessor holds at once; ``lora``:
    the variant with the LoRA of that rank window, held to the plain variant's occupancy."""
    plain = (("MX", int(mx)), ("NWARPS", warps), ("UNR", unr), ("PIPE", pipe), ("FT", ft),
             ("MROWS", mrows), ("LORA", 0), ("SPLITK", 0))
    minb = loaded("fp4_gemv.cu", "fp4_gemv", plain, device, block)[1] if lora else 0
    defines = plain[:6] + (("LORA", lora), ("SPLITK", splitk))
    return loaded("fp4_gemv.cu", "fp4_gemv", defines + ((("MINB", minb),) if minb else ()),
                  device, block)


def loaded(source: str, name: str, defines: tuple[tuple[str, int], ...], device: int,
           block: int):
    """Kernel ``name`` of ``source`` compiled with ``defines`` (:func:`compiled`), loaded into
    torch's context of ``device`` (once per context): ``(function, CTAs of block threads a
    multiprocessor holds at once)``."""
    from cuda.bindings import driver

    with torch.cuda.device(device):  # torch's primary context, current on this thread
        torch.cuda.init()
        ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        key = (int(ctx), source, defines, block)
        with _LOCK:
            hit = _FUNCTIONS.get(key)
            if hit is None:
                major, minor = torch.cuda.get_device_capability(device)
                image = compiled(source, defines, f"sm_{major}{minor}")
                module = _check(driver.cuModuleLoadData(image), "cuModuleLoadData")
                fn = _check(driver.cuModuleGetFunction(module, name.encode()),
                            "cuModuleGetFunction")
                per_sm = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, 0),
                                "cuOccupancyMaxActiveBlocksPerMultiprocessor")
                hit = _FUNCTIONS[key] = (fn, max(1, int(per_sm)))
                _MODULES.append(module)
        return hit


_FUNCTIONS: dict = {}
_MODULES: list = []  # loaded modules stay loaded for the process (their functions are cached)


def launch(fn, grid: int, block: int, device: torch.device, pdl: bool, args,
           types: tuple = _ARG_TYPES) -> None:
    """Launch ``fn`` on the current stream of ``device`` (with programmatic dependent launch when
    ``pdl``: it may start while the kernel before it runs; it waits for it before reading ``x``)."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = 0
    config.hStream = torch.cuda.current_stream(device).cuda_stream
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attr]
        config.numAttrs = 1
    _check(driver.cuLaunchKernelEx(config, fn, (args, types), 0), "cuLaunchKernelEx")
