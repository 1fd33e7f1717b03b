"""The quantized engine's row-wise steps (core/model/quantized/engine.py): RMS norm, rotary embedding, SiLU,
attention. Each computes a row's result from that row alone, in one fixed order of float
operations (no reassociation, no fused multiply-adds the compiler may or may not form), so a token
gets the same bits in a one-token pass, a tree pass or a prefill: with the batch-invariant linear
kernel (core/model/quantized/kernel.py) that makes speculation exactly the engine's own plain decoding.

Attention is core/model/quantized/attention.py's (exact the same way); its exponentials come from
`exp_rows` here (a polynomial: the same bits in a vector lane and in a scalar tail).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...numba_cache import configure as configure_numba_cache
from ...numba_cache import fix_module, fixed
from .kernel import PARALLEL_VALUES, ROUND, ROW_CHUNK, quantize_rows

configure_numba_cache()

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)
_LN2_LO = np.float32(1.428606765330187e-06)
# Taylor terms of exp(r) for |r| <= ln(2) / 2 (relative error ~2e-7: float32's own)
_C2, _C3, _C4 = np.float32(1 / 2), np.float32(1 / 6), np.float32(1 / 24)
_C5, _C6, _C7 = np.float32(1 / 120), np.float32(1 / 720), np.float32(1 / 5040)


@njit(nogil=True, cache=True)
def exp_rows(x, out, ibuf):  # pragma: no cover - compiled
    """out[j] = exp(x[j]) for float32 x clamped to [-87, 88]: n = rint(x log2 e), r = x - n ln 2,
    a degree-7 polynomial of r times 2^n (built as float bits in `ibuf`, an int32 scratch)."""
    n = x.shape[0]
    for j in range(n):
        v = x[j]
        v = v if v > np.float32(-87.0) else np.float32(-87.0)  # selects (min/max branch on NaN: no vectors)
        v = v if v < np.float32(88.0) else np.float32(88.0)
        k = (v * _LOG2E + ROUND) - ROUND  # rint: np.rint is a call numba does not inline
        r = (v - k * _LN2_HI) - k * _LN2_LO
        p = _C6 + r * _C7
        p = _C5 + r * p
        p = _C4 + r * p
        p = _C3 + r * p
        p = _C2 + r * p
        p = np.float32(1.0) + r * p
        out[j] = np.float32(1.0) + r * p
        ibuf[j] = (np.int32(k) + np.int32(127)) << 23
    scale = ibuf.view(np.float32)
    for j in range(n):
        out[j] = out[j] * scale[j]


@njit(nogil=True, cache=True)
def rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    """out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * weight (the sum of squares in float64, in order)."""
    rows, width = x.shape
    for m in range(rows):
        total = 0.0
        for j in range(width):
            v = np.float64(x[m, j])
            total += v * v
        scale = np.float32(1.0 / np.sqrt(total / width + eps))
        for j in range(width):
            out[m, j] = (x[m, j] * scale) * weight[j]


@njit(nogil=True, cache=True)
def rope(x, positions, cos, sin, neox):  # pragma: no cover - compiled
    """Rotate x [S, H, D] in place by the angles of each row's position (tables [P, R/2] of
    rotated width R <= D): pairs (2i, 2i+1) as llama.cpp's normal mode, or (i, i + R/2) (neox)."""
    rows, heads, _ = x.shape
    half = cos.shape[1]
    for s in range(rows):
        p = positions[s]
        for h in range(heads):
            for i in range(half):
                a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                c, si = cos[p, i], sin[p, i]
                x0, x1 = x[s, h, a], x[s, h, b]
                x[s, h, a] = x0 * c - x1 * si
                x[s, h, b] = x0 * si + x1 * c


@njit(nogil=True, cache=True, inline="always")
def _silu_row(gate_up, m, width, out, scratch, ibuf):  # pragma: no cover - compiled
    for j in range(width):
        scratch[j] = -gate_up[m, j]
    exp_rows(scratch, out[m], ibuf)  # not in place: overlapping arrays keep LLVM from vectorizing it (8x slower)
    for j in range(width):
        out[m, j] = gate_up[m, j] / (np.float32(1.0) + out[m, j]) * gate_up[m, width + j]


@njit(nogil=True, cache=True, parallel=True)
def _silu_parallel(gate_up, width, out):  # pragma: no cover - compiled
    for m in prange(gate_up.shape[0]):
        _silu_row(gate_up, m, width, out, np.empty(width, dtype=np.float32), np.empty(width, dtype=np.int32))


@njit(nogil=True, cache=True)
def silu_mul(gate_up, width, out, scratch, ibuf):  # pragma: no cover - compiled
    """out[m] = silu(g) * u for gate_up[m] = [g (width), u (width), ...]: silu(g) = g / (1 + exp(-g));
    scratch [width] float32 and ibuf [width] int32 are exp_rows' buffers. A row depends on itself
    alone: many rows go to the threads (a parallel region costs microseconds to start: a few rows'
    work is less)."""
    if gate_up.shape[0] * width >= PARALLEL_VALUES:
        _silu_parallel(gate_up, width, out)
    else:
        for m in range(gate_up.shape[0]):
            _silu_row(gate_up, m, width, out, scratch, ibuf)


_LAYERS: dict[tuple[int, int], object] = {}


def build_layers(run_any, attend, store_keys, store_values):  # noqa: ANN001, ANN201 - returns a compiled function
    """The transformer's layers as one compiled function over `run_any` (core.model.quantized.kernel.any_driver),
    `attend` (core.model.quantized.attention.attention), `store_keys` and `store_values` (keys.key_store,
    values.value_store: the formats `attend` reads): a pass costs one call from Python, not dozens per layer.

    layers(x [S, E], positions [S], starts [Q + 1], alloweds, n0s [Q], mats, groups [L, 4, 2],
    norms [L, 2, E], biases [L, Wqkv] (has_bias), keys, values, cos, sin, neox, eps, scale, heads,
    kv_heads, head_dim, ffn): x after the last layer. The rows are Q sequences' (a batch):
    sequence q's rows starts[q]..starts[q+1]-1, its cache keys[q], values[q] (per layer,
    core.model.quantized.engine.KVCache's buffers) holding n0s[q] entries, its new rows' visibility
    alloweds[q]; their keys and values are written at n0s[q] on. The linear layers read every
    row in one pass; attention never mixes sequences. mats: (values, scales, mins, kd, kdmin, format index, n) per
    matrix; groups[i]: layer i's [start, end) in mats of qkv, output, gate+up and down."""
    key = (id(run_any), id(attend), id(store_keys), id(store_values))  # all kept for the process
    if key in _LAYERS:
        return _LAYERS[key]

    @njit(nogil=True, cache=True)
    def project(h, mats, start, end, dest):  # pragma: no cover - compiled
        rows, k = h.shape
        for r0 in range(0, rows, ROW_CHUNK):
            r1 = min(r0 + ROW_CHUNK, rows)
            m = r1 - r0
            q8 = np.empty((k // 4, m, 4), dtype=np.int8)
            dx = np.empty((k // 32, m), dtype=np.float32)
            sx = np.empty((k // 16, m), dtype=np.int32)
            xs = np.empty((k // 32, m), dtype=np.float32)
            quantize_rows(h[r0:r1], q8, dx, sx, xs)
            xw = q8.view(np.int32).reshape((k // 4, m))
            col = 0
            for j in range(start, end):
                values, scales, mins, kd, kdmin, fid, n = mats[j]
                out = np.empty((m, values.shape[0] * 16), dtype=np.float32)
                run_any(fid, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out)
                dest[r0:r1, col : col + n] = out[:, :n]
                col += n

    @njit(nogil=True, cache=True)
    def layers(x, positions, starts, alloweds, n0s, mats, groups, norms, biases, has_bias, keys, values, cos, sin,
               neox, eps, scale, heads, kv_heads, head_dim, ffn):  # pragma: no cover - compiled
        rows, width = x.shape
        qw, kvw = heads * head_dim, kv_heads * head_dim
        h = np.empty((rows, width), dtype=np.float32)
        qkv = np.empty((rows, qw + 2 * kvw), dtype=np.float32)
        q = np.empty((rows, heads, head_dim), dtype=np.float32)
        k = np.empty((rows, kv_heads, head_dim), dtype=np.float32)
        v = np.empty((rows, kv_heads, head_dim), dtype=np.float32)
        att = np.empty((rows, heads, head_dim), dtype=np.float32)
        proj = np.empty((rows, width), dtype=np.float32)
        gate_up = np.empty((rows, 2 * ffn), dtype=np.float32)
        act = np.empty((rows, ffn), dtype=np.float32)
        scratch, ibuf = np.empty(ffn, dtype=np.float32), np.empty(ffn, dtype=np.int32)
        for i in range(groups.shape[0]):
            rms_norm(x, norms[i, 0], eps, h)
            project(h, mats, groups[i, 0, 0], groups[i, 0, 1], qkv)
            if has_bias:
                for s in range(rows):
                    for j in range(qw + 2 * kvw):
                        qkv[s, j] += biases[i, j]
            for s in range(rows):
                for hh in range(heads):
                    for d in range(head_dim):
                        q[s, hh, d] = qkv[s, hh * head_dim + d]
                for hh in range(kv_heads):
                    for d in range(head_dim):
                        k[s, hh, d] = qkv[s, qw + hh * head_dim + d]
                        v[s, hh, d] = qkv[s, qw + kvw + hh * head_dim + d]
            rope(q, positions, cos, sin, neox)
            rope(k, positions, cos, sin, neox)
            for sq in range(len(n0s)):  # each sequence's rows: its own cache, its own attention
                kc, vc, n0 = keys[sq][i], values[sq][i], n0s[sq]
                store_keys(kc, k, starts[sq], starts[sq + 1], n0)
                store_values(vc, v, starts[sq], starts[sq + 1], n0)
            attend(q, keys, values, i, starts, n0s, alloweds, scale, att)
            project(att.reshape((rows, qw)), mats, groups[i, 1, 0], groups[i, 1, 1], proj)
            for s in range(rows):
                for j in range(width):
                    x[s, j] = x[s, j] + proj[s, j]
            rms_norm(x, norms[i, 1], eps, h)
            project(h, mats, groups[i, 2, 0], groups[i, 2, 1], gate_up)
            silu_mul(gate_up, ffn, act, scratch, ibuf)
            project(act, mats, groups[i, 3, 0], groups[i, 3, 1], proj)
            for s in range(rows):
                for j in range(width):
                    x[s, j] = x[s, j] + proj[s, j]
        return x

    # named by what they call, so that numba's cache finds them again in the next process
    fixed(project, f"qforward.project.{run_any._uuid}")
    _LAYERS[key] = fixed(layers, f"qforward.layers.{run_any._uuid}.{attend._uuid}.{store_keys._uuid}."
                                 f"{store_values._uuid}")
    return layers


fix_module(globals())
