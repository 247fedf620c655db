"""lowbit's own checkpoints: ``save`` / ``load`` in the safetensors file format, NumPy only.

Siblings: ``_files.py`` (atomic replacement), ``hf_bitnet.py`` (reads Hugging Face checkpoints
through ``read_file``), ``gguf.py``; tests ``tests/test_io_safetensors.py``, where the
``safetensors`` package is the oracle (files written here load there and the other way round).

The format (safetensors' published spec): an 8-byte little-endian header length ``n``, ``n``
bytes of UTF-8 JSON (padded with spaces so the data starts 8-byte aligned) mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows
the header) and an optional ``"__metadata__"`` map of strings, then the raw little-endian bytes.
The tensors tile the data exactly: no gaps, no overlaps, nothing after the last one.

A ``PackedWeight`` ``name`` is stored as two tensors, ``name`` (its packed codes) and
``name + SCALE_SUFFIX`` (its float32 scale), and the ``"lowbit"`` metadata entry (JSON) records
the container version and each packed weight's format and shape.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any, Literal, overload

import numpy as np

from .. import _backend
from ..ops.quantize import PackedWeight, checked_packed
from .._typing import Array
from ._files import StrPath, atomic_path

#: Version of the ``"lowbit"`` metadata entry this module writes.
FORMAT_VERSION = 1
#: Metadata key of lowbit's own entry (reserved: user metadata may not use it).
LOWBIT_KEY = "lowbit"
#: Suffix of the tensor that holds a packed weight's scale.
SCALE_SUFFIX = ":scale"
#: safetensors dtype names and their numpy dtypes (little-endian). BF16 is read-only here.
DTYPES = {"BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "F16": "<f2",
          "U32": "<u4", "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "F64": "<f8"}
_CODE = {np.dtype(v): k for k, v in DTYPES.items()}
#: The largest header accepted (the safetensors package's own limit).
MAX_HEADER = 100_000_000
_ALIGN = 8


def _write_array(f: IO[bytes], arr: np.ndarray) -> None:
    f.write(arr.reshape(-1).view(np.uint8).data)


def write_file(path: StrPath, arrays: dict[str, np.ndarray],
               metadata: dict[str, str] | None = None) -> None:
    """Write host arrays to a safetensors file, atomically.

    Args:
        path: destination; replaced only once the new file is complete and fsynced.
        arrays: name -> numpy array of a dtype in ``DTYPES`` (any layout and byte order).
        metadata: str -> str, stored as ``"__metadata__"``.

    Raises:
        TypeError / ValueError: a name, an array or a metadata entry that cannot be stored.
    """
    ordered: list[tuple[str, str, np.ndarray]] = []
    for name, arr in arrays.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensors: a name must be a non-empty string other than "
                             f"'__metadata__', got {name!r}")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"tensors[{name!r}] must be a numpy array, got {type(arr).__name__}")
        code = _CODE.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if code is None:
            raise ValueError(f"tensors[{name!r}] has dtype {arr.dtype}, which safetensors cannot "
                             f"hold here; use one of {sorted(DTYPES)}")
        ordered.append((name, code, arr.astype(DTYPES[code], order="C", copy=False)))
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise TypeError(f"metadata must map strings to strings, got {k!r}: {v!r}")
    # Widest items first keeps every tensor aligned to its item size (the data starts aligned).
    ordered.sort(key=lambda t: (-t[2].dtype.itemsize, t[0]))
    header: dict[str, Any] = {}
    offset = 0
    if meta:
        header["__metadata__"] = meta
    for name, code, arr in ordered:
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    with atomic_path(path, ".safetensors") as tmp:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for _, _, arr in ordered:
                _write_array(f, arr)


def _bad(path: StrPath, what: str) -> ValueError:
    return ValueError(f"path {os.fspath(path)!r}: not a valid safetensors file: {what}")


def _parse_header(path: StrPath, raw: bytes, size: int
                  ) -> tuple[list[tuple[int, str, str, tuple[int, ...]]], dict[str, str]]:
    """The header's entries, checked against the data size; returns ``(entries, metadata)`` with
    entries ``(begin, name, dtype code, shape)`` in file order."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise _bad(path, "__metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
            raise _bad(path, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
        code, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if code != "BF16" and code not in DTYPES:
            raise _bad(path, f"tensor {name!r} has unknown dtype {code!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise _bad(path, f"tensor {name!r} has data_offsets {offs!r}, not [begin, end]")
        itemsize = 2 if code == "BF16" else np.dtype(DTYPES[code]).itemsize
        want = int(np.prod(shape, dtype=np.int64)) * itemsize
        if offs[1] - offs[0] != want:
            raise _bad(path, f"tensor {name!r}: data_offsets {offs} hold {offs[1] - offs[0]} "
                             f"bytes, but {code} of shape {tuple(shape)} takes {want}")
        entries.append((offs[0], offs[1], name, code, tuple(shape)))
    entries.sort()
    end = 0
    for begin, stop, name, _, _ in entries:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else "leaves a gap before it"
            raise _bad(path, f"tensor {name!r} starts at {begin}: it {what} (ending at {end})")
        end = stop
    if end != size:
        raise _bad(path, f"the tensors cover {end} bytes of data, but the file holds {size} "
                         "(truncated or trailing bytes)")
    return [(b, n, c, s) for b, _, n, c, s in entries], meta


def read_raw(path: StrPath) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """Read a safetensors file into host arrays, keeping each tensor's stored dtype.

    Returns:
        ``(tensors, metadata)``: name -> ``(dtype code, array)`` (the code as the header writes
        it, e.g. "F32", "BF16"; the array owned and writable, native byte order; a BF16 tensor
        is its uint16 bit patterns), and the ``"__metadata__"`` map (empty if absent).

    Raises:
        ValueError: as ``read_file``.
    """
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, f"{total} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, total - 8):
            raise _bad(path, f"header length {n} exceeds the file ({total} bytes) or the limit")
        entries, meta = _parse_header(path, f.read(n), total - 8 - n)
        tensors: dict[str, tuple[str, np.ndarray]] = {}
        for _, name, code, shape in entries:
            dtype = np.dtype("<u2" if code == "BF16" else DTYPES[code])
            count = int(np.prod(shape, dtype=np.int64))
            arr = np.fromfile(f, dtype=dtype, count=count) if count else np.empty(0, dtype)
            if arr.size != count:
                raise _bad(path, f"tensor {name!r} is truncated")
            tensors[name] = (code, arr.astype(arr.dtype.newbyteorder("="), copy=False)
                             .reshape(shape))
    return tensors, meta


def read_file(path: StrPath) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file into host arrays.

    Returns:
        ``(arrays, metadata)``: name -> numpy array (owned, writable; BF16 decoded exactly to
        float32; ``read_raw`` keeps the bits), and the ``"__metadata__"`` map (empty if absent).

    Raises:
        ValueError: a header that is not JSON, lies about offsets (overlaps, gaps, out of range),
            or whose dtype and shape disagree with the byte count; a truncated file.
    """
    tensors, meta = read_raw(path)
    arrays: dict[str, np.ndarray] = {}
    for name, (code, arr) in tensors.items():
        if code == "BF16":  # bf16 is the top half of a float32: widening is exact
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        arrays[name] = arr
    return arrays, meta


def save(path: StrPath, tensors: dict[str, Array | PackedWeight],
         metadata: dict[str, str] | None = None) -> None:
    """Write arrays and packed weights to one safetensors file, atomically.

    Args:
        path: destination file; a crash or error mid-save leaves the previous file intact.
        tensors: name -> numpy or cupy array (copied to the host to be written) or
            ``PackedWeight``.
        metadata: optional str -> str entries, returned by ``load(..., with_metadata=True)``; the
            key ``"lowbit"`` is reserved.

    Raises:
        TypeError: a value that is neither an array nor a ``PackedWeight``.
        ValueError: a name clash with a packed weight's scale tensor, a reserved metadata key,
            a dtype safetensors cannot hold.
    """
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
    meta = dict(metadata or {})
    if LOWBIT_KEY in meta:
        raise ValueError(f"metadata key {LOWBIT_KEY!r} is reserved for lowbit's own entry")
    arrays: dict[str, np.ndarray] = {}
    packed: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        if isinstance(value, PackedWeight):
            pw = checked_packed(value, f"tensors[{name!r}]")
            packed[name] = {"format": pw.format, "shape": list(pw.shape)}
            pairs: tuple[tuple[str, Array], ...] = ((name, pw.data),
                                                    (name + SCALE_SUFFIX, pw.scale))
        elif isinstance(value, np.ndarray) or _backend.is_cupy_array(value):
            pairs = ((name, value),)
        else:
            raise TypeError(f"tensors[{name!r}] must be an array or a PackedWeight, got "
                            f"{type(value).__name__}")
        for key, arr in pairs:
            if key in arrays:
                raise ValueError(f"tensors: the name {key!r} is used twice (a packed weight's "
                                 f"scale is stored as '<name>{SCALE_SUFFIX}')")
            arrays[key] = arr.get() if _backend.is_cupy_array(arr) else arr
    meta[LOWBIT_KEY] = json.dumps({"version": FORMAT_VERSION, "packed": packed})
    write_file(path, arrays, meta)


@overload
def load(path: StrPath, xp: Any = None, *,
         with_metadata: Literal[False] = False) -> dict[str, Array | PackedWeight]: ...


@overload
def load(path: StrPath, xp: Any = None, *, with_metadata: Literal[True]
         ) -> tuple[dict[str, Array | PackedWeight], dict[str, str]]: ...


@overload
def load(path: StrPath, xp: Any = None, *, with_metadata: bool = False
         ) -> dict[str, Array | PackedWeight] | tuple[dict[str, Array | PackedWeight],
                                                       dict[str, str]]: ...


def load(path: StrPath, xp: Any = None, *, with_metadata: bool = False
         ) -> dict[str, Array | PackedWeight] | tuple[dict[str, Array | PackedWeight],
                                                       dict[str, str]]:
    """Read a file written by ``save`` (or any safetensors file).

    Args:
        path: the file.
        xp: ``numpy`` (default) or ``cupy``: the array module the tensors are put on.
        with_metadata: also return the user metadata given to ``save``.

    Returns:
        name -> array or ``PackedWeight`` (rebuilt from the ``"lowbit"`` entry); with
        ``with_metadata``, ``(tensors, metadata)``.

    Raises:
        ValueError: a malformed file (see ``read_file``), an unknown lowbit container version,
            a packed weight whose tensors are missing or disagree with its format and shape.
    """
    arrays, meta = read_file(path)
    try:
        entry = json.loads(meta.pop(LOWBIT_KEY, '{"version": 1, "packed": {}}'))
        version, packed = entry["version"], dict(entry["packed"])
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad(path, f"the {LOWBIT_KEY!r} metadata entry is malformed ({exc!r})") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"path {os.fspath(path)!r} has lowbit container version {version!r}, "
                         f"expected {FORMAT_VERSION}")
    xp = np if xp is None else xp
    out: dict[str, Array | PackedWeight] = {}
    for name, info in packed.items():
        if name not in arrays or name + SCALE_SUFFIX not in arrays:
            raise ValueError(f"path {os.fspath(path)!r}: packed weight {name!r} lacks its data "
                             f"or its '{SCALE_SUFFIX}' tensor")
        try:
            fmt, shape = info["format"], tuple(info["shape"])
        except (KeyError, TypeError) as exc:
            raise _bad(path, f"packed weight {name!r} lacks its format or shape ({exc!r})") \
                from None
        pw = PackedWeight(fmt, shape, arrays.pop(name), arrays.pop(name + SCALE_SUFFIX))
        pw = checked_packed(pw, f"{os.fspath(path)!r}[{name!r}]")
        out[name] = PackedWeight(pw.format, pw.shape, xp.asarray(pw.data), xp.asarray(pw.scale))
    out.update({name: xp.asarray(arr) for name, arr in arrays.items()})
    return (out, meta) if with_metadata else out
