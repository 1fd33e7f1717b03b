"""The servers `specx bench tasks --start` runs itself, one at a time, each on a free loopback port:

    specx               `specx serve` on a fresh store of its own (it learns from what it serves)
    specx-plain         the same with --no-speculation: plain decoding, the reference for identical answers
    llama-server        llama.cpp's server on the same GGUF, -np C slots (C: --agents) reusing their KV
                        (--cache-reuse 256)
    llama-server-ngram  the same with its n-gram speculation (--spec-type ngram-mod)

llama-server is the binary on PATH, else the one examples/model_ladder.py builds
(~/.cache/specx/llama.cpp/build/bin). A server that cannot be started raises ServerError with one
line saying why (no binary, no GGUF, it exited: its log's last line, not ready in time).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from .chat_stream import ServerError

KINDS = ("specx", "specx-plain", "llama-server", "llama-server-ngram")


def llama_server_binary(given: Path | None = None) -> Path | None:
    """llama-server: `given`, else on PATH, else where examples/model_ladder.py builds it; None if none."""
    if given is not None:
        return given if given.is_file() else None
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    built = cache / "specx" / "llama.cpp" / "build" / "bin" / "llama-server"
    return built if built.is_file() else None


def model_gguf(model: str) -> Path | None:
    """The GGUF file llama-server runs for `model`: the file itself, or a built-in model's; None otherwise."""
    from ..core.model.load import BUILTIN, ModelError, builtin_gguf

    if model in BUILTIN:
        try:
            return builtin_gguf(model)
        except ModelError:
            return None
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def peak_rss(pid: int) -> int | None:
    """Process `pid`'s peak resident memory so far, bytes (VmHWM: Linux; None elsewhere or once it exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 60 s; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class StartedServer:
    """A server process started here, ready (GET /health answered 200); `url` is its OpenAI base URL."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, ready_timeout: float,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{name} exited with status {self.proc.returncode}: {self.last_line()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"{name} was not ready after {ready_timeout:.0f} s: {self.last_line()}")

    def last_line(self) -> str:
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else f"no output (log {self.log_path})"

    def peak_rss(self) -> int | None:
        return peak_rss(self.proc.pid)

    def stop(self) -> None:
        stop_process(self.proc)


def start_server(kind: str, *, model: str, workdir: Path, slots: int, context: int,
                 serve_args: Sequence[str] = (), llama_server: Path | None = None,
                 ready_timeout: float = 600.0) -> StartedServer:
    """Start the server `kind` (one of KINDS) for `model`; ServerError (one line) when it cannot be."""
    if kind not in KINDS:
        raise ServerError(f"unknown server {kind!r}: choose from {', '.join(KINDS)}")
    port = free_port()
    log_path = workdir / f"{kind}-{port}.log"
    if kind.startswith("specx"):
        argv = [sys.executable, "-m", "specx", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--db", str(workdir / f"{kind}-{port}.db"), "--model", model, *serve_args]
        if kind == "specx-plain":
            argv.append("--no-speculation")
        env = {k: v for k, v in os.environ.items() if k != "SPECX_API_KEY"}  # a server of our own takes no key
        return StartedServer(kind, argv, port, log_path, ready_timeout, env)
    binary = llama_server_binary(llama_server)
    if binary is None:
        raise ServerError(f"{kind}: no llama-server binary (not on PATH, not built by examples/model_ladder.py; "
                          "pass --llama-server PATH)")
    gguf = model_gguf(model)
    if gguf is None:
        raise ServerError(f"{kind}: llama-server runs a GGUF file, and {model!r} is not one")
    # -c is the context of all slots together: each of the -np slots gets context tokens
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(context * slots), "--cache-reuse", "256", "--no-webui"]
    if kind == "llama-server-ngram":
        argv += ["--spec-type", "ngram-mod"]
    return StartedServer(kind, argv, port, log_path, ready_timeout)
