"""Brute-force reference for the suffix index and the drafter: plain Python over token lists.

Slow and obviously right; the compiled index must agree with it exactly (same counts, same
drafts, same float arithmetic for D).
"""

from __future__ import annotations

import heapq
from collections import Counter


def occurrences(docs: list[list[int]], pattern: list[int]) -> list[tuple[int, int]]:
    p = len(pattern)
    return [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - p + 1) if doc[i : i + p] == pattern]


def count(docs: list[list[int]], pattern: list[int]) -> int:
    return len(occurrences(docs, pattern))


def children(docs: list[list[int]], pattern: list[int]) -> dict[int, int]:
    c: Counter[int] = Counter()
    for d, i in occurrences(docs, pattern):
        if i + len(pattern) < len(docs[d]):
            c[docs[d][i + len(pattern)]] += 1
    return dict(sorted(c.items()))


def expand(docs, pattern, max_spec, min_prob, tree):
    """Best-first growth below `pattern`: (tokens, parents, probs, score)."""
    tokens, parents, probs = [], [], []
    score = 0.0
    heap: list[tuple[float, int, list[int], float, int, int]] = []
    seq = 0
    node, d_node, cnt_node, draft_idx = list(pattern), 1.0, count(docs, pattern), -1
    while len(tokens) < max_spec:
        kids = sorted(children(docs, node).items(), key=lambda kv: (-kv[1], kv[0]))
        if not tree:
            kids = kids[:1]
        for tok, cnt in kids:
            d = d_node * (cnt / cnt_node)
            if d >= min_prob:
                heapq.heappush(heap, (-d, seq, node + [tok], d, cnt, draft_idx))
                seq += 1
        if not heap:
            break
        _, _, node, d_node, cnt_node, parent = heapq.heappop(heap)
        tokens.append(node[-1])
        parents.append(parent)
        probs.append(d_node)
        score += d_node
        draft_idx = len(tokens) - 1
    return tokens, parents, probs, score


def speculate(docs, context, max_depth=64, max_spec_tokens=32, alpha=1.0, min_prob=0.1, tree=True,
              floor=(0.0, 0)):
    """Exhaustive over p = 1..P: (tokens, parents, probs, score, match_len) or None if nothing beats floor."""
    best = None
    best_score, best_len = floor
    for p in range(1, min(max_depth, len(context)) + 1):
        pattern = list(context[-p:])
        if count(docs, pattern) == 0:
            break
        max_spec = max(0, min(max_spec_tokens, int(p * alpha + 1e-6)))
        tokens, parents, probs, score = expand(docs, pattern, max_spec, min_prob, tree)
        if score > best_score or (score == best_score and p > best_len):
            best = (tokens, parents, probs, score, p)
            best_score, best_len = score, p
    return best


def best_path(parents: list[int], probs: list[float]) -> list[int]:
    """Nodes of the root-to-node path of a draft tree with the highest sum of D (ties: the earlier
    end node), by summing every node's path."""
    def path(i: int) -> list[int]:
        return path(parents[i]) + [i] if i >= 0 else []
    paths = [path(i) for i in range(len(parents))]
    return max(paths, key=lambda nodes: (sum(probs[j] for j in nodes), -nodes[-1]), default=[])
