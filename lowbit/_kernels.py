"""Load ``cuda/<op>.cu`` (NVRTC on a GPU, the cudasim host module on a CPU) and check launches.

The launchers in ``lowbit/ops/<op>/_cuda.py`` declare ``SOURCE`` (the .cu file name) and
``NAME_EXPRESSIONS`` (every template instantiation they launch) and call
``module(SOURCE, NAME_EXPRESSIONS, like=array)``; the module object answers
``get_function(name)(grid, block, args, shared_mem=...)`` the same way on both backends.
``grid`` and ``dynamic_shared`` hold every launch inside the hardware's limits, and
``host_copy`` / ``device_copy`` / ``read_status`` are the only ways the launchers move data
between host and device (``tests/test_transfers.py`` counts them). ``tests/test_nvrtc.py``
compiles the same (source, expressions) pairs for sm_80 and sm_90 with ``NVRTC_OPTIONS``.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from . import _backend

#: NVRTC options for every kernel (the include directory and the architecture are added at
#: load time). The bitwise agreement with cudasim (g++ without fast math, ``-ffp-contract=off``)
#: needs IEEE subnormals, divisions and square roots and no contraction into FMAs; they are
#: spelled out because CuPy's own compile path appends ``-ftz=true``, and NVRTC's last option
#: wins, so lowbit compiles through NVRTC itself (``_compile_cubin``).
NVRTC_OPTIONS = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-fmad=false")
#: CUDA's limits on a grid: gridDim.x up to 2**31 - 1, gridDim.y and gridDim.z up to 65535.
MAX_GRID = (2**31 - 1, 65535, 65535)
#: Dynamic shared memory a kernel may use before ``max_dynamic_shared_size_bytes`` is raised.
DEFAULT_SHARED_BYTES = 48 * 1024


def cuda_dir() -> Path:
    """Directory holding the .cu/.cuh sources (inside the wheel, or cuda/ of a checkout)."""
    here = Path(__file__).resolve().parent
    packaged = here / "_cuda_src"
    return packaged if packaged.is_dir() else here.parent / "cuda"


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of ``cuda/<name>`` with a digest of every header folded in.

    Compiled modules are cached on disk keyed by the source text; an edit to an included header
    would otherwise reuse a stale kernel.
    """
    directory = cuda_dir()
    text = (directory / name).read_text()
    digest = hashlib.sha256()
    for header in sorted(directory.glob("*.cuh")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    return f"// lowbit headers sha256 {digest.hexdigest()}\n{text}"


#: Loaded modules per (source, expressions, backend/device).
_modules: dict = {}


def module(source_name: str, name_expressions: tuple[str, ...], like):
    """Return the compiled module for ``cuda/<source_name>`` on the backend of ``like``.

    Args:
        source_name: file name under ``cuda/``, e.g. ``"pack_bits.cu"``.
        name_expressions: every instantiation that will be launched, e.g. ``("pack_bits<2>",)``.
        like: an array; cupy arrays give the module for the current device, numpy arrays the
            cudasim host module.
    """
    name_expressions = tuple(name_expressions)
    if _backend.is_cupy_array(like):
        cp = _backend.cupy_module()
        key = (source_name, name_expressions, "cuda", cp.cuda.Device().id)
        mod = _modules.get(key)
        if mod is None:
            mod = _cupy_module(cp, source(source_name), name_expressions)
            _modules[key] = mod
        return mod
    from . import _cudasim

    # Cached here too: _cudasim's own lookup hashes the source and headers on every call.
    key = (source_name, name_expressions, "cudasim")
    mod = _modules.get(key)
    if mod is None:
        mod = _cudasim.load_module(source(source_name), name_expressions, [str(cuda_dir())])
        _modules[key] = mod
    return mod


class _CubinModule:
    """A cubin loaded by ``cupy.RawModule``, answering ``get_function`` by name expression."""

    def __init__(self, raw, lowered: dict):
        self._raw, self._lowered, self._kernels = raw, lowered, {}

    def get_function(self, name_expression: str):
        kernel = self._kernels.get(name_expression)
        if kernel is None:
            kernel = self._raw.get_function(self._lowered[name_expression])
            self._kernels[name_expression] = kernel
        return kernel


def _cupy_module(cp, code: str, name_expressions: tuple[str, ...]):
    options = NVRTC_OPTIONS + (f"-I{cuda_dir()}",)
    try:
        nvrtc = _cupy_nvrtc()
    except ImportError as exc:  # a CuPy without its NVRTC binding: keep working, say what differs
        warnings.warn(f"lowbit compiles through cupy.RawModule ({exc}); CuPy appends -ftz=true, "
                      "so subnormals flush to zero on this GPU", RuntimeWarning, stacklevel=3)
        return cp.RawModule(code=code, options=options, name_expressions=name_expressions)
    arch = f"sm_{cp.cuda.Device().compute_capability}"
    cubin, lowered = _compile_cubin(nvrtc, code, name_expressions, options, arch)
    return _CubinModule(cp.RawModule(path=str(cubin)), lowered)


def _cupy_nvrtc():
    """CuPy's thin NVRTC binding (createProgram, compileProgram, getCUBIN, getLoweredName)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        from cupy.cuda import nvrtc
    return nvrtc


def compiler() -> str:
    """How cupy modules are compiled here: ``"nvrtc"`` (lowbit's options hold) or
    ``"cupy.RawModule"`` (CuPy's appended ``-ftz=true`` wins); recorded by ``bench.gpu``."""
    try:
        _cupy_nvrtc()
    except ImportError:
        return "cupy.RawModule"
    return "nvrtc"


def _compile_cubin(nvrtc, code, name_expressions, options, arch) -> tuple[Path, dict]:
    """Compile with NVRTC into the disk cache (next to CuPy's); return the cubin and the lowered
    names. The key covers everything that changes the binary; files are replaced atomically, so
    the processes of ``python -m bench.gpu`` share one compile."""
    options = (*options, f"--gpu-architecture={arch}")
    key = hashlib.sha256(json.dumps([code, name_expressions, options,
                                     list(nvrtc.getVersion())]).encode()).hexdigest()
    base = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    folder = base / "lowbit"
    cubin, names = folder / f"{key}.cubin", folder / f"{key}.json"
    if cubin.exists() and names.exists():
        return cubin, json.loads(names.read_text())
    prog = nvrtc.createProgram(code, "lowbit.cu", (), ())
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed ({exc}); options {options}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
        binary = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    folder.mkdir(parents=True, exist_ok=True)
    for path, data in ((names, json.dumps(lowered).encode()), (cubin, binary)):
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)
    return cubin, lowered


#: C++ type name of each floating dtype, for template name expressions.
CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def grid(x: int, y: int = 1, z: int = 1, *, what: str) -> tuple[int, int, int]:
    """A launch grid inside CUDA's limits (``MAX_GRID``); ValueError naming ``what`` otherwise.

    Launchers loop inside the kernel over whatever could pass a limit (rows, tokens); what is
    left here are sizes such as batch or head counts, refused with a clear message.
    """
    dims = (int(x), int(y), int(z))
    for axis, (d, limit) in enumerate(zip(dims, MAX_GRID)):
        if not 1 <= d <= limit:
            raise ValueError(f"{what} needs gridDim.{'xyz'[axis]} = {d}, outside CUDA's "
                             f"[1, {limit}]; use smaller sizes or the numba backend")
    return dims


@functools.lru_cache(maxsize=None)
def _shared_limit(device_id: int | None) -> int:
    """Largest dynamic + static shared memory one block may opt into on the device."""
    if device_id is None:
        from . import _cudasim

        return _cudasim.MAX_DYNAMIC_SHARED_OPT_IN
    cp = _backend.cupy_module()
    return int(cp.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


def dynamic_shared(kernel, nbytes: int, like, what: str) -> int:
    """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory; return ``nbytes``.

    Above ``DEFAULT_SHARED_BYTES`` the kernel's ``max_dynamic_shared_size_bytes`` is raised (the
    opt-in every GPU since Volta requires); past the device's opt-in limit, less the kernel's
    static shared memory, ValueError naming ``what`` is raised before anything runs.
    """
    nbytes = int(nbytes)
    device = _backend.cupy_module().cuda.Device().id if _backend.is_cupy_array(like) else None
    limit = _shared_limit(device) - int(getattr(kernel, "shared_size_bytes", 0))
    if nbytes > limit:
        raise ValueError(f"{what} needs {nbytes} bytes of shared memory per block, more than the "
                         f"{limit} this device allows; use a smaller size or the numba backend")
    if nbytes > DEFAULT_SHARED_BYTES and kernel.max_dynamic_shared_size_bytes < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
    return nbytes


def host_copy(a) -> np.ndarray:
    """Device -> host copy of a small array the host needs (a size, a table): one transfer."""
    return a.get() if _backend.is_cupy_array(a) else np.array(a)


def device_copy(a, like):
    """Host -> device copy of ``a`` onto the array module of ``like``: one transfer."""
    return _backend.array_module(like).asarray(a)


#: Host tables kept on each device by content (segment tables repeat call after call).
CONSTANT_CACHE_ENTRIES = 256
_constants: collections.OrderedDict = collections.OrderedDict()


def device_constant(host: np.ndarray, like):
    """A read-only device copy of the small host table ``host``, uploaded once per device and
    content (least recently used entries are dropped past ``CONSTANT_CACHE_ENTRIES``)."""
    host = np.ascontiguousarray(host)
    device = _backend.cupy_module().cuda.Device().id if _backend.is_cupy_array(like) else None
    key = (device, host.dtype.str, host.shape, host.tobytes())
    table = _constants.get(key)
    if table is None:
        table = device_copy(host, like)
        _constants[key] = table
        if len(_constants) > CONSTANT_CACHE_ENTRIES:
            _constants.popitem(last=False)
    else:
        _constants.move_to_end(key)
    return table


def read_status(status) -> int:
    """The one read an op makes at its end: a kernel's status word, as a host integer."""
    return int(host_copy(status).reshape(-1)[0]) if status.size else 0
