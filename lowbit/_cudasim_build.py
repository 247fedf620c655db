"""cudasim's g++ build cache: compile a C++ source into a shared library, once per content.

``lowbit/_cudasim.py`` (the launcher: trampolines, ``SimModule``, ``SimKernel``) hands this module
the full source of a module, trampolines included; ``prepare`` fixes the compiler command and the
cache key, ``load_or_build`` returns the loaded library. The emulation header is
``cuda/cudasim.cuh``, which includes its parts ``cuda/cudasim_*.cuh`` from its own folder; tests:
``tests/test_cudasim_runtime.py`` (section "Build cache").

How a library is built:

* The source is compiled with ``$CXX`` (default ``g++``) as
  ``-std=c++20 -O1 -fPIC -shared -pthread`` plus ``-include cudasim.cuh -DLOWBIT_CUDASIM=1``,
  ``-fno-strict-aliasing`` (CUDA code type-puns through pointers), ``-ffp-contract=off``
  and hidden visibility. ``cudasim.cuh`` is looked up in ``include_dirs`` first, then in the
  ``cuda/`` folder of a checkout or the installed ``lowbit._cuda_src``; its parts are the
  ``cudasim_*.cuh`` beside it.

Build cache: libraries live in a private per-user folder, ``$LOWBIT_CACHE_DIR/cudasim``, else
``$XDG_CACHE_HOME/lowbit/cudasim``, else ``~/.cache/lowbit/cudasim``. The folder is created
with mode 0700 and checked before every use: if it is a symlink, not owned by the current user
or writable by group or others, it is not used (a ``RuntimeWarning`` is issued and a fresh
private temporary folder serves this process), so nobody else can plant a library there. A
library's name is the sha256 of everything that can change it: the full source with the
trampolines, every header under ``include_dirs``, the emulation header and every part beside it
(whether or not its folder is among ``include_dirs``), the compiler command and its
``--version``. The builder compiles in a temporary folder inside the cache, loads its own
copy, then moves it into place with ``os.replace`` and records the library's own sha256 in
``<key>.sha256`` (also written to a temporary name and replaced), so concurrent builders, in
threads or processes, never see partial files and all succeed. A cached library is loaded only
when its bytes hash to the recorded digest; a corrupted or altered one is rebuilt.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HEADER_NAME = "cudasim.cuh"
#: The parts the header includes by quoted name from its own folder.
HEADER_PARTS = "cudasim_*.cuh"
CXX_FLAGS = (
    "-std=c++20",
    "-O1",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-DLOWBIT_CUDASIM=1",
)
#: Suffixes of the files under an include dir whose contents enter the cache key.
HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".hh", ".inc", ".inl")

#: Number of g++ runs in this process; tests read it to tell a cache hit from a build.
build_count = 0

_lock = threading.Lock()
_private_tmp_cache: Path | None = None


# ------------------------------------------------------------------------------------------
# Availability
# ------------------------------------------------------------------------------------------

def _compiler() -> list[str] | None:
    cxx = shlex.split(os.environ.get("CXX", "") or "g++")
    if not cxx or shutil.which(cxx[0]) is None:
        return None
    return cxx


def available() -> bool:
    """Whether a C++ compiler for cudasim (``$CXX`` or ``g++``) is on PATH."""
    return _compiler() is not None


def unavailable_reason() -> str:
    """Why cudasim cannot run here, and how to fix it ("" when it can)."""
    if available():
        return ""
    cxx = os.environ.get("CXX")
    if cxx:
        return f"cudasim needs the C++ compiler $CXX={cxx!r}, which is not on PATH"
    return "cudasim needs g++ (e.g. apt-get install g++), or set $CXX to a C++20 compiler"


_version_cache: dict[tuple[str, ...], str] = {}


def _compiler_version(cxx: list[str]) -> str:
    key = tuple(cxx)
    if key not in _version_cache:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=False)
        _version_cache[key] = f"{shutil.which(cxx[0])}\n{out.stdout}"
    return _version_cache[key]


# ------------------------------------------------------------------------------------------
# Cache folder
# ------------------------------------------------------------------------------------------

def _default_cache_dir() -> Path:
    root = os.environ.get("LOWBIT_CACHE_DIR")
    if root:
        return Path(root) / "cudasim"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "lowbit" / "cudasim"


def _insecure_reason(path: Path) -> str | None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cache_dir() -> Path:
    """The verified private folder that holds built libraries (created if missing)."""
    global _private_tmp_cache
    path = _default_cache_dir()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        reason = _insecure_reason(path)
    except OSError as exc:
        reason = f"it cannot be created ({exc})"
    if reason is None:
        return path
    with _lock:
        if _private_tmp_cache is None:
            _private_tmp_cache = Path(tempfile.mkdtemp(prefix="lowbit-cudasim-"))
        fallback = _private_tmp_cache
    warnings.warn(
        f"cudasim does not use the cache folder {path}: {reason}; building in the private "
        f"temporary folder {fallback} instead",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


# ------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------

def _find_header(include_dirs: Sequence[str]) -> Path:
    here = Path(__file__).resolve().parent
    candidates = [Path(d) / HEADER_NAME for d in include_dirs]
    candidates += [here / "_cuda_src" / HEADER_NAME, here.parent / "cuda" / HEADER_NAME]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(
        f"cudasim emulation header {HEADER_NAME} not found in {list(include_dirs)} nor beside "
        "the lowbit package"
    )


def _hash_header(h, header: Path) -> None:
    h.update(header.read_bytes())
    # The parts live beside the header, so they enter the key even when no include dir holds
    # them (a module of test kernels outside cuda/ builds with the packaged header).
    for part in sorted(header.parent.glob(HEADER_PARTS)):
        h.update(f"\0part {part.name}\0".encode())
        h.update(part.read_bytes())


def _hash_include_dirs(h, include_dirs: Sequence[str]) -> None:
    for d in include_dirs:
        root = Path(d)
        h.update(f"\0dir {root.resolve()}\0".encode())
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(x for x in dirnames if not x.startswith((".", "__pycache__")))
            for fn in sorted(filenames):
                if fn.endswith(HEADER_SUFFIXES):
                    p = Path(dirpath) / fn
                    h.update(f"\0file {p.relative_to(root)}\0".encode())
                    h.update(p.read_bytes())


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _compile(cxx: list[str], cmd_flags: list[str], source: str, directory: Path,
             out_name: str) -> Path:
    """Compile ``source`` in ``directory`` (relative names keep the library reproducible)."""
    global build_count
    (directory / "kernel.cpp").write_text(source)
    cmd = [*cxx, *cmd_flags, "kernel.cpp", "-o", out_name]
    with _lock:
        build_count += 1
    proc = subprocess.run(cmd, cwd=directory, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log = proc.stderr.strip() or proc.stdout.strip()
        raise RuntimeError(
            f"cudasim: compiling the kernel source failed ({shlex.join(cmd)}):\n{log}"
        )
    return directory / out_name


@dataclass(frozen=True)
class Build:
    """One library to load or build: its cache key and everything that makes it."""

    key: str
    cxx: tuple[str, ...]
    flags: tuple[str, ...]
    source: str


def prepare(source: str, include_dirs: Sequence[str]) -> Build:
    """The compiler command and the content-hashed cache key of ``source``.

    Args:
        source: the complete C++ text to compile (kernels and trampolines).
        include_dirs: folders passed to g++ with ``-I``; every header below them (by suffix,
            recursively) enters the key.

    Raises:
        RuntimeError: no C++ compiler (``unavailable_reason()``).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(unavailable_reason())
    include_dirs = [str(d) for d in include_dirs]
    header = _find_header(include_dirs)
    flags = [*CXX_FLAGS, "-include", str(header)]
    for d in include_dirs:
        flags.append(f"-I{Path(d).resolve()}")

    h = hashlib.sha256()
    for part in (source, "\0".join(flags), "\0".join(cxx), _compiler_version(cxx)):
        h.update(part.encode())
        h.update(b"\0\0")
    _hash_header(h, header)
    _hash_include_dirs(h, include_dirs)
    return Build(h.hexdigest(), tuple(cxx), tuple(flags), source)


def load_or_build(build: Build) -> ctypes.CDLL:
    """Load the cached library of ``build`` if its digest checks out, else compile it.

    Raises:
        RuntimeError: the source does not compile (g++'s messages are included).
    """
    directory = cache_dir()
    lib_path = directory / f"{build.key}.so"
    digest_path = directory / f"{build.key}.sha256"
    try:
        recorded = digest_path.read_text().strip()
        if lib_path.is_file() and _file_sha256(lib_path) == recorded:
            return ctypes.CDLL(str(lib_path))
    except (OSError, UnicodeDecodeError):
        pass
    with tempfile.TemporaryDirectory(prefix=".build-", dir=directory) as tmp:
        built = _compile(list(build.cxx), list(build.flags), build.source, Path(tmp),
                         "module.so")
        digest = _file_sha256(built)
        # Load our own copy before publishing it: a concurrent builder may replace the cached
        # file, and the mapping of the inode we loaded stays valid after a rename.
        lib = ctypes.CDLL(str(built))
        os.replace(built, lib_path)
        _write_atomic(digest_path, (digest + "\n").encode())
    return lib
