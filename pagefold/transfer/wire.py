"""The transfer's messages: ZMQ multipart frames, a CRC-32 per page row.

A consumer's pull (DEALER to the producer's ROUTER)::

    frame 0   b"PFKV-PULL-1"
    frame 1   UTF-8 JSON {"req": producer request id, "keys": [key names], "layout": id,
                          "pullers": n (optional, default 1)}

``pullers``: how many pulls (or releases) of this producer rank the export answers before it
leaves the outbox: more than one when consumer ranks share a producer rank's shard (mixed
tensor parallelism, e.g. a TP 1 producer and a TP 2 consumer).

The producer's answer::

    frame 0   b"PFKV-PAGES-1"
    frame 1   UTF-8 JSON {"ok": bool, "error": str (when not ok), "layout": id,
                          "pages": [{"key", "group", "layers" L, "pages" P, "page_bytes" B,
                                     "crc32": [L*P CRC-32s, layer-major]}, ...]}
    frame 2+i the i-th page's payload: L*P*B bytes, layer 0's P rows, then layer 1's, ...

A page is used only when its entry names a key that was asked for, its geometry is what the
consumer's pool expects for that key, its payload has exactly ``L*P*B`` bytes and every row's
CRC-32 matches; anything else is a failed page (the consumer recomputes, the bytes never
reach its pool). Key names are ``core.kv_connector.key_name``'s.
"""

from __future__ import annotations

import json
import zlib

import torch

from pagefold.offload.page_file import PageGeometry

PULL = b"PFKV-PULL-1"
PAGES = b"PFKV-PAGES-1"


def row_crcs(payload: memoryview, page_bytes: int) -> list[int]:
    return [zlib.crc32(payload[i:i + page_bytes]) for i in range(0, len(payload), page_bytes)]


def encode_pull(req: str, keys: list[str], layout: str, pullers: int = 1) -> list[bytes]:
    return [PULL, json.dumps({"req": req, "keys": keys, "layout": layout,
                              "pullers": pullers}).encode()]


def decode_pull(frames: list[bytes]) -> dict:
    """The pull's fields; raises ValueError on anything that is not a pull."""
    if len(frames) != 2 or frames[0] != PULL:
        raise ValueError("not a pull message")
    msg = json.loads(frames[1])
    if not isinstance(msg, dict) or not isinstance(msg.get("keys"), list):
        raise ValueError("malformed pull message")
    return msg


def encode_pages(pages: list[tuple[str, int, torch.Tensor]], layout: str,
                 error: str | None = None) -> list:
    """``pages``: (key name, group, rows of shape (L, P, B) uint8 on the CPU)."""
    meta, payloads = [], []
    for name, group, rows in pages:
        layers, n, b = rows.shape
        view = memoryview(rows.contiguous().numpy()).cast("B")
        meta.append({"key": name, "group": group, "layers": layers, "pages": n,
                     "page_bytes": b, "crc32": row_crcs(view, b)})
        payloads.append(view)
    head = {"ok": error is None, "layout": layout, "pages": meta}
    if error is not None:
        head["error"] = error
    return [PAGES, json.dumps(head, separators=(",", ":")).encode(), *payloads]


def decode_pages(frames: list, want: dict[str, PageGeometry], layout: str
                 ) -> tuple[dict[str, torch.Tensor], str | None]:
    """The verified pages of an answer, ``{key name: rows (L, P, B) uint8}`` (a key absent
    from the result failed), and the producer's error (None when it had none)."""
    if len(frames) < 2 or bytes(frames[0]) != PAGES:
        return {}, "not a pages message"
    head = json.loads(bytes(frames[1]))
    if not head.get("ok"):
        return {}, str(head.get("error") or "the producer refused")
    if head.get("layout") != layout:
        return {}, f"layout {head.get('layout')} is not this engine's {layout}"
    metas = head.get("pages") or []
    if len(metas) != len(frames) - 2:
        return {}, "page count does not match the frames"
    out: dict[str, torch.Tensor] = {}
    for meta, frame in zip(metas, frames[2:]):
        geom = want.get(meta.get("key"))
        if geom is None or (meta.get("layers"), meta.get("pages"), meta.get("page_bytes")) \
                != (geom.layers, geom.pages, geom.page_bytes):
            continue
        buf = memoryview(frame).cast("B") if not isinstance(frame, bytes) else memoryview(frame)
        if len(buf) != geom.payload_bytes or row_crcs(buf, geom.page_bytes) != meta.get("crc32"):
            continue
        rows = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        out[meta["key"]] = rows.view(geom.layers, geom.pages, geom.page_bytes)
    return out, None
