"""CUDA C++ kernels compiled at run time with NVRTC (the library PyTorch's CUDA build ships) and launched on PyTorch's
current stream through the driver API: no CUDA toolkit, compiler or build step on the user's machine, a second or so
of compiling per kernel and process.

    kernel = compile_kernel(source, "name", tensor.device, defines={"N": 64})
    kernel.launch(grid, threads, shared_bytes, tensor, ..., ("i32", 5), ("f32", 0.5))

`capability(index)` says whether a device can (NVRTC and the driver found) and what it is; the ops that have a CUDA
kernel fall back to their Triton kernel where it cannot or where the device is older than the kernel needs.
`resources(source, name)` builds a kernel for an H100 without a GPU and reports its registers and spills.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import torch


@functools.lru_cache(maxsize=1)
def _nvrtc():
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    # PyTorch's wheels carry it in an nvidia package (cuda_nvrtc, or cu13), beside the other CUDA libraries
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int] | None:
    """The compute capability of a CUDA device where CUDA kernels of ours can compile and run on it (NVRTC and the
    driver found), else None. Cached: ops ask at every call."""
    if not torch.cuda.is_available() or torch.version.hip or _nvrtc() is None or _driver() is None:
        return None
    return torch.cuda.get_device_capability(device_index)


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else result}")


HEADERS = ("tiles.cuh",)
"""kernels/ headers every source may include by name."""


@functools.lru_cache(maxsize=1)
def _headers() -> tuple[list[bytes], list[bytes]]:
    here = os.path.dirname(__file__)
    return [open(os.path.join(here, h), "rb").read() for h in HEADERS], [h.encode() for h in HEADERS]


def _compile(source: str, name: str, options: list[str]) -> tuple[bytes, str]:
    """(cubin, NVRTC's log) of `source`."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        raise RuntimeError("NVRTC (libnvrtc) was not found")
    prog = ctypes.c_void_p()
    texts, names = _headers()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), len(texts),
                                (ctypes.c_char_p * len(texts))(*texts), (ctypes.c_char_p * len(names))(*names)):
        raise RuntimeError(f"NVRTC could not create the program of {name}")
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        failed = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        if failed:
            raise RuntimeError(f"NVRTC could not compile {name}:\n{log.value.decode()}")
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        binary = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(prog, binary)
        return binary.raw, log.value.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _options(arch: str, defines: dict) -> list[str]:
    """fp32 denormals flushed to zero and approximate division (Triton's exp and division are approximate too):
    without them each exp() takes two more multiplies and a test for a denormal result and each division a slow path
    (a sixth of prep.cu's instructions). What they change lies below 2^-126 or within 2 ulp of a quotient."""
    return [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", "--ftz=true", "--prec-div=false"] + [
        f"-D{k}={v}" for k, v in defines.items()]


def resources(source: str, name: str, arch: str = "sm_90", defines: dict | None = None) -> dict:
    """Registers and spilled bytes a thread of kernel `name` takes when built for `arch`, from ptxas's report: no
    GPU needed, only NVRTC (the tests check the kernels' builds for an H100 on CPU machines)."""
    import re

    _, log = _compile(source, name, _options(arch, defines or {}) + ["--ptxas-options=-v"])
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if registers is None:
        raise RuntimeError(f"no register count in ptxas's report for {name}:\n{log}")
    return {"registers": int(registers.group(1)), "spilled_bytes": max(spills, default=0)}


class Kernel:
    """A compiled kernel, loaded into one device's context."""

    def __init__(self, cubin: bytes, name: str, device: torch.device):
        self.name, self.device = name, device
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        cuda = _driver()
        with torch.cuda.device(device):
            torch.cuda.synchronize()   # the module loads into the current context: makes PyTorch's current here
            _check_driver(cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), f"loading {name}")
            _check_driver(cuda.cuModuleGetFunction(ctypes.byref(self.function), self.module, name.encode()),
                          f"finding {name}")
        self.shared_limit = 48 * 1024

    def attribute(self, which: int) -> int:
        value = ctypes.c_int()
        _check_driver(_driver().cuFuncGetAttribute(ctypes.byref(value), which, self.function), "cuFuncGetAttribute")
        return value.value

    @property
    def registers(self) -> int:
        return self.attribute(4)      # CU_FUNC_ATTRIBUTE_NUM_REGS

    @property
    def spilled_bytes(self) -> int:
        return self.attribute(3)      # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: local memory a thread (spills)

    def launch(self, grid: tuple[int, int, int], threads: int, shared_bytes: int, *args) -> None:
        """args: tensors (their device pointers; None for a null pointer) or (type, value) pairs, type "i32" or
        "f32"."""
        cuda = _driver()
        if shared_bytes > self.shared_limit:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: above 48 KiB a kernel must opt in
            _check_driver(cuda.cuFuncSetAttribute(self.function, 8, shared_bytes), f"{self.name}'s shared memory")
            self.shared_limit = shared_bytes
        values = []
        for arg in args:
            if arg is None:
                values.append(ctypes.c_void_p(0))
            elif isinstance(arg, torch.Tensor):
                values.append(ctypes.c_void_p(arg.data_ptr()))
            else:
                kind, value = arg
                values.append(ctypes.c_int(value) if kind == "i32" else ctypes.c_float(value))
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in values))
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        _check_driver(cuda.cuLaunchKernel(self.function, *grid, threads, 1, 1, shared_bytes, stream, pointers, None),
                      f"launching {self.name}")


@functools.lru_cache(maxsize=None)
def _compiled(source: str, name: str, defines: tuple, device_index: int) -> Kernel:
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin, _ = _compile(source, name, _options(f"sm_{major}{minor}", dict(defines)))
    return Kernel(cubin, name, torch.device("cuda", device_index))


def compile_kernel(source: str, name: str, device: torch.device, defines: dict | None = None) -> Kernel:
    """The kernel `name` (extern "C") of `source` built with `defines` (-D) for `device`, compiled once per
    process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compiled(source, name, tuple(sorted((defines or {}).items())), index)
