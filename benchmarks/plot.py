"""A bar chart as a PNG, written with zlib and numpy alone (no plotting
library): per op (its cases summed), the bandwidth limit against mps_ext's projected time
(and, on a Mac, stock torch's and mps_ext's measured times), on a log scale
of time with a gridline at every decade, from the decade below the shortest
time. The chart carries only
the op numbers (a 3x5 digit font); benchmarks/__main__.py prints the
legend, a markdown table of the same numbers.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

# Bar colours (RGB), in the legend's order.
SERIES = {
    "bandwidth limit": (150, 150, 150),
    "mps_ext projected": (40, 100, 200),
    "stock measured": (210, 60, 50),
    "mps_ext measured": (40, 160, 70),
}
BAR, GAP, GROUP_GAP, MARGIN, DECADE = 16, 2, 24, 16, 48  # pixels

# 3x5 digits, one row of three bits (left to right) per line.
_DIGITS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
}


def png(image: np.ndarray) -> bytes:
    """PNG file bytes of an RGB image (height x width x 3, uint8)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"need a height x width x 3 uint8 image, got {image.dtype} {image.shape}")
    height, width, _ = image.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    # Each scanline starts with its filter type, 0 (none).
    raw = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
            + chunk(b"IEND", b""))


def _text(image: np.ndarray, x: int, y: int, digits: str, scale: int = 2) -> None:
    for k, ch in enumerate(digits):
        for row, bits in enumerate(_DIGITS[ch]):
            for col in range(3):
                if bits & (4 >> col):
                    x0, y0 = x + (4 * k + col) * scale, y + row * scale
                    image[y0:y0 + scale, x0:x0 + scale] = 0


def bar_chart(groups: list[dict[str, float]]) -> tuple[np.ndarray, float]:
    """An RGB image: one group of bars per op (its values in us, by the
    names of SERIES; a missing series leaves a gap), numbered from 1 below;
    and the time at its baseline (a power of ten)."""
    values = [v for g in groups for v in g.values() if v > 0] or [1.0]
    lowest = 10.0 ** (math.floor(math.log10(min(values))) - 1)  # the shortest bar at least a decade tall
    decades = max(1, math.ceil(math.log10(max(values) / lowest)))
    plot_h = decades * DECADE
    group_w = len(SERIES) * (BAR + GAP) + GROUP_GAP
    width = 2 * MARGIN + len(groups) * group_w
    height = plot_h + 2 * MARGIN + 14
    image = np.full((height, width, 3), 255, np.uint8)
    top, base = MARGIN, MARGIN + plot_h
    for d in range(decades + 1):  # gridlines: 1 us, 10 us, ...
        image[base - d * DECADE, MARGIN:width - MARGIN] = (220, 220, 220)
    for i, g in enumerate(groups):
        x = MARGIN + i * group_w + GROUP_GAP // 2
        for s, (name, colour) in enumerate(SERIES.items()):
            v = g.get(name)
            if v is None or v <= 0:
                continue
            h = max(1, int(round(math.log10(v / lowest) * DECADE)))  # at least a stub
            x0 = x + s * (BAR + GAP)
            image[max(top, base - h):base, x0:x0 + BAR] = colour
        _text(image, x, base + 4, str(i + 1))
    image[base, MARGIN:width - MARGIN] = 0  # the axis
    return image, lowest
