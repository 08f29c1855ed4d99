"""How deeply a msgpack frame nests, found without decoding it.

msgspec's typed decoders are safe against deep nesting by construction: no wire
struct has an ``Any`` field, so a typed decode stops at the first container the schema
does not allow (a few levels at most). Untyped decoding is not: about 1000 nested
arrays in a 1 KB frame raise ``RecursionError`` from the decoder. The receiver decodes
untyped only on the error path (to read the request id of a rejected message), so it
asks :func:`nesting_depth` first and refuses a frame nested deeper than
:data:`MAX_DEPTH` as ``wire:nesting`` before any untyped decoder sees it.

The scan walks the msgpack encoding with an explicit stack (no recursion), reads each
length prefix and skips the bytes it covers, and stops as soon as the depth limit is
passed, so a hostile frame costs one pass over at most its first ``limit + 1``
container headers; a benign frame is one pass over its bytes.
"""

from __future__ import annotations

#: Deepest container nesting any wire message needs is 4 (header, proposal, tensor ref,
#: shape); anything deeper than this is refused before untyped decoding.
MAX_DEPTH = 32

# First byte -> (length-prefix bytes, fixed payload bytes) for the non-fix types.
_SIZED = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),  # bin 8/16/32
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),  # ext 8/16/32 (+1 type byte)
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),  # str 8/16/32
}
_FIXED = {
    0xC0: 0,
    0xC1: 0,
    0xC2: 0,
    0xC3: 0,  # nil, (never used), false, true
    0xCA: 4,
    0xCB: 8,  # float 32/64
    0xCC: 1,
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,  # uint 8..64
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,  # int 8..64
    0xD4: 2,
    0xD5: 3,
    0xD6: 5,
    0xD7: 9,
    0xD8: 17,  # fixext 1..16 (+1 type byte)
}
# Containers with a length prefix: first byte -> (prefix bytes, items per entry).
_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def nesting_depth(frame: bytes | memoryview, limit: int = MAX_DEPTH) -> int:
    """Deepest container nesting in ``frame`` (0 for a scalar), or ``limit + 1`` as soon
    as it passes ``limit``. A truncated frame reports the depth reached so far."""
    data = frame if isinstance(frame, bytes) else bytes(frame)
    n = len(data)
    stack = [1]  # values still to read at each open level; the top level holds one
    deepest = 0
    i = 0
    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        if i >= n:
            return deepest  # truncated: the decoder already called it malformed
        stack[-1] -= 1
        b = data[i]
        i += 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            continue
        items = 0
        if b <= 0x8F:
            items = 2 * (b & 0x0F)  # fixmap
        elif b <= 0x9F:
            items = b & 0x0F  # fixarray
        elif b <= 0xBF:
            i += b & 0x1F  # fixstr
            continue
        elif b in _FIXED:
            i += _FIXED[b]
            continue
        elif b in _SIZED:
            width, extra = _SIZED[b]
            i += width + extra + int.from_bytes(data[i : i + width], "big")
            continue
        else:
            width, per = _CONTAINER[b]
            items = per * int.from_bytes(data[i : i + width], "big")
            i += width
        depth = len(stack)  # this container opens level len(stack)
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        if items:
            stack.append(items)
    return deepest
