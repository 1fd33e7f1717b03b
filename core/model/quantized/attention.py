"""Attention for the quantized engine, exact whatever pass a row is in (core/model/quantized/forward.py).

A query row attends to the cached entries and to the new entries its `allowed` row marks. Its
visible keys are its sequence's positions 0, 1, ... in order (a tree's accepted path is its
ancestors), so every sum runs over them in one fixed order, whichever pass the row is in.

Keys and values are kept as float16 (their bits, uint16: half the memory traffic of float32,
llama.cpp's default too) and widened to float32 as they are read.

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
- softmax: the maximum m (exact in any order), core.model.quantized.forward.exp_rows, and the sum
  l in 16 lanes by position, combined in order.
- values: a = sum_j p_j v_j with the head dimension in vector registers, a multiply-add chain over
  the part's visible keys in order (`_weighted`); a key head's query heads side by side (one load
  of each value vector, more chains in flight).

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
from .forward import exp_rows
from .ir import F32, I64, load_halves, loop_back, splat
from .ir import fma as fma16

configure_numba_cache()

LANES = 16  # keys per vector; the softmax's denominator is summed in this many lanes by position
_V16 = ir.VectorType(F32, LANES)


def _scores_kernel(group: int) -> Any:
    """scores(kt [Hkv, C / 16, D, 16] float16 bits, g, q [G, D], out [G, W], count): out[h, j] = q[h] . key j of
    head g (kt[g, j // 16, :, j % 16]) for j < count rounded up to 16 (C and W at least that),
    h < G = `group`. Two tiles of 16 keys at a time (2 G multiply-add chains in flight, each key's
    own chain over the head dimension in order), then the odd tile alone."""

    @intrinsic
    def scores(typingctx, kt, g, q, out, count):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            kt_a, q_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3))
            g_, count_ = args[1], args[4]
            tiles = builder.extract_value(kt_a.shape, 1)
            dim = builder.extract_value(kt_a.shape, 2)
            width = builder.extract_value(out_a.shape, 1)
            const = lambda v: ir.Constant(I64, v)  # noqa: E731
            fma = fma16(builder)
            blocks = builder.udiv(builder.add(count_, const(LANES - 1)), const(LANES))
            pairs = builder.mul(builder.udiv(blocks, const(2)), const(2))

            def tiles_loop(span: int, first: Any, limit: Any) -> None:
                """Tiles first, first + span, ... while below `limit`, `span` tiles an iteration."""
                entry = builder.block
                outer, inner, after, done = (builder.append_basic_block(f"{n}{span}")
                                             for n in ("outer", "inner", "after", "done"))
                builder.cbranch(builder.icmp_signed("<", first, limit), outer, done)
                builder.position_at_end(outer)
                jb = builder.phi(I64)
                jb.add_incoming(first, entry)
                outer_block = builder.block
                builder.branch(inner)
                builder.position_at_end(inner)
                d = builder.phi(I64)
                d.add_incoming(const(0), outer_block)
                acc = [builder.phi(_V16) for _ in range(span * group)]
                for a in acc:
                    a.add_incoming(ir.Constant(_V16, None), outer_block)
                qs = [splat(builder, builder.load(builder.gep(q_a.data, [builder.add(builder.mul(const(h), dim), d)])),
                            _V16) for h in range(group)]
                new = []
                for t in range(span):
                    tile = builder.add(builder.mul(g_, tiles), builder.add(jb, const(t)))
                    keys = load_halves(builder, kt_a.data,
                                       builder.mul(builder.add(builder.mul(tile, dim), d), const(LANES)))
                    new += [builder.call(fma, [qs[h], keys, acc[t * group + h]]) for h in range(group)]
                loop_back(builder, d, const(1), dim, inner, after, zip(acc, new))
                for t in range(span):
                    j = builder.mul(builder.add(jb, const(t)), const(LANES))
                    for h in range(group):
                        at = builder.add(builder.mul(const(h), width), j)
                        builder.store(new[t * group + h], builder.bitcast(builder.gep(out_a.data, [at]),
                                                                          _V16.as_pointer()), align=4)
                loop_back(builder, jb, const(span), limit, outer, done)

            tiles_loop(2, const(0), pairs)
            tiles_loop(1, pairs, blocks)
            return context.get_dummy_value()

        return types.void(kt, g, q, out, count), codegen

    return fixed(scores, f"qattention.scores.{group}")


def _weighted_kernel(dim: int, group: int) -> Any:
    """weighted(v [Hkv, C, D] float16 bits, g, p [G, W], start, count, acc [G, D]): acc[h] += sum over
    j < count of p[h, start + j] v[g, j] for h < G = `group` (acc read first, written after), D =
    `dim`, a multiple of 16. Each head's sum runs over j in order (its own chains of D / 16
    multiply-adds); the group's heads share each value vector's load and keep G x D / 16 chains
    going at once."""
    vectors = dim // LANES

    @intrinsic
    def weighted(typingctx, v, g, p, start, count, acc):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            v_a, p_a, acc_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 5))
            g_, start_, count_ = args[1], args[3], args[4]
            cap = builder.extract_value(v_a.shape, 1)
            width = builder.extract_value(p_a.shape, 1)
            const = lambda c: ir.Constant(I64, c)  # noqa: E731
            fma = fma16(builder)
            ptr = lambda base, idx: builder.bitcast(builder.gep(base, [idx]), _V16.as_pointer())  # noqa: E731
            at = lambda h, i: const(h * dim + LANES * i)  # noqa: E731 - acc[h, 16 i]
            first = [builder.load(ptr(acc_a.data, at(h, i)), align=4) for h in range(group) for i in range(vectors)]
            entry = builder.block
            loop, done = builder.append_basic_block("loop"), builder.append_basic_block("done")
            builder.cbranch(builder.icmp_signed(">", count_, const(0)), loop, done)
            builder.position_at_end(loop)
            j = builder.phi(I64)
            j.add_incoming(const(0), entry)
            acc = [builder.phi(_V16) for _ in range(group * vectors)]
            for a, f in zip(acc, first):
                a.add_incoming(f, entry)
            row = builder.mul(builder.add(builder.mul(g_, cap), j), const(dim))
            value = [load_halves(builder, v_a.data, builder.add(row, const(LANES * i))) for i in range(vectors)]
            new = []
            for h in range(group):
                pj = builder.add(builder.mul(const(h), width), builder.add(start_, j))
                weight = splat(builder, builder.load(builder.gep(p_a.data, [pj])), _V16)
                new += [builder.call(fma, [weight, value[i], acc[h * vectors + i]]) for i in range(vectors)]
            loop_back(builder, j, const(1), count_, loop, done, zip(acc, new))
            final = [builder.phi(_V16) for _ in range(group * vectors)]
            for f, a, n in zip(final, first, new):
                f.add_incoming(a, entry)
                f.add_incoming(n, loop)
            for h in range(group):
                for i in range(vectors):
                    builder.store(final[h * vectors + i], ptr(acc_a.data, at(h, i)), align=4)
            return context.get_dummy_value()

        return types.void(v, g, p, start, count, acc), codegen

    return fixed(weighted, f"qattention.weighted.{dim}.{group}")


JOBS = 16  # jobs a sequence's attention is cut into at least, when its rows allow (a constant: a pass
# that asked numba for its thread count was not found again in numba's cache by the next process)
BLOCK = 1024  # positions per part: its keys and values (128 KB each at 64 dims) stay in L2 for every row
_ATTEND: dict[tuple[int, int, int], Any] = {}


def attention(group: int, dim: int, block: int = BLOCK) -> Any:
    """attend(q [S, H, D], keys, values, layer, starts [Q + 1], n0s [Q], alloweds, scale, out [S, H, D])
    for H / Hkv = `group` and D = `dim` (compiled on first use): the rows of Q sequences (sequence
    q's rows starts[q]..starts[q+1]-1, its cache keys[q][layer] [Hkv, C / 16, D, 16] and
    values[q][layer] [Hkv, C, D] holding n0s[q] entries then its new rows', their visibility
    alloweds[q] [S_q, S_q]); out[s, h] = softmax(q[s, h] . K * scale) V over the keys row s may
    see (the module's docstring).

    Split by position into parts of `block` (a multiple of 16) fixed from position 0, so a row's
    arithmetic depends on its own visible keys alone: one parallel job per (sequence, key head,
    part) takes every row of the sequence that sees the part, row after row, so the part's keys
    and values come from memory once a pass and from L2 for the other rows. A part gives each
    row-head its maximum m, its sum l and its unnormalised values a (as one two-pass softmax over
    the part); the parts are combined in order: out = sum_p e^(m_p - M) a_p / sum_p e^(m_p - M) l_p."""
    key = (group, dim, block)
    if key in _ATTEND:
        return _ATTEND[key]
    scores_fn, weighted_fn = _scores_kernel(group), _weighted_kernel(dim, group)

    @njit(nogil=True)
    def part(q, keys, values, n_cached, allowed, lead, fresh, first, row0, row1, g, p, scale, pm, pl,
             pacc):  # pragma: no cover - compiled
        """Part p (positions p * block ..) of kv head g for the rows row0..row1-1 of one sequence that
        see it (rows first.., their leading run of visible new entries lead[s] and count fresh[s]).
        A row's visible positions: its cache's first n_cached + lead[s] entries as they lie,
        then its other visible new entries, gathered."""
        rows = allowed.shape[0]
        a = p * block
        qg = np.empty((group, dim), dtype=np.float32)
        cached = np.empty((group, block), dtype=np.float32)
        new = np.empty((group, block), dtype=np.float32)
        row = np.empty(block, dtype=np.float32)
        probs = np.empty((group, block), dtype=np.float32)
        ibuf = np.empty(block, dtype=np.int32)
        lanes = np.empty(LANES, dtype=np.float32)
        acc = np.empty((group, dim), dtype=np.float32)
        new_keys = np.empty((1, 0, dim, LANES), dtype=np.uint16)  # made when a row first gathers (a tree's branch)
        new_values = np.empty((1, 0, dim), dtype=np.uint16)
        key_part, value_part = keys[g:g + 1, a // LANES:], values[g:g + 1, a:]
        for s in range(row0, row1):
            contiguous = n_cached + lead[first + s]
            visible = n_cached + fresh[first + s]
            if visible <= a:
                continue
            end = min(a + block, visible)
            num_in_place = max(min(end, contiguous) - a, 0)
            num_gathered = end - a - num_in_place
            if num_gathered > 0 and new_keys.shape[1] == 0:  # unused lanes of a tile are scored and never read
                new_keys = np.empty((1, block // LANES, dim, LANES), dtype=np.uint16)
                new_values = np.empty((1, block, dim), dtype=np.uint16)
            if num_gathered > 0:  # the row's visible new entries past its leading run, from position max(a, contiguous)
                skip = max(a, contiguous) - contiguous
                f = 0
                for i in range(lead[first + s] + 1, rows):
                    if allowed[s, i]:
                        if f >= skip and f < skip + num_gathered:
                            at, src = f - skip, n_cached + i
                            for d in range(dim):
                                new_keys[0, at // LANES, d, at % LANES] = keys[g, src // LANES, d, src % LANES]
                                new_values[0, at, d] = values[g, src, d]
                        f += 1
            for h in range(group):
                for d in range(dim):
                    qg[h, d] = q[first + s, g * group + h, d]
            count = num_in_place + num_gathered
            if num_in_place > 0:
                scores_fn(key_part, np.int64(0), qg, cached, np.int64(num_in_place))
            if num_gathered > 0:
                scores_fn(new_keys, np.int64(0), qg, new, np.int64(num_gathered))
            for h in range(group):
                # the maximum of the raw scores (in any order, the same), then scaled: rounding is
                # monotonic, so it is the maximum of the scaled scores, one pass sooner
                top = cached[h, 0] if num_in_place > 0 else new[h, 0]
                for j in range(LANES):
                    lanes[j] = top
                for jb in range(0, num_in_place // LANES * LANES, LANES):
                    for j in range(LANES):
                        lanes[j] = max(lanes[j], cached[h, jb + j])
                for j in range(num_in_place // LANES * LANES, num_in_place):
                    lanes[0] = max(lanes[0], cached[h, j])
                for j in range(num_gathered):
                    lanes[0] = max(lanes[0], new[h, j])
                for j in range(LANES):
                    top = max(top, lanes[j])
                top = top * scale
                for j in range(num_in_place):
                    row[j] = cached[h, j] * scale - top
                for j in range(num_gathered):
                    row[num_in_place + j] = new[h, j] * scale - top
                whole = count // LANES * LANES
                exp_rows(row[:count], probs[h], ibuf)
                for j in range(LANES):
                    lanes[j] = np.float32(0.0)
                for jb in range(0, whole, LANES):  # the sum: lane j % 16 by position, then the lanes in order
                    for j in range(LANES):
                        lanes[j] += probs[h, jb + j]
                for j in range(whole, count):
                    lanes[j - whole] += probs[h, j]
                total = lanes[0]
                for j in range(1, LANES):
                    total += lanes[j]
                pm[first + s, g * group + h, p] = top
                pl[first + s, g * group + h, p] = total
                for d in range(dim):
                    acc[h, d] = np.float32(0.0)
            weighted_fn(value_part, np.int64(0), probs, np.int64(0), np.int64(num_in_place), acc)
            weighted_fn(new_values, np.int64(0), probs, np.int64(num_in_place), np.int64(num_gathered), acc)
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
        pm = np.empty((total_rows, heads, most), dtype=np.float32)
        pl = np.empty((total_rows, heads, most), dtype=np.float32)
        pacc = np.empty((total_rows, heads, most, q.shape[2]), dtype=np.float32)
        for job in prange(jobs[seqs]):
            sq = 0
            while jobs[sq + 1] <= job:
                sq += 1
            local, per_head = job - jobs[sq], nparts[sq] * chunks[sq]
            rows, chunk = starts[sq + 1] - starts[sq], local % per_head % chunks[sq]
            part(q, keys[sq][layer], values[sq][layer], n0s[sq], alloweds[sq], lead, fresh, starts[sq],
                 chunk * rows // chunks[sq], (chunk + 1) * rows // chunks[sq], local // per_head,
                 local % per_head // chunks[sq], scale, pm, pl, pacc)
        shifted, weights, ibuf = np.empty(most, np.float32), np.empty(most, np.float32), np.empty(most, np.int32)
        for sq in range(seqs):
            for s in range(starts[sq], starts[sq + 1]):
                num = (n0s[sq] + fresh[s] + block - 1) // block
                for h in range(heads):
                    combine(s, h, num, pm, pl, pacc, out, shifted, weights, ibuf)

    fixed(part, f"qattention.part.{group}.{dim}.{block}")
    fixed(combine, f"qattention.combine.{group}.{dim}.{block}")
    _ATTEND[key] = fixed(attend, f"qattention.attend.{group}.{dim}.{block}")
    return attend
