"""The disk tier's format: one file per page key, every page row checksummed.

Layout of a directory given as ``--kv-offloading-dir DIR``::

    DIR/pagefold-kv-v1/<layout id>/rank<r>-of-<n>/<key name>.kvpage

``<layout id>`` (16 hex digits) names everything that makes a page's bytes meaningful: the
model (its config and weight files), dtypes, block size, page size and the cache groups; an
engine with another layout never opens these files. ``<key name>`` is the prefix-cache key
(``core.kv_connector.key_name``). Each tensor-parallel rank keeps its own shard.

A file (little-endian)::

    0   8 bytes   magic b"PFKVPAGE"
    8   u32       format version (1)
    12  u32       header length H
    16  u32       CRC-32 of the header bytes
    20  H bytes   header, UTF-8 JSON: key, group, layers L, pages P, page_bytes B,
                  saved_tokens, layout, crc32 (L*P CRC-32s, layer-major)
    20+H          payload: L*P*B bytes, layer 0's P page rows, then layer 1's, ...

A reader accepts a file only when its size is exactly ``20 + H + L*P*B``, the header CRC,
key, layout and geometry match what it asked for, and every page row's CRC-32 matches; any
other file is reported as a :class:`PageFileError` and never copied into the pool. Files are
written to a temporary name and renamed into place, so a reader never sees a half-written file
under a key's name (a crash leaves a ``.tmp`` file, removed by the next scan).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"PFKVPAGE"
VERSION = 1
_FIXED = struct.Struct("<8sIII")
SUFFIX = ".kvpage"


class PageFileError(Exception):
    """A page file that is missing, truncated, corrupt or for another key or layout."""


@dataclass(frozen=True, slots=True)
class PageGeometry:
    layers: int
    pages: int
    page_bytes: int

    @property
    def payload_bytes(self) -> int:
        return self.layers * self.pages * self.page_bytes


def rank_dir(root: str | Path, layout: str, rank: int, size: int) -> Path:
    return Path(root) / "pagefold-kv-v1" / layout / f"rank{rank}-of-{size}"


def page_path(directory: Path, name: str) -> Path:
    return directory / f"{name}{SUFFIX}"


def _crcs(payload: memoryview, geom: PageGeometry) -> list[int]:
    b = geom.page_bytes
    return [zlib.crc32(payload[i * b:(i + 1) * b]) for i in range(geom.layers * geom.pages)]


def write_page_file(path: Path, *, key: str, group: int, layout: str, geom: PageGeometry,
                    saved_tokens: int, payload: memoryview) -> None:
    """Write ``payload`` (``geom.payload_bytes`` bytes) under ``path`` atomically; raises
    OSError when the disk refuses (the caller stops offloading that page)."""
    if len(payload) != geom.payload_bytes:
        raise ValueError(f"payload of {len(payload)} bytes, geometry says "
                         f"{geom.payload_bytes}")
    header = json.dumps({
        "key": key, "group": group, "layers": geom.layers, "pages": geom.pages,
        "page_bytes": geom.page_bytes, "saved_tokens": saved_tokens, "layout": layout,
        "crc32": _crcs(payload, geom)}, separators=(",", ":")).encode()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_FIXED.pack(MAGIC, VERSION, len(header), zlib.crc32(header)))
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_page_file(path: Path, *, key: str, layout: str, geom: PageGeometry) -> bytearray:
    """The payload of ``path`` after every check of the module docstring; raises
    :class:`PageFileError` naming what failed."""
    try:
        data = bytearray(path.read_bytes())
    except OSError as e:
        raise PageFileError(f"{path.name}: cannot read ({e.strerror or e})") from e
    if len(data) < _FIXED.size:
        raise PageFileError(f"{path.name}: truncated ({len(data)} bytes)")
    magic, version, hlen, hcrc = _FIXED.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise PageFileError(f"{path.name}: not a version-{VERSION} page file")
    start = _FIXED.size + hlen
    view = memoryview(data)
    if len(data) < start or zlib.crc32(view[_FIXED.size:start]) != hcrc:
        raise PageFileError(f"{path.name}: header truncated or corrupt")
    header = json.loads(bytes(view[_FIXED.size:start]))
    want = {"key": key, "layout": layout, "layers": geom.layers, "pages": geom.pages,
            "page_bytes": geom.page_bytes}
    bad = {k: header.get(k) for k, v in want.items() if header.get(k) != v}
    if bad:
        raise PageFileError(f"{path.name}: header does not match ({bad})")
    if len(data) != start + geom.payload_bytes:
        raise PageFileError(f"{path.name}: {len(data) - start} payload bytes, expected "
                            f"{geom.payload_bytes} (truncated or padded)")
    payload = view[start:]
    crcs = _crcs(payload, geom)
    if crcs != header.get("crc32"):
        rows = [i for i, (a, b) in enumerate(zip(crcs, header.get("crc32") or [])) if a != b]
        raise PageFileError(f"{path.name}: checksum mismatch in page rows {rows[:8]}")
    del view, payload
    return data[start:]


def scan(directory: Path) -> list[tuple[str, int]]:
    """``(key name, file size)`` of the page files in ``directory``, oldest modified first
    (the disk tier's LRU order after a restart); stale temporary files are removed."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif p.name.endswith(SUFFIX):
            st = p.stat()
            found.append((st.st_mtime_ns, p.name[: -len(SUFFIX)], st.st_size))
    found.sort()
    return [(name, size) for _, name, size in found]


def layout_id(model_dir: str | Path, geometry: dict) -> str:
    """16 hex digits naming the model (its ``config.json`` bytes, its weight files' names,
    sizes and modification times) and ``geometry`` (dtypes, block size, page size, the cache
    groups: everything that makes a page's bytes meaningful, but not the pool's size)."""
    h = hashlib.sha256(json.dumps(geometry, sort_keys=True, default=repr).encode())
    root = Path(model_dir)
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(root.glob("*.safetensors")) if root.is_dir() else ():
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
