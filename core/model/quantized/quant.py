"""GGUF quantized tensors as specx's 4-bit verifier reads them (core/model/quantized/kernel.py).

Every supported block type says the same thing in its own bits: along a weight row, blocks of B
inputs (B = 16 or 32) share a float scale s and (for some types) a float min m, and each weight is
an unsigned integer q of 4 to 8 bits: w = s * (q - o) + m, with o an offset fixed by the type.

    type   q stored in  B    o     min   from the file's block                        bits a weight
    Q4_0   4 bits      32    8     -     d                                            4.5
    Q4_1   4 bits      32    0     m     d, m                                         5
    Q4_K   4 bits      32    0     m     d * sc_j, -dmin * m_j  (8 sub-blocks of 256)  4.75
    Q5_0   4 + 2 bits  32   16     -     d                                            6.5
    Q5_1   4 + 2 bits  32    0     m     d, m                                         7
    Q8_0   8 bits      32  128     -     d (q stored + 128: unsigned)                 8.5
    Q6_K   4 + 2 bits  16   32     -     d * sc_j (16 sub-blocks of 256)               6.625

`unpack(raw, qtype, k)` reads a tensor's rows of blocks into (q [N, K] uint8, s [N, K/B] float32,
m [N, K/32] float32 or None): exact (every product above is exact in float32), and tested against
gguf-py's own de-quantization. `pack` lays them out in panels of 16 output features for the
kernel: q values four inputs to a 32-bit lane (vpdpbusd's operand), 4-bit values two groups of four
to a byte, the top two bits of 5- and 6-bit values four to a byte beside them; scales and mins as
the file keeps them (float16, or a K-quant's integers and float32 d per 256). Nothing here makes a
float copy of the weights: a packed tensor takes the bits a weight in the last column (the file's
own but for Q5_0 and Q5_1, whose fifth bit takes two here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PANEL = 16  # output features per panel: sixteen 32-bit lanes of a 512-bit vector
BLOCK = 32  # inputs per block of the packed layout (a K-quant's 256-block is 8 of them)

# ggml type ids (gguf.GGMLQuantizationType) -> name, bytes per block, weights per block
TYPES = {2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32), 6: ("Q5_0", 22, 32), 7: ("Q5_1", 24, 32),
         8: ("Q8_0", 34, 32), 12: ("Q4_K", 144, 256), 14: ("Q6_K", 210, 256)}
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


@dataclass(frozen=True)
class Format:
    """How the kernel reads a type: `bits` of storage per q (4: two to a byte; 6: a nibble plus
    two bits; 8: a byte), a scale per `sub` inputs, offset `offset`, a min per 32 inputs when
    `has_min`; `scale` says how scales and mins are kept: "f16" (the file's float16 d and m per
    block) or "k" (a K-quant's integer scale per sub-block times a float32 d per 256 inputs, signed
    when `signed`)."""

    bits: int  # 4, 6 (Q5 uses five of them) or 8
    sub: int
    offset: int
    has_min: bool
    scale: str = "f16"
    signed: bool = False

    @property
    def block_bytes(self) -> int:
        """Bytes of q values per panel and 32 inputs."""
        return {4: 256, 6: 384, 8: 512}[self.bits]


FORMATS = {"Q4_0": Format(4, 32, 8, False), "Q4_1": Format(4, 32, 0, True), "Q4_K": Format(4, 32, 0, True, "k"),
           "Q5_0": Format(6, 32, 16, False), "Q5_1": Format(6, 32, 0, True), "Q8_0": Format(8, 32, 128, False),
           "Q6_K": Format(6, 16, 32, False, "k", True)}


class UnsupportedType(ValueError):
    """A tensor type the quantized engine does not run (the message names it)."""


def type_name(qtype: int) -> str:
    if qtype in TYPES:
        return TYPES[qtype][0]
    if qtype in FLOAT_TYPES:
        return FLOAT_TYPES[qtype]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return f"type {qtype}"


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from a [..., 2] uint8 array, as float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low nibbles are values 0-15, the high ones 16-31 (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's qh [..., 4] bytes -> [..., 32] bits: bit j of the little-endian uint32 belongs to value j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


@dataclass
class Parts:
    """A tensor's rows as the file holds them, unpacked: q [N, K] uint8 and either `d`, `m` (the
    float16 scale and min per 32, as uint16 bits) or, for K-quants, `kd`, `kdmin` (float32 per 256)
    and `ksc`, `km` (integer scale per sub-block, min per 32)."""

    q: np.ndarray
    d: np.ndarray | None = None
    m: np.ndarray | None = None
    kd: np.ndarray | None = None
    kdmin: np.ndarray | None = None
    ksc: np.ndarray | None = None
    km: np.ndarray | None = None

    def scales(self) -> np.ndarray:
        if self.d is not None:
            return self.d.view(np.float16).astype(np.float32)
        per = self.ksc.shape[1] // self.kd.shape[1]
        return np.repeat(self.kd, per, axis=1) * self.ksc.astype(np.float32)

    def mins(self) -> np.ndarray | None:
        if self.m is not None:
            return self.m.view(np.float16).astype(np.float32)
        if self.km is not None:
            return -(np.repeat(self.kdmin, self.km.shape[1] // self.kdmin.shape[1], axis=1) * self.km.astype(np.float32))
        return None


def unpack_parts(raw: np.ndarray, qtype: int, k: int) -> Parts:
    """The Parts of a tensor's raw rows `raw` [N, bytes per row] of ggml type `qtype`, K weights a row."""
    if qtype not in TYPES:
        raise UnsupportedType(f"the quantized engine does not run {type_name(qtype)} tensors")
    name, size, per = TYPES[qtype]
    n = raw.shape[0]
    if k % per or raw.shape[1] != k // per * size:
        raise ValueError(f"{name}: a row of {k} weights takes {k // per * size} bytes, not {raw.shape[1]}")
    b = np.ascontiguousarray(raw).reshape(n, k // per, size)
    f16 = lambda lo: np.ascontiguousarray(b[..., lo : lo + 2]).view(np.uint16)[..., 0]  # noqa: E731
    if name == "Q4_0":
        return Parts(_nibbles(b[..., 2:]).reshape(n, k), d=f16(0))
    if name == "Q4_1":
        return Parts(_nibbles(b[..., 4:]).reshape(n, k), d=f16(0), m=f16(2))
    if name == "Q5_0":
        return Parts((_nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4)).reshape(n, k), d=f16(0))
    if name == "Q5_1":
        return Parts((_nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4)).reshape(n, k), d=f16(0), m=f16(2))
    if name == "Q8_0":
        return Parts((b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k), d=f16(0))
    if name == "Q4_K":
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # four chunks of 64: low nibbles 32 values, high 32
        return Parts(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k),
                     kd=_f16(b[..., 0:2]), kdmin=_f16(b[..., 2:4]), ksc=sc.reshape(n, -1).astype(np.uint8),
                     km=m.reshape(n, -1).astype(np.uint8))
    # Q6_K: ql[128] qh[64] scales[16] d
    ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1).reshape(n, -1, 2, 4, 32)  # per half: l, l+32, l+64, l+96
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    return Parts((low | (high << 4)).reshape(n, k), kd=_f16(b[..., 208:210]),
                 ksc=np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, -1))


def unpack(raw: np.ndarray, qtype: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q [N, K] uint8, scales [N, K / sub] float32, mins [N, K / 32] float32 or None) of a
    tensor's raw rows `raw` [N, bytes per row] of ggml type `qtype`, each row holding K weights."""
    parts = unpack_parts(raw, qtype, k)
    return np.ascontiguousarray(parts.q, dtype=np.uint8), np.ascontiguousarray(parts.scales()), parts.mins()


def dequantize(q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, fmt: Format) -> np.ndarray:
    """The float32 weights [N, K] that (q, scales, mins) stand for: w = s * (q - o) + m. For
    tests and for embedding rows (a few rows at a time), never a whole model."""
    s = np.repeat(scales, fmt.sub, axis=1)
    w = s * (q.astype(np.float32) - np.float32(fmt.offset))
    if mins is not None:
        w += np.repeat(mins, BLOCK, axis=1)
    return w


@dataclass
class Packed:
    """A weight [N, K] laid out for core/model/quantized/kernel.py, P = ceil(N / 16) panels (the last
    zero-padded): `values` [P, K/32, fmt.block_bytes] uint8; `scales` [P, K/sub, 32 (f16) or 16
    (K-quant integers)] and `mins` [P, K/32, 32 or 16] as bytes; `kd`, `kdmin` [P, K/256, 16]
    float32 (K-quants). Arrays a format does not use are [1, 1, 16] stand-ins. `n` outputs, `k` inputs."""

    fmt: Format
    qtype: str
    n: int
    k: int
    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    kd: np.ndarray
    kdmin: np.ndarray

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.values, self.scales, self.mins, self.kd, self.kdmin

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a.shape[:2] != (1, 1))


_STAND_IN_U8, _STAND_IN_F32 = np.zeros((1, 1, PANEL), dtype=np.uint8), np.zeros((1, 1, PANEL), dtype=np.float32)


def _panels(a: np.ndarray, panels: int) -> np.ndarray:
    """[N', X] per-row figures -> [P, X, 16] (one 16-lane vector per panel and column)."""
    return np.ascontiguousarray(a.reshape(panels, PANEL, -1).transpose(0, 2, 1))


def _pad(a: np.ndarray | None, rows: int) -> np.ndarray | None:
    if a is None or a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), dtype=a.dtype)])


def pack(parts: Parts, fmt: Format, qtype: str) -> Packed:
    """Lay Parts out in panels (the class's docstring). 4-bit values: byte 64 t + 4 n + j of a
    block holds input 4 t + j in its low nibble and 16 + 4 t + j in its high one (t < 4: one
    64-byte load gives two groups of four inputs for sixteen outputs); 6-bit: those nibbles, then
    128 bytes whose byte 64 u + 4 n + j holds the top two bits of input 4 (4 u + i) + j at bits
    2 i; 8-bit: byte 64 g + 4 n + j holds input 4 g + j."""
    q = parts.q
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"rows of {k} weights: the kernel takes multiples of {BLOCK}")
    panels, nb = -(-n // PANEL), k // BLOCK
    rows = panels * PANEL
    q = _pad(q, rows)
    if fmt.bits == 8:
        values = q.reshape(panels, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(panels, nb, 512)
    else:
        g = (q & 0x0F).reshape(panels, PANEL, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)  # [P, nb, half, t, n, j]
        values = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(panels, nb, 256)
        if fmt.bits == 6:
            h = (q >> 4).reshape(panels, PANEL, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)  # [P, nb, u, i, n, j]
            high = (h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6))
            values = np.concatenate([values, high.reshape(panels, nb, 128)], axis=2)
    kd = kdmin = _STAND_IN_F32
    mins = _STAND_IN_U8
    if fmt.scale == "f16":
        scales = _panels(_pad(parts.d, rows), panels).view(np.uint8)  # [P, nb, 32]
        if fmt.has_min:
            mins = _panels(_pad(parts.m, rows), panels).view(np.uint8)
    else:
        scales = _panels(_pad(parts.ksc, rows), panels).view(np.uint8)  # [P, K/sub, 16]
        kd = _panels(_pad(parts.kd, rows), panels)
        if fmt.has_min:
            mins = _panels(_pad(parts.km, rows), panels)
            kdmin = _panels(_pad(parts.kdmin, rows), panels)
    return Packed(fmt, qtype, n, k, np.ascontiguousarray(values, dtype=np.uint8), np.ascontiguousarray(scales),
                  np.ascontiguousarray(mins), np.ascontiguousarray(kd, dtype=np.float32),
                  np.ascontiguousarray(kdmin, dtype=np.float32))


def unpack_rows(packed: Packed, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """unpack's (q, scales, mins) of the rows `ids` of a Packed weight, read back from its panels
    (a tied model's embedding lookups read the output layer: no second copy of it)."""
    fmt, nb = packed.fmt, packed.k // BLOCK
    panel, lane = ids // PANEL, ids % PANEL
    v = packed.values[panel]  # [R, nb, bytes]
    r = len(ids)
    pick = lambda a, groups: a.reshape(r, nb, groups, PANEL, 4)[np.arange(r), :, :, lane]  # noqa: E731 - [R, nb, groups, 4]
    if fmt.bits == 8:
        q = pick(v, 8).reshape(r, packed.k)
    else:
        nibbles = pick(v[:, :, :256], 4)  # [R, nb, t, j]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)  # [R, nb, half * 4 + t, j]
        if fmt.bits == 6:
            high = pick(v[:, :, 256:], 2)  # [R, nb, u, j]
            bits = (high[:, :, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, None, :, None]) & 0x03
            q = q | (bits.reshape(r, nb, 8, 4) << 4)
        q = q.reshape(r, packed.k)
    lanes = lambda a: a[panel, :, lane]  # noqa: E731 - [P, X, 16] -> [R, X]
    if fmt.scale == "f16":
        scales = lanes(packed.scales.view(np.uint16)).view(np.float16).astype(np.float32)
        mins = lanes(packed.mins.view(np.uint16)).view(np.float16).astype(np.float32) if fmt.has_min else None
    else:
        sc = lanes(packed.scales.view(np.int8 if fmt.signed else np.uint8)).astype(np.float32)
        scales = np.repeat(lanes(packed.kd), sc.shape[1] // packed.kd.shape[1], axis=1) * sc
        mins = None
        if fmt.has_min:
            m = lanes(packed.mins).astype(np.float32)
            mins = -(np.repeat(lanes(packed.kdmin), m.shape[1] // packed.kdmin.shape[1], axis=1) * m)
    return np.ascontiguousarray(q, dtype=np.uint8), scales, mins


def pack_tensor(raw: np.ndarray, qtype: int, k: int, rows: int = 4096) -> Packed:
    """unpack_parts + pack of raw rows [N, bytes per row], `rows` at a time (the unpacked q values
    of a whole output layer would take 1 byte a weight at once)."""
    name = type_name(qtype)
    if qtype not in TYPES:
        raise UnsupportedType(f"the quantized engine does not run {name} tensors")
    parts = [pack(unpack_parts(raw[i : i + rows], qtype, k), FORMATS[name], name) for i in range(0, raw.shape[0], rows)]
    return concat(parts) if len(parts) > 1 else parts[0]


def concat(parts: list[Packed]) -> Packed:
    """Packed weights of one format stacked along the outputs (q, k and v as one matrix): each
    part must fill whole panels but the last."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.k != first.k for p in parts) or any(p.n % PANEL for p in parts[:-1]):
        raise ValueError("only weights of one type and width, in whole panels, stack")
    stacked = [a if a.shape[:2] == (1, 1) else np.concatenate([p.arrays[i] for p in parts])
               for i, a in enumerate(first.arrays)]
    return Packed(first.fmt, first.qtype, sum(p.n for p in parts), first.k, *stacked)
