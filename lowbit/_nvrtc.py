"""Compile checks of lowbit's CUDA kernels with NVRTC, without a GPU.

``compile_check(code, name_expressions, include_dirs, arch)`` compiles a ``cuda/*.cu`` source
with the options ``lowbit/_kernels.py`` compiles it with on a GPU (``NVRTC_OPTIONS``), down to a
cubin for one architecture, and reports each kernel's registers, spills and static shared memory
from the ptxas log; ``compile_ptx`` returns the PTX of the same compile. Tests:
``tests/test_nvrtc.py`` (and the per-op tests that compile every launcher's instantiations).
The CPU twin of the same sources is ``lowbit/_cudasim.py``.

Needs the pip packages ``cuda-bindings`` (``cuda.bindings.nvrtc``) and ``nvidia-cuda-nvrtc``
(the ``test`` extra); ``cuda.bindings`` finds ``libnvrtc.so`` in the ``nvidia`` site-packages
folder through ``cuda.pathfinder``. NVRTC has no CUDA or C++ standard headers on its
include path (not even ``<cstdint>``), so kernels include only lowbit's own headers.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import sys
from collections.abc import Sequence

from ._kernels import NVRTC_OPTIONS

__all__ = ["available", "unavailable_reason", "compile_check", "compile_ptx", "sass",
           "sass_available", "sass_counts", "SUPPORTED_ARCHS"]

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
_INSTALL_HINT = "pip install cuda-bindings nvidia-cuda-nvrtc (the lowbit[test] extra)"


def _preload_libnvrtc() -> None:
    """Load libnvrtc from the nvidia pip packages when cuda.bindings cannot find it alone."""
    for base in sys.path:
        pattern = os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")
        for path in sorted(glob.glob(pattern), reverse=True):
            if "builtins" in os.path.basename(path):
                continue
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def _import_nvrtc():
    from cuda.bindings import nvrtc

    return nvrtc


@functools.lru_cache(maxsize=None)
def _load() -> tuple[object | None, str]:
    try:
        nvrtc = _import_nvrtc()
    except Exception as exc:  # missing package or a broken install: report, do not raise
        return None, f"cuda.bindings.nvrtc cannot be imported ({exc}); {_INSTALL_HINT}"
    for attempt in range(2):
        try:
            err, major, minor = nvrtc.nvrtcVersion()
            if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
                return nvrtc, f"NVRTC {major}.{minor}"
            reason = f"nvrtcVersion failed: {err}"
        except Exception as exc:  # libnvrtc not found by cuda.bindings
            reason = f"libnvrtc cannot be loaded ({exc})"
        if attempt == 0:
            _preload_libnvrtc()
    return None, f"{reason}; {_INSTALL_HINT}"


def available() -> bool:
    """Whether ``cuda.bindings.nvrtc`` imports and libnvrtc loads."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why NVRTC checks cannot run here and how to enable them ("" when they can)."""
    nvrtc, info = _load()
    return "" if nvrtc is not None else info


def version() -> str:
    """``"NVRTC <major>.<minor>"`` of the loaded library."""
    nvrtc, info = _load()
    if nvrtc is None:
        raise RuntimeError(info)
    return info


def _check(nvrtc, result, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what} failed: {result}")


def _program_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(nvrtc, err, "nvrtcGetProgramLogSize")
    buf = bytearray(size)
    (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
    _check(nvrtc, err, "nvrtcGetProgramLog")
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per-function resource usage from a ptxas ``-v`` log, keyed by mangled name.

    Returns:
        ``{name: {"registers", "spill_stores", "spill_loads", "shared", "stack"}}`` for every
        entry function (kernel) in the log; sizes in bytes.
    """
    out: dict[str, dict[str, int]] = {}
    props: dict[str, tuple[int, int, int]] = {}
    current_entry = None
    current_props = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current_entry = m.group(1)
            out[current_entry] = {"registers": 0, "spill_stores": 0, "spill_loads": 0,
                                  "shared": 0, "stack": 0}
            continue
        m = _PROPS.search(line)
        if m:
            current_props = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and current_props is not None:
            props[current_props] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            continue
        m = _USED.search(line)
        if m and current_entry is not None:
            info = out[current_entry]
            info["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            info["shared"] = int(s.group(1)) if s else 0
    for name, info in out.items():
        stack, stores, loads = props.get(name, (0, 0, 0))
        info.update(stack=stack, spill_stores=stores, spill_loads=loads)
    return out


def compile_check(code: str, name_expressions: Sequence[str], include_dirs: Sequence[str],
                  arch: str, options: Sequence[str] = ()) -> dict[str, dict[str, int]]:
    """Compile ``code`` with NVRTC for ``arch`` and report each kernel's resources.

    The options are ``NVRTC_OPTIONS`` (those of a GPU load), ``-I<dir>`` per include dir,
    ``--gpu-architecture=<arch>`` (a real architecture, so ptxas runs and the result is a cubin)
    and ``--ptxas-options=-v`` (ptxas's register and spill report lands in the program log).

    Args:
        code: full .cu source text.
        name_expressions: kernels to instantiate and report, as for ``cupy.RawModule``
            (``"pack_bits<2>"`` or a plain kernel name).
        include_dirs: folders searched by ``#include "..."``.
        arch: ``"sm_80"``, ``"sm_90"``, ... (see ``SUPPORTED_ARCHS``).
        options: extra NVRTC options (e.g. ``-DNAME=1``).

    Returns:
        ``{name_expression: {"registers", "spill_stores", "spill_loads", "shared", "stack"}}``:
        registers per thread, spill bytes, static shared memory bytes and stack frame bytes
        (local arrays that ptxas could not keep in registers land there).

    Raises:
        RuntimeError: NVRTC is unavailable, or the source does not compile (the message holds
            NVRTC's full log), or a name expression is missing from ptxas's report.
    """
    log, lowered, _, _ = _compile_cached(code, name_expressions, include_dirs, arch, options)
    usage = parse_ptxas_log(log)
    report = {}
    for n, mangled in lowered.items():
        if mangled not in usage:
            raise RuntimeError(
                f"kernel {n!r} ({mangled}) is missing from the ptxas report for {arch}:\n{log}"
            )
        report[n] = usage[mangled]
    return report


def compile_ptx(code: str, name_expressions: Sequence[str], include_dirs: Sequence[str],
                arch: str, options: Sequence[str] = ()) -> str:
    """The PTX of ``code`` compiled as ``compile_check`` does (``options`` come last, so they
    override ``NVRTC_OPTIONS``, as NVRTC's last option wins)."""
    return _compile_cached(code, name_expressions, include_dirs, arch, options)[2]


def _compile_cached(code, name_expressions, include_dirs, arch, options):
    if isinstance(name_expressions, str):
        raise TypeError("name_expressions must be a sequence of strings, not one string")
    return _compile(code, tuple(name_expressions), tuple(map(os.fspath, include_dirs)), arch,
                    tuple(options))


@functools.lru_cache(maxsize=64)
def _compile(code, name_expressions, include_dirs, arch, options) -> tuple[str, dict, str, bytes]:
    """(program log, lowered names, PTX, cubin) of one NVRTC compile; the same compile of a source is
    asked for its resources and its PTX, so it is kept."""
    nvrtc, info = _load()
    if nvrtc is None:
        raise RuntimeError(info)
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch must look like 'sm_80', got {arch!r}")
    names = list(name_expressions)
    opts = [*NVRTC_OPTIONS, *(f"-I{d}" for d in include_dirs), f"--gpu-architecture={arch}",
            "--ptxas-options=-v", *options]

    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), b"kernel.cu", 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        for n in names:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, n.encode())
            _check(nvrtc, err, f"nvrtcAddNameExpression({n!r})")
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = _program_log(nvrtc, prog)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(
                f"NVRTC compile for {arch} failed ({result.name}); options {opts}:\n{log}"
            )
        lowered = {}
        for n in names:
            err, mangled = nvrtc.nvrtcGetLoweredName(prog, n.encode())
            _check(nvrtc, err, f"nvrtcGetLoweredName({n!r})")
            lowered[n] = mangled.decode() if isinstance(mangled, bytes) else str(mangled)
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(nvrtc, err, "nvrtcGetPTXSize")
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetPTX(prog, buf)
        _check(nvrtc, err, "nvrtcGetPTX")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(nvrtc, err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return log, lowered, bytes(buf).rstrip(b"\0").decode(errors="replace"), bytes(cubin)


def _cuobjdump() -> str | None:
    """The ``cuobjdump`` of the ``nvidia-cuda-cuobjdump`` wheel (or one on PATH), or None."""
    import shutil

    for base in sys.path:
        for path in sorted(glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump"))):
            if os.access(path, os.X_OK):
                return path
    return shutil.which("cuobjdump")


def sass_available() -> bool:
    """Whether NVRTC loads and a ``cuobjdump`` (pip ``nvidia-cuda-cuobjdump``) is found."""
    return available() and _cuobjdump() is not None


_SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)


def sass(code: str, name_expressions: Sequence[str], include_dirs: Sequence[str], arch: str,
         options: Sequence[str] = ()) -> dict[str, str]:
    """The SASS of each kernel of ``code`` compiled as ``compile_check`` does.

    The cubin comes from the same NVRTC compile (``nvrtcGetCUBIN``); ``cuobjdump -sass``
    disassembles it (no GPU needed). Returns ``{name_expression: sass text}``.

    Raises:
        RuntimeError: NVRTC or cuobjdump is unavailable, or a kernel is missing from the dump.
    """
    import subprocess
    import tempfile

    tool = _cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found; pip install nvidia-cuda-cuobjdump "
                           "nvidia-cuda-nvdisasm (the lowbit[test] extra)")
    _, lowered, _, cubin = _compile_cached(code, name_expressions, include_dirs, arch, options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
        text = subprocess.run([tool, "-sass", path], check=True, capture_output=True,
                              text=True, env=env).stdout
    marks = list(_SASS_FUNCTION.finditer(text))
    bodies = {m.group(1): text[m.end():(marks[i + 1].start() if i + 1 < len(marks) else None)]
              for i, m in enumerate(marks)}
    out = {}
    for n, mangled in lowered.items():
        if mangled not in bodies:
            raise RuntimeError(f"kernel {n!r} ({mangled}) is missing from the SASS of {arch}")
        out[n] = bodies[mangled]
    return out


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_counts(text: str, opcodes: Sequence[str] = ("IMMA", "HMMA", "LDSM", "LDGSTS", "IDP",
                                                      "FFMA", "DFMA", "SHFL", "LDL", "STL",
                                                      "LDG", "LDS", "BAR")) -> dict[str, int]:
    """Static count of each SASS opcode (the mnemonic before its first ``.``) in ``text``.

    Instructions predicated on ``!PT`` (never true: ptxas's placeholders beside asynchronous
    copies) are not counted."""
    counts = dict.fromkeys(opcodes, 0)
    for m in _OPCODE.finditer(text):
        if m.group(2) in counts and (m.group(1) or "").strip() != "@!PT":
            counts[m.group(2)] += 1
    return counts
