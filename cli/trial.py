"""The engine trial (`specx engines`, and `specx serve` in the background): specx on each engine
that can run the model, on the store's own prompts, side by side with llama.cpp's plain decoding
(core.predict.engines); the choice is kept for `--backend auto` (specx.backends)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from .core.model import cpu

from .backends import (choice_key, gguf_file, gpu_runs, kept_path, llama_verdict, quantized_runs, transformers_fits,
                       trial_lock, write_kept)
from .home import keep_cost, model_cost, specx_home, store_path

TRIAL_PROMPT_TOKENS = 768  # a conversation's first prompt: its last tokens (later calls keep the same start)
TRIAL_PROMPT_LIMIT = 2048  # a conversation's calls are replayed while their prompts stay within this
TRIAL_CALLS_PER_CONVERSATION = 3
TRIAL_REQUESTS = 6  # calls per trial (the first untimed)
TRIAL_MAX_TOKENS = 48
PREFIX_CACHE_TOKENS = 8192  # as `specx serve`'s default --prefix-cache-tokens

# Prompts for a trial when the store has none of its own: agent-like, their answers repeat the prompt
# (a schema's names, earlier SQL, a JSON shape), as agents' outputs do.
_SCHEMA = "CREATE TABLE singer (singer_id INT, name TEXT, country TEXT, song_name TEXT, age INT);\n" \
          "CREATE TABLE concert (concert_id INT, concert_name TEXT, stadium_id INT, year INT);\n"
_SHOTS = "".join(f"-- {q}\nSELECT {c} FROM singer WHERE age > {a};\n" for q, c, a in [
    ("Names of singers older than 30", "name", 30), ("Countries of singers older than 40", "country", 40),
    ("Songs of singers older than 20", "song_name", 20)])
PROMPTS = tuple(f"{_SCHEMA}{_SHOTS}-- {q}\nAnswer with one SQL query." for q in (
    "Names and countries of singers older than 35", "Concert names of the year 2014",
    "Songs of singers from France older than 25", "How many singers are older than 50",
    "Names of singers older than 60, oldest first")) + (
    'Answer with JSON only, {"name": "search", "arguments": {"query": ...}}, to look up who wrote Hamlet.',)


@dataclass
class Trial:
    """A trial's outcome: `data` (what --json prints), each method's figures (core.predict.engines),
    the choice, whether it was kept, and the trial lock (held while this is: until the command ends)."""
    data: dict[str, Any]
    figures: dict[str, Any]
    choice: Any
    kept: bool
    lock: Any = None


def run_trial(model: str, db: Path | None, requests: int, max_tokens: int, say: Callable[[str], None],
              progress: Callable[[], Any]) -> Trial:
    """`specx engines`' trial (its help says what it does): each engine that can run `model` here,
    timed on the store's latest conversations (`db`; built-in prompts without one), the choice kept
    for `--backend auto` unless the machine was disturbed. `say` hears what happens; `progress`
    makes the bar the requests advance (the CLI's output.progress)."""
    from .core.decode.generate import generate
    from .core.decode.loop import collect
    from .core.decode.request import Decoding
    from .core.decode.speculate import SuffixDrafter
    from .core.model import llamacpp
    from .core.model.load import ModelError, load_backend, load_tokenizer
    from .core.predict.engines import REFERENCE, choose, specx_method, timed, trial

    from .core.predict.disturbance import others_share, sample

    lock = trial_lock(say)  # held while the Trial returned is
    if lock is None:
        raise ModelError("another engine trial is running on this machine (`specx serve` starts one in the background "
                         "when no choice was made): try again when it ends")
    if db is not None:
        trial_store(db)
    path = gguf_file(model)
    if path is None:
        raise ModelError(f"{model!r} is not a GGUF model: it runs on transformers only, there is nothing to choose")
    if not path.is_file():
        raise ModelError(f"no such GGUF file: {path}")
    engines = []
    verdict = None
    if llamacpp.available():
        verdict = llama_verdict(path, say)
        say(verdict.message)
        if verdict.ok:
            engines.append("llama.cpp")
    else:
        say("llama.cpp: llama-cpp-python is not installed (make setup builds it)")
    if transformers_fits(path):
        engines.append("transformers")
    if quantized_runs(path, say):
        engines.append("quantized")
    if gpu_runs(path, say):  # only where a CUDA GPU is
        engines.append("gpu")
    if not engines:
        raise ModelError(f"no engine can run {model} here")
    tok = load_tokenizer(model, specx_home() / "models")
    global_index, prompts, source = _trial_prompts(tok, store_path(db), requests)
    shared = sum(_common(a, b) for a, b in zip(prompts, prompts[1:]))
    say(f"trial: {len(prompts)} prompts ({source}; {sum(map(len, prompts)):,} tokens, {shared:,} of them the start "
        f"of the call before; the first untimed), at most {max_tokens} tokens each, on {', '.join(engines)}")
    eos = tok.eos_token_id
    settings = Decoding(max_new_tokens=max_tokens, eos_token_ids=eos)
    runners, costs = {}, []
    for engine in engines:
        net, _ = load_backend(model, specx_home() / "models", engine)
        cost = model_cost(net, model, say)
        costs.append(cost)
        drafter = SuffixDrafter(global_index)
        net.tune_threads(cost.shape, say)
        cache = net.new_prefix_cache(PREFIX_CACHE_TOKENS)
        runners[specx_method(engine)] = (lambda net, drafter, cost, cache: lambda prompt: timed(generate(
            net, prompt, drafter, settings, cost=cost, learn=False, prefix_cache=cache),
            collect))(net, drafter, cost, cache)
    if "llama.cpp" in engines:
        runners[REFERENCE] = _stock_llama_runner(path, max_tokens, eos)
    with progress() as bar:
        task = bar.add_task("trial: requests x methods", total=len(prompts) * len(runners))
        before = sample()
        figures = trial(runners, prompts, warmup=1, on_request=lambda: bar.advance(task))
        disturbed = others_share(before, sample())
    for cost in costs:
        keep_cost(cost, say)
    choice = choose(figures, engines)
    kept = keep_choice(choice, choice_key(model, path), disturbed, say)
    identical = None
    if REFERENCE in figures and specx_method("llama.cpp") in figures:
        identical = sum(a == b for a, b in zip(figures[REFERENCE].outputs, figures[specx_method("llama.cpp")].outputs))
    data = {"model": model, "cpu": cpu.model_name(), "isa": cpu.instruction_sets(), "engines": engines,
            "probe": verdict.to_json() if verdict else None, "prompts": source, "choice": choice.to_json(),
            "identical_llama_cpp": identical, "requests_timed": len(prompts) - 1, "kept": kept,
            "others_cpu_share": disturbed}
    return Trial(data, figures, choice, kept, lock)


def keep_choice(choice: Any, key: dict[str, Any], disturbed: float | None, say: Callable[[str], None]) -> bool:
    """Keep a trial's choice for `--backend auto`, unless other processes held more than
    DISTURBED_SHARE of the cores while it ran (`disturbed`, core.predict.disturbance): then say
    so and keep nothing, and the next start measures again. Whether it was kept."""
    from .core.predict.disturbance import DISTURBED_SHARE

    if disturbed is not None and disturbed > DISTURBED_SHARE:
        say(f"the trial was disturbed: other processes held {disturbed:.0%} of this machine's {os.cpu_count()} cores "
            f"while it ran, so its figures are not kept; the next start (or `specx engines` on a quiet machine) "
            f"measures again")
        return False
    write_kept(kept_path("choice", key), {"key": key, "choice": choice.to_json(), "at": time.time()}, say)
    return True


def trial_store(db: Path) -> None:
    """Refuse, in one line (StoreError), a `--db` that is not an existing specx store: a trial on
    a missing path, a folder or /dev/null would run on the built-in prompts and keep that choice as
    the workload's, and an empty file would become a store."""
    from .store.db import Store, StoreError

    if not db.exists():
        raise StoreError(f"{db}: no such store (pass the store the workload was ingested into)")
    if not db.is_file():
        raise StoreError(f"{db}: not a store file")
    with Store(db, readonly=True):  # StoreError: not a specx store, newer, or damaged
        pass


def _trial_prompts(tok: Any, db: Path, requests: int) -> tuple[Any, list[list[int]], str]:
    """The global index and the trial's prompts: the store's latest conversations for this
    tokenizer (`_conversations`), else the built-in prompts."""
    from .core.index.suffix_index import SuffixIndex
    from .core.model.chat import render_prompt
    from .core.model.load import tokenizer_fingerprint

    if db.is_file():
        from .store.db import Store
        from .store.index import index_for
        from .store.prompts import model_prompts
        from .store.selection import select_calls

        with Store(db, readonly="auto") as store:
            fingerprint = tokenizer_fingerprint(tok)
            index = index_for(store, fingerprint)
            tokenizer_id = store.tokenizer_id(fingerprint)
            if tokenizer_id is not None:
                calls = select_calls(store, tokenizer_id)
                latest = set(list(dict.fromkeys(c.session_id for c in calls))[-4 * requests:])
                firsts = []
                taken: dict[int, int] = {}  # each latest session's first calls: where its conversation starts
                for call in [c for c in calls if c.session_id in latest]:
                    if taken.get(call.session_id, 0) <= TRIAL_CALLS_PER_CONVERSATION:
                        taken[call.session_id] = taken.get(call.session_id, 0) + 1
                        firsts.append(call)
                calls = firsts
                calls, prompts = model_prompts(store, tok, calls, 1 << 30)
                prompts = _conversations([c.session_id for c in calls], prompts, requests)
                if len(prompts) >= 2:
                    return index, prompts, f"the latest stored conversations of {db}"
    else:
        index = SuffixIndex()
    prompts = [tok.encode(render_prompt(tok, [{"role": "user", "content": p}], generation_prompt=True),
                          add_special_tokens=False) for p in PROMPTS]
    return index, [list(p) for p in (prompts * requests)[:requests]], "built-in prompts: the store has none"


def _conversations(sessions: list[int], prompts: list[list[int]], requests: int,
                   window: int = TRIAL_PROMPT_TOKENS, limit: int = TRIAL_PROMPT_LIMIT,
                   per_conversation: int = TRIAL_CALLS_PER_CONVERSATION) -> list[list[int]]:
    """Up to `requests` prompts replayed as agents send them: the latest conversations' consecutive
    calls (up to `per_conversation` each), in order. A conversation is a run of calls of one session
    each of which starts with (90% of) the prompt before it; conversations of several calls come
    first. Its prompts all lose the tokens its first one loses to keep its last `window`, so each
    still starts as the one before it did (what a prefix cache reuses); its calls stop where a
    prompt outgrows `limit`.

    >>> _conversations([1, 1, 2, 2, 2, 3], [[1, 2], [1, 2, 3], [7], [7, 8], [7, 8, 9], [5]], 9, window=1, limit=2)
    [[2], [2, 3], [7], [7, 8], [5]]
    """
    chains: list[list[list[int]]] = []
    for i, (session, prompt) in enumerate(zip(sessions, prompts)):
        before = prompts[i - 1] if i else []
        if i and sessions[i - 1] == session and _common(before, prompt) >= 0.9 * len(before):
            chains[-1].append(prompt)
        else:
            chains.append([prompt])
    latest = sorted(range(len(chains)), key=lambda c: (len(chains[c]) > 1, c), reverse=True)
    chosen: dict[int, list[list[int]]] = {}
    for c in latest:
        own = chains[c]
        cut = max(0, len(own[0]) - window)
        run = [p[cut:] for p in own[:per_conversation]]
        while run and len(run[-1]) > limit:
            run.pop()
        chosen[c] = run
        if sum(map(len, chosen.values())) >= requests:
            break
    return [p for c in sorted(chosen) for p in chosen[c]][:requests]


def _common(a: list[int], b: list[int]) -> int:
    """How many tokens b starts with that a started with."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stock_llama_runner(path: Path, max_tokens: int, eos: int) -> Callable[[list[int]], Any]:
    """llama-cpp-python's own plain decoding (`Llama.generate`, greedy) on every core, with the KV
    cache specx uses (Q8_0: the same tokens), timed as core.predict.engines.Request."""
    from llama_cpp import Llama

    from .core.model.llamacpp import CACHE_TYPES
    from .core.predict.engines import Request

    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, flash_attn=True,
                type_k=CACHE_TYPES["q8_0"],
                type_v=CACHE_TYPES["q8_0"], verbose=False)

    def run(prompt: list[int]) -> Request:
        out: list[int] = []
        t0 = time.perf_counter()
        t1 = None
        for tok in llm.generate(prompt, temp=0.0, top_k=1):
            t1 = t1 or time.perf_counter()
            out.append(int(tok))
            if tok == eos or len(out) == max_tokens:
                break
        end = time.perf_counter()
        return Request(out, len(out), (t1 or end) - t0, end - (t1 or end), 1 if out else 0)

    return run
