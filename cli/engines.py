"""`specx engines` and `--backend auto`: which engine runs the model, proven and measured here.

Two things are kept per machine in $SPECX_HOME/engines (JSON, one file each):

- a probe verdict per machine, llama.cpp build and model (core.model.probe): llama.cpp's native code
  is run in a child process before specx first runs it in its own; a child killed by a signal
  makes `auto` run on transformers and `--backend llama.cpp` a one-line error;
- an engine choice per machine, build and model (core.predict.engines): a trial of specx on every
  engine that can hold the model, on the store's own prompts, side by side with llama.cpp's plain
  decoding. `specx engines` runs it in the foreground; `specx serve` in a child process in the
  background when there is none, and uses it from the next start.

Until a trial has run, `auto` takes the prior of the shipped measurements (docs/llamacpp.md):
for the built-in model transformers on a CPU with AVX-512 (1.53x llama.cpp there), llama.cpp
elsewhere and for other GGUF files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from specx.core.model import cpu
from specx.core.model.probe import Verdict, prove

from . import output
from .options import BackendOpt, DbOpt, JsonOpt, keep_cost, model_cost, specx_home, store_path

KEPT_MAX_BYTES = 1 << 20  # a kept verdict or choice is a few kB: anything larger is not one
TRIAL_PROMPT_TOKENS = 768  # each trial prompt's last tokens: prefill counted, the trial bounded in time
TRIAL_REQUESTS = 4  # prompts per trial (the first untimed)
TRIAL_MAX_TOKENS = 48
REVISIT_MIN_STEPS = 2000  # served steps before serve compares their tokens per step with the trial's
REVISIT_RATIO = 1.4  # ... and measures again when they differ by more than this factor
DEQUANTIZED_BYTES_PER_GGUF_BYTE = 8  # transformers holds a 4-bit GGUF's weights in float32
# Prompts for a trial when the store has none of its own (agent-like: SQL, JSON, code).
PROMPTS = (
    "Write a SQL query that lists the name and age of every singer older than 30, ordered by age.",
    'Answer with JSON only: {"tool": "search", "arguments": {"query": "..."}} for the question: who wrote Hamlet?',
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
    "List the tables of a SQL database about concerts and stadiums, then write the query for the largest stadium.",
    "Rewrite this call as JSON with keys name and arguments: search(query='weather in Paris', limit=3).",
)


# ------------------------------------------------------------------ kept files

def _kept_path(kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return specx_home() / "engines" / f"{kind}-{digest}.json"


def read_kept(path: Path, say: Callable[[str], None]) -> dict[str, Any] | None:
    """A kept JSON object (core.kept: a regular file, size-bounded, never a FIFO or a device); one
    that cannot be used is set aside with one line, and None comes back."""
    from specx.core.kept import Unusable, read_kept_json, set_aside

    try:
        data = read_kept_json(path, KEPT_MAX_BYTES)
        if data is None or isinstance(data, dict):
            return data
        why = "is not a JSON object"
    except Unusable as exc:
        why = str(exc)
    aside = set_aside(path)
    say(f"cannot use {path} ({why}): " + (f"set aside as {aside.name}" if aside else "it could not be set aside"))
    return None


def write_kept(path: Path, data: dict[str, Any], say: Callable[[str], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        if tmp.is_file():
            tmp.unlink()
        say(f"cannot keep {path} ({exc})")


# ------------------------------------------------------------------ what is there

def llama_build() -> dict[str, Any] | None:
    """What identifies the installed llama-cpp-python build (its version and its libraries' sizes
    and times), found without importing it; None when it is not installed."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    files = sorted(lib.glob("*.so*")) + sorted(lib.glob("*.dylib")) + sorted(lib.glob("*.dll"))
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    try:
        release = version("llama-cpp-python")
    except PackageNotFoundError:
        release = "unknown"
    return {"llama_cpp": release, "libraries": hashlib.sha256(repr(stats).encode()).hexdigest()[:16]}


def gguf_file(model: str) -> Path | None:
    """The GGUF file behind `model` (the built-in model's, or a .gguf path), else None."""
    from specx.core.model.load import BUILTIN, builtin_gguf

    if model in BUILTIN:
        return builtin_gguf(model)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" else None


def _model_id(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _probe_key(path: Path) -> dict[str, Any]:
    return {"machine": cpu.fingerprint(), "build": llama_build(), "model": _model_id(path)}


def llama_verdict(path: Path, say: Callable[[str], None], command: list[str] | None = None) -> Verdict:
    """Whether llama.cpp runs `path` on this machine and build: kept, else proven in a child."""
    key = _probe_key(path)
    kept_at = _kept_path("probe", key)
    kept = read_kept(kept_at, say)
    if kept is not None:
        try:
            return Verdict.from_json(kept["verdict"])
        except (KeyError, TypeError, ValueError):
            pass
    say("proving llama.cpp on this machine in a test process (once per machine, build and model) ...")
    verdict = prove("llama.cpp", path, command)
    write_kept(kept_at, {"key": key, "verdict": verdict.to_json()}, say)
    return verdict


def transformers_fits(path: Path) -> bool:
    """Whether transformers can hold the GGUF at `path` de-quantized, in half the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return True
    return path.stat().st_size * DEQUANTIZED_BYTES_PER_GGUF_BYTE <= total // 2


def choice_key(model: str, path: Path) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return {"machine": cpu.fingerprint(), "build": llama_build(), "model": model, "file": _model_id(path)} | versions


def kept_choice(model: str, path: Path, say: Callable[[str], None]) -> Any:
    """The engine choice a trial made for this model here (core.predict.engines.Choice), or None."""
    from specx.core.predict.engines import Choice

    kept = read_kept(_kept_path("choice", choice_key(model, path)), say)
    if kept is None:
        return None
    try:
        return Choice.from_json(kept["choice"])
    except (KeyError, TypeError, ValueError):
        return None


def prior_engine(model: str) -> tuple[str, str]:
    """The engine before any trial here, and why (the shipped measurements)."""
    from specx.core.model.load import BUILTIN

    if model in BUILTIN and "avx512f" in cpu.flags():
        return "transformers", "prior: the built-in model ran 1.53x faster there than on llama.cpp on an AVX-512 Xeon"
    return "llama.cpp", "prior: on AVX2 CPUs, and for GGUF files in general, llama.cpp is the faster engine"


def resolve_backend(model: str, backend: str, say: Callable[[str], None]) -> str:
    """The engine `backend` means for `model` here: llama.cpp or transformers. `auto` takes a
    trial's choice when one was made here, else the prior; llama.cpp only once a child process has
    run it without dying (else auto says why and takes transformers; an explicit llama.cpp is a
    ModelError naming the signal)."""
    from specx.core.model import llamacpp
    from specx.core.model.load import BACKENDS, ModelError

    if backend not in BACKENDS:
        raise ModelError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    path = gguf_file(model)
    if backend == "transformers" or path is None or not llamacpp.available():
        return "transformers" if backend == "auto" else backend  # load_backend names what is missing
    if not path.is_file():
        return backend if backend != "auto" else "llama.cpp"  # load_backend names the missing file
    verdict = llama_verdict(path, say)
    if not verdict.ok:
        if backend == "llama.cpp":
            raise ModelError(f"{verdict.message}; run it with --backend transformers (docs/llamacpp.md, "
                             f"\"The build\", says how to rebuild llama-cpp-python)")
        say(f"{verdict.message}: running on transformers")
        return "transformers"
    if backend == "llama.cpp":
        return backend
    if not transformers_fits(path):
        say("engine: llama.cpp (transformers would not hold the model de-quantized in this machine's memory)")
        return "llama.cpp"
    choice = kept_choice(model, path, say)
    if choice is not None and choice.engine in ("llama.cpp", "transformers"):
        say(choice.line())
        return choice.engine
    engine, why = prior_engine(model)
    say(f"engine: {engine} ({why}; not measured on this machine yet: `specx engines` measures it)")
    return engine


def trial_possible(model: str) -> bool:
    """Whether a trial has something to choose for `model` here: a GGUF that llama.cpp ran in its
    probe and transformers can hold."""
    from specx.core.model import llamacpp
    path = gguf_file(model)
    if path is None or not path.is_file() or not llamacpp.available():
        return False
    verdict = read_kept(_kept_path("probe", _probe_key(path)), lambda m: None)
    return verdict is not None and bool((verdict.get("verdict") or {}).get("ok")) and transformers_fits(path)


def kept_choice_for(model: str) -> Any:
    """kept_choice for a model name (None for a model that is not a GGUF file)."""
    path = gguf_file(model)
    return kept_choice(model, path, lambda m: None) if path is not None and path.is_file() else None


def start_trial(model: str, db: Path) -> subprocess.Popen:
    """`specx engines --json` in a child process at low priority (serve's background trial)."""
    command = [sys.executable, "-c", "from specx.cli.app import main; main()", "engines", "--model", model,
               "--db", str(db), "--json"]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: os.nice(10))


# ------------------------------------------------------------------ the trial

def engines_cmd(
    model: Annotated[str, typer.Option(help="Model: built-in name or .gguf file (an HF folder has one engine).",
                                       envvar="SPECX_MODEL")] = "smollm2-135m",
    db: DbOpt = None,
    requests: Annotated[int, typer.Option(min=2, help="Prompts of the trial (the store's latest; the first "
                                                      "untimed).")] = TRIAL_REQUESTS,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per request.")] = TRIAL_MAX_TOKENS,
    json_out: JsonOpt = False,
) -> None:
    """Measure which engine runs specx fastest for this model on this machine, and keep the choice.

    Proves llama.cpp in a child process first (a native crash never takes specx down), then runs
    the store's latest prompts (cut to their last 768 tokens; built-in agent-like prompts when the
    store has none) through specx on each engine that can hold the model and through llama.cpp's
    plain decoding, taking turns request by request, whole requests timed (prefill included).
    `--backend auto` in serve, generate and replay uses the choice from then on; `specx serve`
    runs this in the background when no choice was made here.

    Example: [bold]specx engines[/]   (the built-in model: llama.cpp against transformers)
    Example: [bold]specx engines --model path/to/model.gguf --db agents.db --json[/]
    """
    from specx.core.decode.generate import generate, thread_tuner
    from specx.core.decode.loop import collect
    from specx.core.decode.speculate import SuffixDrafter
    from specx.core.model import llamacpp
    from specx.core.model.load import ModelError, load_model, load_tokenizer
    from specx.core.predict.engines import REFERENCE, choose, specx_method, timed, trial

    path = gguf_file(model)
    if path is None:
        raise ModelError(f"{model!r} is not a GGUF model: it runs on transformers only, there is nothing to choose")
    if not path.is_file():
        raise ModelError(f"no such GGUF file: {path}")
    say = output.note
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
    if not engines:
        raise ModelError(f"no engine can run {model} here")
    tok = load_tokenizer(model, specx_home() / "models")
    global_index, prompts, source = _trial_prompts(tok, store_path(db), requests)
    say(f"trial: {len(prompts)} prompts ({source}; {sum(map(len, prompts)):,} tokens, the first untimed), "
        f"at most {max_tokens} tokens each, on {', '.join(engines)}")
    eos = tok.eos_token_id
    runners, costs = {}, []
    for engine in engines:
        net = llamacpp.LlamaModel(path) if engine == "llama.cpp" else load_model(model, specx_home() / "models")[0]
        cost = model_cost(net, model, say)
        costs.append(cost)
        drafter = SuffixDrafter(global_index)
        threads = thread_tuner(net, say)
        runners[specx_method(engine)] = (lambda net, drafter, cost, threads: lambda prompt: timed(generate(
            net, prompt, drafter, max_new_tokens=max_tokens, eos_token_ids=eos, cost=cost, threads=threads,
            learn=False), collect))(net, drafter, cost, threads)
    if "llama.cpp" in engines:
        runners[REFERENCE] = _stock_llama_runner(path, max_tokens, eos)
    with output.progress() as bar:
        task = bar.add_task("trial: requests x methods", total=len(prompts) * len(runners))
        figures = trial(runners, prompts, warmup=1, on_request=lambda: bar.advance(task))
    for cost in costs:
        keep_cost(cost, say)
    choice = choose(figures, engines)
    write_kept(_kept_path("choice", choice_key(model, path)),
               {"key": choice_key(model, path), "choice": choice.to_json(), "at": time.time()}, say)
    identical = None
    if REFERENCE in figures and specx_method("llama.cpp") in figures:
        identical = sum(a == b for a, b in zip(figures[REFERENCE].outputs, figures[specx_method("llama.cpp")].outputs))
    data = {"model": model, "cpu": cpu.model_name(), "isa": cpu.instruction_sets(), "engines": engines,
            "probe": verdict.to_json() if verdict else None, "prompts": source, "choice": choice.to_json(),
            "identical_llama_cpp": identical, "requests_timed": len(prompts) - 1}
    say(choice.line())
    if json_out:
        output.print_json(data)
        return
    ref = figures.get(REFERENCE)
    rows = [[name, f.tokens_per_s, f.tokens_per_s / ref.tokens_per_s if ref and ref.tokens_per_s else None,
             f.tokens_per_step, f.decode_tokens_per_s, f.prefill_ms_per_token, f.tokens]
            for name, f in figures.items()]
    output.print_table(f"specx on each engine, {cpu.model_name()} ({' '.join(cpu.instruction_sets())}): "
                       f"{len(prompts) - 1} timed requests", ["method", "tokens/s", f"x {REFERENCE}", "tokens/step",
                                                              "decode tokens/s", "prefill ms/token", "tokens"],
                       rows, caption=f"tokens/s: whole requests, prefill included; higher is better. "
                                     f"Chosen: {choice.engine}"
                                     + (f"; specx on llama.cpp identical to llama.cpp plain on {identical}/"
                                        f"{len(prompts) - 1}" if identical is not None else ""))


def _trial_prompts(tok: Any, db: Path, requests: int) -> tuple[Any, list[list[int]], str]:
    """The global index and the trial's prompts: the store's latest calls for this tokenizer, else
    the built-in ones."""
    from specx.core.index.suffix_index import SuffixIndex
    from specx.core.model.load import render_prompt, tokenizer_fingerprint

    if db.is_file():
        from specx.store.db import Store
        from specx.store.index import index_for
        from specx.store.prompts import model_prompts
        from specx.store.selection import select_calls

        with Store(db) as store:
            fingerprint = tokenizer_fingerprint(tok)
            index = index_for(store, fingerprint)
            tokenizer_id = store.tokenizer_id(fingerprint)
            if tokenizer_id is not None:
                calls = select_calls(store, tokenizer_id)[-4 * requests:]
                calls, prompts = model_prompts(store, tok, calls, TRIAL_PROMPT_TOKENS)
                if len(prompts) >= 2:
                    return index, prompts[-requests:], f"the latest stored calls of {db}"
    else:
        index = SuffixIndex()
    prompts = [tok.encode(render_prompt(tok, [{"role": "user", "content": p}], generation_prompt=True),
                          add_special_tokens=False) for p in PROMPTS]
    return index, [list(p) for p in (prompts * requests)[:requests]], "built-in prompts: the store has none"


def _stock_llama_runner(path: Path, max_tokens: int, eos: int) -> Callable[[list[int]], Any]:
    """llama-cpp-python's own plain decoding (`Llama.generate`, greedy), as its users run it (its
    default threads), with the KV cache specx uses (Q8_0: the same tokens), timed as
    core.predict.engines.Request."""
    from llama_cpp import Llama

    from specx.core.model.llamacpp import CACHE_TYPES
    from specx.core.predict.engines import Request

    llm = Llama(model_path=str(path), n_ctx=4096, flash_attn=True, type_k=CACHE_TYPES["q8_0"],
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
