"""Attention for the quantized engine, exact whatever pass a row is in (core/model/quantized/forward.py).

A query row attends to the cached entries and to the new entries its `allowed` row marks. Its
visible keys are its sequence's positions 0, 1, ... in order (a tree's accepted path is its
ancestors), so every sum runs over them in one fixed order, whichever pass the row is in.

Keys are kept as core/model/quantized/keys.py says and scored by its kernels (int8 with their
scales by default, or float16), values as core/model/quantized/values.py says and summed by its
kernels (bfloat16 pairs where the CPU sums them in one instruction, else float16).

Positions are cut into parts of BLOCK from position 0 (flash-decoding's split, at fixed places):
one job per (sequence, key head, part) runs every row of the sequence over that part, so at
agent context lengths a pass reads each cached key and value from memory once, whatever its
number of rows (the other rows find them in L2), and a long context keeps both cores busy even
for one row. Within a part, for a row:

- scores: q . k for sixteen keys at a time, one vector lane per key, a fused multiply-add chain
  over the head dimension in order (LLVM IR, like the matmul kernels; `_scores`). Entries that
  lie in place (the cache, then the row's leading run of visible new entries: all of them in a
  prefill or a chain) are read where they are; other visible new entries (a tree's branches) are
  copied beside each other first and go through the same code, so a key gets the same bits
  either way.
- softmax: the maximum m (exact in any order), exp (exp_rows' polynomial with fused multiply-adds),
  and the sum l in 16 lanes by position, combined in order.
- values: a = sum_j p_j v_j with the head dimension in vector registers, over the part's visible
  positions in order, in tiles of 16 of the row's own positions (values.py's kernels; a branch's
  gathered entries are copied beside the in-place ones of their tile); a key head's query heads
  side by side (one load of each value vector).

The parts are then combined in order (M the parts' maximum): sum_p e^(m_p - M) a_p / sum_p
e^(m_p - M) l_p; one part alone is a / l. Masked keys are skipped, not added as zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ...numba_cache import configure as configure_numba_cache
from ...numba_cache import fixed
from . import forward as qforward
from .forward import exp_rows
from .ir import F32, I32, I64, counted, splat
from .ir import fma as fma16
from .kernel import quantize_rows
from .keys import LANES, key_layout, scores_kernel
from .target import isa
from .values import bf16_pairs, default_values, value_copy, value_layout, weighted_kernel

configure_numba_cache()

_V16, _V8I = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES // 2)


def _exp(builder: ir.IRBuilder, v: Any) -> Any:
    """exp on 16 lanes as core.model.quantized.forward.exp_rows computes it (clamped to [-87, 88], n =
    rint(x log2 e), r = x - n ln 2, a degree-7 polynomial of r times 2^n), each multiply-add fused
    (llvm.fma: one rounding, the same bits in every family): half exp_rows' operations."""
    vi32 = ir.VectorType(I32, LANES)
    c = lambda x: ir.Constant(_V16, [float(np.float32(x))] * LANES)  # noqa: E731
    fma = fma16(builder)
    mad = lambda a, b, acc: builder.call(fma, [a, b, acc])  # noqa: E731
    v = builder.select(builder.fcmp_ordered(">", v, c(-87.0)), v, c(-87.0))
    v = builder.select(builder.fcmp_ordered("<", v, c(88.0)), v, c(88.0))
    k = builder.fsub(mad(v, c(qforward._LOG2E), c(qforward.ROUND)), c(qforward.ROUND))
    r = mad(builder.fneg(k), c(qforward._LN2_LO), mad(builder.fneg(k), c(qforward._LN2_HI), v))
    p = mad(r, c(qforward._C7), c(qforward._C6))
    for term in (qforward._C5, qforward._C4, qforward._C3, qforward._C2, 1.0, 1.0):
        p = mad(r, p, c(term))
    bits = builder.shl(builder.add(builder.fptosi(k, vi32), ir.Constant(vi32, [127] * LANES)),
                       ir.Constant(vi32, [23] * LANES))
    return builder.fmul(p, builder.bitcast(bits, _V16))


def _softmax_kernel(group: int, pairs: bool) -> Any:
    """softmax(scores [G, W], count, scale, probs [G, W], bf [G, W / 2], tops [G], totals [G]): per head h, over
    j < count, top = max_j scores[h, j] * scale (the maximum of the raw scores, then scaled:
    rounding is monotonic), probs[h, j] = exp(scores[h, j] * scale - top) (fused; `_exp`)
    and total = their sum in 16 lanes by position, the lanes then added in order; 16 at a time in
    vector registers (probs past count hold 0 to the end of their tile). With `pairs` the probs go
    to bf as well, as bfloat16 pairs (values.bf16_pairs: what bfloat16 values are weighed with)."""

    @intrinsic
    def softmax(typingctx, scores, count, scale, probs, bf, tops, totals):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            sc, pr, bfa, tp, tt = (context.make_array(signature.args[i])(context, builder, args[i])
                                   for i in (0, 3, 4, 5, 6))
            count_, scale_ = args[1], args[2]
            width = builder.extract_value(sc.shape, 1)
            const = lambda v: ir.Constant(I64, v)  # noqa: E731
            vi32 = ir.VectorType(I32, LANES)
            whole = builder.mul(builder.udiv(count_, const(LANES)), const(LANES))
            tail = builder.trunc(builder.sub(count_, whole), I32)
            mask = builder.icmp_signed("<", ir.Constant(vi32, list(range(LANES))), splat(builder, tail, vi32))
            vec = lambda base, idx: builder.bitcast(builder.gep(base, [idx]), _V16.as_pointer())  # noqa: E731
            scale_v = splat(builder, scale_, _V16)
            zero = ir.Constant(_V16, None)

            def with_tail(value: Any, at: Any, step: Any) -> Any:
                """step(value, at, mask) when count has a partial tile at `at` (else value)."""
                entry = builder.block
                part, after = builder.append_basic_block("tail"), builder.append_basic_block("after")
                builder.cbranch(builder.icmp_signed(">", tail, ir.Constant(I32, 0)), part, after)
                builder.position_at_end(part)
                new = step(value, at)
                end = builder.block
                builder.branch(after)
                builder.position_at_end(after)
                out = builder.phi(value.type)
                out.add_incoming(value, entry)
                out.add_incoming(new, end)
                return out

            for h in range(group):
                row = const(h)
                base = builder.mul(row, width)
                first = builder.load(builder.gep(sc.data, [base]))
                top0 = splat(builder, first, _V16)

                def max_tile(i: Any, carried: list[Any]) -> list[Any]:
                    x = builder.load(vec(sc.data, builder.add(base, i)), align=4)
                    return [builder.select(builder.fcmp_ordered(">", x, carried[0]), x, carried[0])]
                (vmax,) = counted(builder, const(0), whole, LANES, [top0], max_tile)

                def max_tail(m: Any, at: Any) -> Any:
                    x = builder.load(vec(sc.data, builder.add(base, at)), align=4)
                    return builder.select(builder.and_(mask, builder.fcmp_ordered(">", x, m)), x, m)
                vmax = with_tail(vmax, whole, max_tail)
                top = builder.extract_element(vmax, ir.Constant(I32, 0))
                for j in range(1, LANES):
                    x = builder.extract_element(vmax, ir.Constant(I32, j))
                    top = builder.select(builder.fcmp_ordered(">", x, top), x, top)
                top = builder.fmul(top, scale_)
                top_v = splat(builder, top, _V16)

                def exp_at(at: Any, masked: bool = False) -> Any:
                    x = builder.load(vec(sc.data, builder.add(base, at)), align=4)
                    e = _exp(builder, builder.call(fma16(builder), [x, scale_v, builder.fneg(top_v)]))
                    e = builder.select(mask, e, zero) if masked else e
                    builder.store(e, vec(pr.data, builder.add(base, at)), align=4)
                    if pairs:
                        words = builder.gep(bfa.data, [builder.add(builder.mul(row, builder.udiv(width, const(2))),
                                                                   builder.udiv(at, const(2)))])
                        builder.store(bf16_pairs(builder, e), builder.bitcast(words, _V8I.as_pointer()), align=4)
                    return e

                (lanes,) = counted(builder, const(0), whole, LANES, [zero],
                                    lambda i, carried: [builder.fadd(carried[0], exp_at(i))])
                lanes = with_tail(lanes, whole, lambda acc, at: builder.fadd(acc, exp_at(at, masked=True)))
                total = builder.extract_element(lanes, ir.Constant(I32, 0))
                for j in range(1, LANES):
                    total = builder.fadd(total, builder.extract_element(lanes, ir.Constant(I32, j)))
                builder.store(top, builder.gep(tp.data, [row]))
                builder.store(total, builder.gep(tt.data, [row]))
            return context.get_dummy_value()

        return types.void(scores, count, scale, probs, bf, tops, totals), codegen

    return fixed(softmax, f"qattention.softmax.{group}.{'pairs' if pairs else 'floats'}")


JOBS = 16  # jobs a sequence's attention is cut into at least, when its rows allow (a constant: a pass
# that asked numba for its thread count was not found again in numba's cache by the next process)
BLOCK = 1024  # positions per part: its keys and values (128 KB each at 64 dims) stay in L2 for every row
_ATTEND: dict[tuple[int, int, int, str, str, str], Any] = {}


def attention(group: int, dim: int, block: int = BLOCK, keys: str = "q8", family: str | None = None,
              values: str | None = None) -> Any:
    """attend(q [S, H, D], keys, values, layer, starts [Q + 1], n0s [Q], alloweds, scale, out [S, H, D])
    for H / Hkv = `group` and D = `dim`, keys kept as `keys` (keys.KEYS) and values as `values`
    (values.FORMATS), int8 keys and bfloat16 values summed by the instruction-set `family`'s dots
    (default: the target's; every family gives the same bits; compiled on first use): the rows of Q sequences
    (sequence q's rows starts[q]..starts[q+1]-1, its cache keys[q][layer] [Hkv, C / 16, rows, 16]
    (key_layout) and values[q][layer] [Hkv, C / 16, rows, width] (value_layout) holding n0s[q]
    entries then its new rows', their visibility
    alloweds[q] [S_q, S_q]); out[s, h] = softmax(q[s, h] . K * scale) V over the keys row s may
    see (the module's docstring).

    Split by position into parts of `block` (a multiple of 16) fixed from position 0, so a row's
    arithmetic depends on its own visible keys alone: one parallel job per (sequence, key head,
    part) takes every row of the sequence that sees the part, row after row, so the part's keys
    and values come from memory once a pass and from L2 for the other rows. A part gives each
    row-head its maximum m, its sum l and its unnormalised values a (as one two-pass softmax over
    the part); the parts are combined in order: out = sum_p e^(m_p - M) a_p / sum_p e^(m_p - M) l_p."""
    family, values = family or isa(), values or default_values()
    key_layout(dim, keys), value_layout(dim, values)  # known formats
    key = (group, dim, block, keys, values, family)
    if key in _ATTEND:
        return _ATTEND[key]
    quantized = keys == "q8"
    scores_fn = scores_kernel(keys, group, dim, family)
    values_bf16 = values == "bf16"
    weighted_fn, softmax_fn = weighted_kernel(values, group, dim, family), _softmax_kernel(group, values_bf16)
    copy_value = value_copy(values)

    @njit(nogil=True)
    def part(q, qw, qd, qs, keys, values, n_cached, allowed, lead, fresh, first, row0, row1, g, p, scale, pm, pl,
             pacc):  # pragma: no cover - compiled
        """Part p (positions p * block ..) of kv head g for the rows row0..row1-1 of one sequence that
        see it (rows first.., their leading run of visible new entries lead[s] and count fresh[s]).
        A row's visible positions: its cache's first n_cached + lead[s] entries as they lie,
        then its other visible new entries, gathered. qw, qd, qs: every query head's int8 form
        (int8 keys), column (row, head)."""
        rows, heads = allowed.shape[0], q.shape[1]
        a = p * block
        qg = np.empty((group, dim), dtype=np.float32)
        cached = np.empty((group, block), dtype=np.float32)
        new = np.empty((group, block), dtype=np.float32)
        probs = np.empty((group, block), dtype=np.float32)
        pairs = np.empty((group, block // 2 if values_bf16 else 0), dtype=np.uint32)  # probs as bfloat16 pairs
        tops, totals = np.empty(group, dtype=np.float32), np.empty(group, dtype=np.float32)
        acc = np.empty((group, dim), dtype=np.float32)
        key_rows = keys.shape[2]
        new_keys = np.empty((1, 0, key_rows, LANES), dtype=keys.dtype)  # made when a row first gathers (a tree's branch)
        new_values = np.empty((1, 0, values.shape[2], values.shape[3]), dtype=values.dtype)
        key_part, value_part = keys[g:g + 1, a // LANES:], values[g:g + 1, a // LANES:]
        for s in range(row0, row1):
            contiguous = n_cached + lead[first + s]
            visible = n_cached + fresh[first + s]
            if visible <= a:
                continue
            end = min(a + block, visible)
            num_in_place = max(min(end, contiguous) - a, 0)
            num_gathered = end - a - num_in_place
            if num_gathered > 0 and new_keys.shape[1] == 0:  # unused lanes of a tile are scored and never read
                new_keys = np.empty((1, block // LANES, key_rows, LANES), dtype=keys.dtype)
                new_values = np.zeros((1, block // LANES, values.shape[2], values.shape[3]), dtype=values.dtype)
            # values in tiles of the row's own positions: the in-place ones of the tile its first
            # gathered entry falls in go beside the gathered ones (split: where the copy starts)
            split = num_in_place if num_gathered == 0 else num_in_place // LANES * LANES
            for j in range(split, num_in_place):
                copy_value(new_values, 0, j - split, values, g, a + j)
            if num_gathered > 0:  # the row's visible new entries past its leading run, from position max(a, contiguous)
                skip = max(a, contiguous) - contiguous
                f = 0
                for i in range(lead[first + s] + 1, rows):
                    if allowed[s, i]:
                        if f >= skip and f < skip + num_gathered:
                            at, src = f - skip, n_cached + i
                            for r in range(key_rows):
                                new_keys[0, at // LANES, r, at % LANES] = keys[g, src // LANES, r, src % LANES]
                            copy_value(new_values, 0, num_in_place - split + at, values, g, src)
                        f += 1
            if not quantized:  # int8 keys read the query's int8 form (qw, qd, qs) instead
                for h in range(group):
                    for d in range(dim):
                        qg[h, d] = q[first + s, g * group + h, d]
            col0 = np.int64((first + s) * heads + g * group)
            count = num_in_place + num_gathered
            if num_in_place > 0:
                scores_fn(key_part, np.int64(0), qg, qw, qd, qs, col0, cached, np.int64(num_in_place))
            if num_gathered > 0:
                scores_fn(new_keys, np.int64(0), qg, qw, qd, qs, col0, new, np.int64(num_gathered))
                for h in range(group):  # beside the row's scores in place (over a tile's unused lanes)
                    for j in range(num_gathered):
                        cached[h, num_in_place + j] = new[h, j]
            softmax_fn(cached, np.int64(count), scale, probs, pairs, tops, totals)
            for h in range(group):
                pm[first + s, g * group + h, p] = tops[h]
                pl[first + s, g * group + h, p] = totals[h]
                for d in range(dim):
                    acc[h, d] = np.float32(0.0)
            weighted_fn(value_part, np.int64(0), probs, pairs, np.int64(0), np.int64(split), acc)
            if num_gathered > 0:
                weighted_fn(new_values, np.int64(0), probs, pairs, np.int64(split), np.int64(count - split), acc)
            for h in range(group):
                for d in range(dim):
                    pacc[first + s, g * group + h, p, d] = acc[h, d]

    @njit(nogil=True)
    def combine(s, h, parts, pm, pl, pacc, out, shifted, weights, ibuf):  # pragma: no cover - compiled
        """out[s, h] from row s's `parts` parts of head h, in order."""
        top = pm[s, h, 0]
        for p in range(1, parts):
            top = max(top, pm[s, h, p])
        for p in range(parts):
            shifted[p] = pm[s, h, p] - top
        exp_rows(shifted[:parts], weights, ibuf)
        total = np.float32(0.0)
        for p in range(parts):
            total += weights[p] * pl[s, h, p]
        for d in range(dim):
            v = np.float32(0.0)
            for p in range(parts):
                v += weights[p] * pacc[s, h, p, d]
            out[s, h, d] = v / total

    @njit(parallel=True, nogil=True)
    def attend(q, keys, values, layer, starts, n0s, alloweds, scale, out):  # pragma: no cover - compiled
        kv_heads = keys[0][layer].shape[0]
        seqs, total_rows, heads = len(n0s), starts[len(n0s)], q.shape[1]
        lead = np.zeros(total_rows, dtype=np.int64)  # a row's leading run of visible new entries
        fresh = np.zeros(total_rows, dtype=np.int64)  # and all its visible new entries
        jobs = np.zeros(seqs + 1, dtype=np.int64)  # sequence q's jobs: jobs[q] .. jobs[q + 1] - 1
        nparts, chunks = np.zeros(seqs, dtype=np.int64), np.zeros(seqs, dtype=np.int64)
        most = 1
        for sq in range(seqs):
            allowed, widest = alloweds[sq], 0
            for s in range(allowed.shape[0]):
                run = 0
                while run < allowed.shape[1] and allowed[s, run]:
                    run += 1
                n = run
                for i in range(run + 1, allowed.shape[1]):
                    n += allowed[s, i]
                lead[starts[sq] + s], fresh[starts[sq] + s] = run, n
                widest = max(widest, n)
            nparts[sq] = (n0s[sq] + widest + block - 1) // block
            most = max(most, nparts[sq])
            # few parts (a short context) and many rows: the rows split among jobs too (a row's
            # arithmetic is the same in any job; the part's keys are then read once per chunk)
            chunks[sq] = min(allowed.shape[0], max(1, -(-JOBS // (kv_heads * nparts[sq]))))
            jobs[sq + 1] = jobs[sq] + kv_heads * nparts[sq] * chunks[sq]
        nq = total_rows * heads if quantized else 1  # every query head in int8 (int8 keys), once a pass
        q8 = np.empty((dim // 4, nq, 4), dtype=np.int8)
        qd, qx = np.empty((dim // 32, nq), dtype=np.float32), np.empty((dim // 32, nq), dtype=np.float32)
        qs = np.empty((dim // 16, nq), dtype=np.int32)
        if quantized:
            quantize_rows(np.ascontiguousarray(q).reshape((nq, dim)), q8, qd, qs, qx)
        qw = q8.view(np.int32).reshape((dim // 4, nq))
        pm = np.empty((total_rows, heads, most), dtype=np.float32)
        pl = np.empty((total_rows, heads, most), dtype=np.float32)
        pacc = np.empty((total_rows, heads, most, q.shape[2]), dtype=np.float32)
        for job in prange(jobs[seqs]):
            sq = 0
            while jobs[sq + 1] <= job:
                sq += 1
            local, per_head = job - jobs[sq], nparts[sq] * chunks[sq]
            rows, chunk = starts[sq + 1] - starts[sq], local % per_head % chunks[sq]
            part(q, qw, qd, qs, keys[sq][layer], values[sq][layer], n0s[sq], alloweds[sq], lead, fresh, starts[sq],
                 chunk * rows // chunks[sq], (chunk + 1) * rows // chunks[sq], local // per_head,
                 local % per_head // chunks[sq], scale, pm, pl, pacc)
        shifted, weights, ibuf = np.empty(most, np.float32), np.empty(most, np.float32), np.empty(most, np.int32)
        for sq in range(seqs):
            for s in range(starts[sq], starts[sq + 1]):
                num = (n0s[sq] + fresh[s] + block - 1) // block
                for h in range(heads):
                    combine(s, h, num, pm, pl, pacc, out, shifted, weights, ibuf)

    name = ".".join(str(k) for k in key)
    fixed(part, f"qattention.part.{name}")
    fixed(combine, f"qattention.combine.{name}")
    _ATTEND[key] = fixed(attend, f"qattention.attend.{name}")
    return attend
