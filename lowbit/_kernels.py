"""Load ``cuda/<op>.cu``: cupy.RawModule on a GPU, the cudasim host module on a CPU.

The launchers in ``lowbit/ops/<op>/_cuda.py`` declare ``SOURCE`` (the .cu file name) and
``NAME_EXPRESSIONS`` (every template instantiation they launch) and call
``module(SOURCE, NAME_EXPRESSIONS, like=array)``; the module object answers
``get_function(name)(grid, block, args, shared_mem=...)`` the same way on both backends.
``tests/test_nvrtc.py`` compiles the same (source, expressions) pairs for sm_80 and sm_90.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from . import _backend

#: NVRTC options for every kernel; the include directory is appended at load time.
NVRTC_OPTIONS = ("-std=c++17",)


def cuda_dir() -> Path:
    """Directory holding the .cu/.cuh sources (inside the wheel, or cuda/ of a checkout)."""
    here = Path(__file__).resolve().parent
    packaged = here / "_cuda_src"
    return packaged if packaged.is_dir() else here.parent / "cuda"


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of ``cuda/<name>`` with a digest of every header folded in.

    CuPy caches compiled modules on disk keyed by the source text only; an edit to an included
    header would otherwise reuse a stale kernel.
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
        like: an array; cupy arrays give a cupy.RawModule for the current device, numpy arrays
            the cudasim host module.
    """
    name_expressions = tuple(name_expressions)
    if _backend.is_cupy_array(like):
        cp = _backend.cupy_module()
        key = (source_name, name_expressions, "cuda", cp.cuda.Device().id)
        mod = _modules.get(key)
        if mod is None:
            mod = cp.RawModule(
                code=source(source_name),
                options=NVRTC_OPTIONS + (f"-I{cuda_dir()}",),
                name_expressions=name_expressions,
            )
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


#: C++ type name of each floating dtype, for template name expressions.
CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
#: Dynamic shared memory a block may use without an opt-in attribute on every CUDA GPU.
MAX_SHARED_BYTES = 48 * 1024


def check_shared(nbytes: int, what: str) -> int:
    """Raise ValueError if a block would need more than ``MAX_SHARED_BYTES``; return ``nbytes``."""
    if nbytes > MAX_SHARED_BYTES:
        raise ValueError(f"{what} needs {nbytes} bytes of shared memory per block, more than the "
                         f"{MAX_SHARED_BYTES} the CUDA kernel may use; use a smaller size or "
                         "the numba backend")
    return nbytes
