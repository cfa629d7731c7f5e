"""Compiling and launching the FP4 GEMV of :mod:`qerl.kernels.fp4_gemv` (``fp4_gemv.cu``): NVRTC
once per process and variant, the driver's module and function per CUDA context, and the launch
(with programmatic dependent launch when asked) on torch's current stream."""

from __future__ import annotations

import ctypes
import functools
import threading
from importlib import resources

import torch

__all__ = ["cubin", "kernel_function", "launch"]

_LOCK = threading.Lock()

_ARG_TYPES = ((ctypes.c_void_p,) * 7 + (ctypes.c_int,) * 2 + (ctypes.c_void_p,) * 2
              + (ctypes.c_int,) * 5 + (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 5
              + (ctypes.c_void_p,) * 2 + (ctypes.c_int,))


def _check(result, what: str):
    """cuda-bindings calls return ``(status, *values)``: the values, or an error naming ``what``."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise RuntimeError(f"fp4_gemv: {what} failed ({status!r})")
    return values[0] if len(values) == 1 else (values or None)


@functools.cache
def cubin(mx: bool, warps: int, unr: int, pipe: int, ft: int, mrows: int, arch: str,
          lora: int = 0, minb: int = 0, splitk: int = 0) -> bytes:
    """The kernel compiled by NVRTC for ``arch`` (e.g. ``sm_90``); ``lora``: with the LoRA of
    that rank window; ``minb``: at least that many CTAs a multiprocessor (registers capped);
    ``splitk``: 1 where K may be split over CTAs."""
    from cuda.bindings import nvrtc

    src = resources.files("qerl.kernels").joinpath("fp4_gemv.cu").read_bytes()
    prog = _check(nvrtc.nvrtcCreateProgram(src, b"fp4_gemv.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-DMX={int(mx)}".encode(),
            f"-DNWARPS={warps}".encode(), f"-DUNR={unr}".encode(), f"-DPIPE={pipe}".encode(),
            f"-DFT={ft}".encode(), f"-DMROWS={mrows}".encode(), f"-DLORA={lora}".encode(),
            f"-DSPLITK={splitk}".encode()]
    opts += [f"-DMINB={minb}".encode()] if minb else []
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    if int(status) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        nvrtc.nvrtcDestroyProgram(prog)
        raise RuntimeError(f"fp4_gemv: NVRTC could not compile the kernel:\n{log.decode()}")
    size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    image = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    return image


_FUNCTIONS: dict = {}


def kernel_function(mx: bool, warps: int, unr: int, pipe: int, ft: int, mrows: int,
                    device: int, block: int, lora: int = 0, splitk: int = 0):
    """The loaded kernel for the current CUDA context (compiled once per process and variant)
    and how many of its CTAs of ``block`` threads one multiprocessor holds at once; ``lora``:
    the variant with the LoRA of that rank window, held to the plain variant's occupancy."""
    from cuda.bindings import driver

    with torch.cuda.device(device):  # torch's primary context, current on this thread
        torch.cuda.init()
        ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        variant = (warps, unr, pipe, ft, mrows)
        minb = _loaded(driver, ctx, mx, variant, device, block)[1] if lora else 0
        return _loaded(driver, ctx, mx, variant, device, block, lora, minb, splitk)


def _loaded(driver, ctx, mx: bool, variant: tuple[int, ...], device: int, block: int,
            lora: int = 0, minb: int = 0, splitk: int = 0):
    key = (int(ctx), mx, *variant, lora, splitk)
    with _LOCK:
        hit = _FUNCTIONS.get(key)
        if hit is None:
            major, minor = torch.cuda.get_device_capability(device)
            image = cubin(mx, *variant, f"sm_{major}{minor}", lora, minb, splitk)
            module = _check(driver.cuModuleLoadData(image), "cuModuleLoadData")
            fn = _check(driver.cuModuleGetFunction(module, b"fp4_gemv"), "cuModuleGetFunction")
            per_sm = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, 0),
                            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            hit = _FUNCTIONS[key] = (fn, max(1, int(per_sm)))
            _MODULES.append(module)
    return hit


_MODULES: list = []  # loaded modules stay loaded for the process (their functions are cached)


def launch(fn, grid: int, block: int, device: torch.device, pdl: bool, args) -> None:
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
    _check(driver.cuLaunchKernelEx(config, fn, (args, _ARG_TYPES), 0), "cuLaunchKernelEx")
