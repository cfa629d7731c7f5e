"""The safetensors weight files of a model directory: find them, check them cheaply, stream them.

:func:`weight_files` runs before any heavy work (no tensor data is read): it finds the
checkpoint's file(s) (``model.safetensors``, or every shard named by
``model.safetensors.index.json``) and checks each one with :func:`check_safetensors_file` --
the 8-byte header length, the JSON header, every tensor's declared byte range against its
dtype, shape and the file size. A truncated copy, garbage bytes, a torch pickle renamed to
``.safetensors``, or an index naming missing shards or tensors each give one
:class:`~qerl.errors.QerlConfigError` naming the file and the fix, instead of a raw
``SafetensorError`` after the model has half loaded. Pickles are recognised by their first
bytes, never opened: this project never unpickles foreign files.

:func:`iter_tensors` then streams the tensors one at a time (``safe_open`` + ``get_tensor``), so
host memory holds one tensor, not one shard, at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from qerl.errors import QerlConfigError

__all__ = [
    "CHECKPOINT_FILE",
    "INDEX_FILE",
    "check_safetensors_file",
    "iter_tensors",
    "keys_with_suffix",
    "weight_files",
]

CHECKPOINT_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: The safetensors library refuses headers above this size (100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Bytes per element of the safetensors dtypes (sub-byte types as fractions).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
    "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip

_RESAVE = (
    "replace it with a complete copy, or re-save the model with "
    "save_pretrained(..., safe_serialization=True)"
)
_COPY_AGAIN = "copy or download the file again and compare its size with the original"
_PICKLE_FIX = (
    "convert it with `save_pretrained(..., safe_serialization=True)` where it was made; this "
    "project never unpickles foreign files"
)


def _sniff_foreign(head: bytes) -> str | None:
    """What a file that is not safetensors looks like, from its first bytes (None: no idea)."""
    if head.startswith(b"PK\x03\x04"):
        return "looks like a torch pickle: a zip archive as written by torch.save"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "looks like a Python / torch pickle"
    if head.startswith(b"GGUF"):
        return "looks like a GGUF file"
    return None


def _bad(file: Path, field: str, problem: str, fix: str = _RESAVE) -> QerlConfigError:
    return QerlConfigError(field, f"{file} {problem}", fix)


def _check_entries(file: Path, field: str, header: Mapping[str, Any], data_bytes: int) -> None:
    """Every tensor entry well formed, the byte ranges contiguous and covering the data exactly."""
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= end):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise _bad(file, field, f"is corrupt: header entry {name!r} is malformed") from None
        size = DTYPE_BYTES.get(dtype)
        if size is not None and end - begin != math.ceil(math.prod(shape) * size):
            raise _bad(
                file,
                field,
                f"is corrupt: tensor {name!r} ({dtype} {shape}) declares {end - begin} bytes",
            )
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise _bad(file, field, f"is corrupt: tensor {name!r} overlaps another or leaves a gap")
        position = end
    if position > data_bytes:
        raise _bad(
            file,
            field,
            f"is truncated: its header declares {position} bytes of tensor data but the file "
            f"holds {data_bytes} (an interrupted copy or download?)",
            _COPY_AGAIN,
        )
    if position < data_bytes:
        raise _bad(file, field, f"is corrupt: {data_bytes - position} bytes follow the tensor data")


def check_safetensors_file(file: str | Path, field: str = "model.path") -> dict[str, Any]:
    """Check a safetensors file without reading its tensors and return its header.

    Reads the 8-byte little-endian header length and the JSON header, then checks every tensor's
    ``data_offsets`` against its dtype and shape and against the file size.

    Raises:
        QerlConfigError: naming ``field`` and the file -- missing, empty, truncated, a pickle or
            other foreign file, or a corrupt header.
    """
    file = Path(file)
    if not file.is_file():
        raise _bad(file, field, "does not exist", "restore the complete checkpoint")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        foreign = _sniff_foreign(head)
        if foreign is not None:
            raise _bad(file, field, f"is not a safetensors file ({foreign})", _PICKLE_FIX)
        if size < 8:
            what = "is empty (0 bytes)" if size == 0 else f"is truncated ({size} bytes)"
            raise _bad(file, field, f"{what}; not a safetensors file", _COPY_AGAIN)
        n = int.from_bytes(head, "little")
        first = f.read(1)
        if first != b"{" or n < 2:
            raise _bad(file, field, "is not a safetensors file (no JSON header after the length)")
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise _bad(
                file,
                field,
                f"is truncated: its header alone should take {n} bytes, the file holds {size - 8}",
                _COPY_AGAIN,
            )
        raw = first + f.read(n - 1)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(file, field, f"is corrupt: its header is not valid JSON ({exc})") from None
    _check_entries(file, field, header, size - 8 - n)
    return header


def _check_index(path: Path, field: str) -> dict[Path, dict[str, Any]]:
    """Headers of every shard named by the index; the index's tensors are where it says."""
    index = path / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and Path(v).name == v and v for v in weight_map.values()
        ):
            raise ValueError("weight_map must map tensor names to shard file names")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise _bad(index, field, f"is not a valid safetensors index ({exc})") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise _bad(
            index,
            field,
            f"names {len(missing)} shard(s) that are missing: {missing[:5]}",
            "restore the complete checkpoint (every shard the index lists)",
        )
    headers = {path / s: check_safetensors_file(path / s, field) for s in shards}
    for name, shard in weight_map.items():
        if name not in headers[path / shard]:
            raise _bad(
                index,
                field,
                f"places tensor {name!r} in {shard}, which does not hold it",
                "restore the matching index and shards (they come from different saves)",
            )
    return headers


def weight_files(path: str | Path, field: str = "model.path") -> dict[Path, dict[str, Any]]:
    """The checkpoint's safetensors file(s) in a stable order, each checked, with its header.

    Uses ``model.safetensors.index.json`` (all its shards) when present, else
    ``model.safetensors``.

    Raises:
        QerlConfigError: no safetensors weights (e.g. only a pickled ``pytorch_model.bin``), or
            any file failing :func:`check_safetensors_file`, or an inconsistent index.
    """
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        return _check_index(path, field)
    single = path / CHECKPOINT_FILE
    if single.is_file():
        return {single: check_safetensors_file(single, field)}
    pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    raise QerlConfigError(
        field,
        f"{str(path)!r} has no {CHECKPOINT_FILE} (or {INDEX_FILE})"
        + (f"; only pickled weights {pickled[:3]}" if pickled else ""),
        "save the model with save_pretrained(..., safe_serialization=True); pickled weights "
        "are never loaded",
    )


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, cpu tensor)`` one at a time from safetensors files (one tensor in memory)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def keys_with_suffix(headers: Mapping[Path, Mapping[str, Any]], suffix: str) -> list[str]:
    """Module names ``m`` for which ``m + suffix`` is a tensor of the checkpoint (from headers)."""
    return sorted(k[: -len(suffix)] for h in headers.values() for k in h if k.endswith(suffix))
