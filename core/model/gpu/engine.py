"""specx's GPU engine: a GGUF's weights in bfloat16 on CUDA, verified in trees, requests batched.

    engine = GPUEngine("model.gguf")             # or load_backend(path, backend="gpu")
    session = engine.start(prompt_ids[:-1], engine.new_prefix_cache(8192))
    logits = session.score([prompt_ids[-1]], draft)   # [1 + N, V], as every engine's
    session.keep_path(accepted_nodes)

Why its own engine: transformers on a GPU is lossless only in float32, for cuBLAS picks other
kernels (other sums) for a one-token pass than for a tree pass, so in bfloat16 a tree pass's logits
differ from plain decoding's. Here every kernel is batch-invariant (core/model/gpu/kernels.py):
a token gets the same bits alone, in a tree or beside other requests, so greedy and sampled
speculation are this engine's plain decoding token for token, in bfloat16.

Here: the engine (GPUEngine: its model, kernels and cost key) and the prefix cache that makes its
caches (GPUPrefixCache: pages of the model's pool, core/model/gpu/model.py). The sessions, their tree
and prefill passes, the prefix cache's reuse, `score_batch` and plain decoding are
core/model/sessions.py's (SessionEngine, shared with the quantized engine), so core/serve's batcher
runs this engine's passes as the quantized engine's (GPUModel.forward_batch, one pass over all
requests' rows).

Runs on CUDA; on CPU tensors only under TRITON_INTERPRET=1 (Triton's interpreter: slow, for tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..sessions import SessionEngine, SessionPrefixCache
from .model import GPUModel, GGUFError, KVCache

__all__ = ["GGUFError", "GPUEngine", "GPUPrefixCache", "available", "unavailable", "unsupported"]


def unavailable(device: str | None = None) -> str | None:
    """Why the GPU engine cannot run here, in one line; None when it can: CUDA and Triton, or (for
    tests) Triton's interpreter on the CPU."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None:
        return "the gpu engine needs Triton (it ships with CUDA builds of torch)"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        return None if torch.cuda.is_available() else "the gpu engine needs CUDA: torch sees no GPU"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "the gpu engine runs on CUDA (on a CPU only under TRITON_INTERPRET=1, for tests): torch sees no GPU"


def available() -> bool:
    """Whether a CUDA GPU and Triton are here (what `auto` and `specx engines` ask)."""
    import torch

    return torch.cuda.is_available() and unavailable("cuda") is None


class GPUPrefixCache(SessionPrefixCache):
    """SessionPrefixCache for the GPU engine: its caches are KVCaches, pages of the model's pool."""

    def fresh(self, model: GPUModel, capacity: int = 0) -> KVCache:
        cache = model.new_cache()
        cache.reserve(capacity)
        return cache


class GPUEngine(SessionEngine):
    """core.model.engine.Engine over a GPUModel (the sessions: core.model.sessions.SessionEngine)."""

    name = "gpu"
    cost_curve = "cpu"  # the shape a pass's cost starts from; learned on the device from the first passes
    precision = "bfloat16"
    prefix_cache_type = GPUPrefixCache

    def __init__(self, path: str | Path, context: int | None = None, device: str | None = None,
                 say: Callable[[str], None] = lambda m: None) -> None:
        why = unavailable(device)
        if why:
            raise GGUFError(why)
        model = GPUModel(path, context, device, say)
        self.device = model.device.type
        self.kv_bytes_per_token = KVCache.bytes_per_token(model.config)  # bfloat16 pages
        self.kernels = ["batch-invariant Triton kernels (" + ("bfloat16 tensor cores" if model.tensor_cores
                                                               else "interpreter, float32 products") + ")"]
        super().__init__(model)  # Triton compiles each kernel at its first call: the pass it runs

    def tune_threads(self, shape: Callable[[int, int], float] | None = None,
                     say: Callable[[str], None] | None = None) -> None:
        """Nothing to tune: the passes run on the GPU."""
        return None

    def cost_key(self) -> dict[str, Any]:
        from importlib.metadata import version

        import torch

        from ..llamacpp import file_digest

        gpu = torch.cuda.get_device_name(self.model.device) if self.device == "cuda" else None
        return {"engine": self.name, "file": file_digest(self.path), "gpu": gpu, "torch": torch.__version__,
                "triton": version("triton")}


def unsupported(path: str | Path) -> str | None:
    """Why the GPU engine cannot run the GGUF at `path` (its architecture, a damaged header), in one
    line; None when it can. Reads the header only."""
    import gguf

    from ..quantized.model import read_config

    try:
        read_config(gguf.GGUFReader(path))
    except GGUFError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - gguf-py raises anything on a damaged file
        return f"not a readable GGUF file ({type(exc).__name__})"
    return None
