"""Prove an engine's native code in a child process before specx runs it in its own.

A native library built for another CPU, or one with a bug on this one, does not raise: it kills the
process (llama.cpp's AMX path dies with SIGILL on Sapphire Rapids Xeons: core/model/cpu.py). So
before specx first runs llama.cpp on a machine and build, a child process loads the model and
decodes a few tokens; if the child dies, the verdict names the signal and specx runs on the other
engine. The caller keeps the verdict (per machine, build and model: cli/backends.py), so the child
runs once.

    verdict = prove("llama.cpp", Path("model.gguf"))
    verdict.ok, verdict.message   # False, "llama.cpp died with SIGILL (illegal instruction) ..."

The child is `python -m specx.core.model.probe ENGINE PATH`: it prints "ok TOKENS" when the tokens
came out.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROBE_TOKENS = 4  # tokens the child decodes: enough to run a prefill and one-token passes
PROBE_TIMEOUT_S = 120.0  # a child that has not answered by then counts as failed (a busy machine: generous)
WHY = {signal.SIGILL: "illegal instruction: the library uses an instruction this CPU or kernel does not allow",
       signal.SIGSEGV: "segmentation fault", signal.SIGBUS: "bus error", signal.SIGABRT: "aborted",
       signal.SIGFPE: "arithmetic fault", signal.SIGKILL: "killed (out of memory?)"}


@dataclass(frozen=True)
class Verdict:
    """Whether `engine` ran in a child: `ok`, else what happened (`signal` names the one that killed it)."""

    engine: str
    ok: bool
    message: str
    signal: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"engine": self.engine, "ok": self.ok, "message": self.message, "signal": self.signal}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Verdict:
        if not isinstance(data.get("engine"), str) or not isinstance(data.get("ok"), bool) \
                or not isinstance(data.get("message"), str):
            raise ValueError("not a verdict")
        sig = data.get("signal")
        return cls(str(data["engine"]), bool(data["ok"]), str(data["message"]), sig if isinstance(sig, str) else None)


def prove(engine: str, path: Path, command: list[str] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """Run `engine` on the model at `path` in a child process (`command` replaces the child's, for
    tests) and say whether it lived."""
    command = command or [sys.executable, "-m", "specx.core.model.probe", engine, str(path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Verdict(engine, False, f"{engine} did not decode {PROBE_TOKENS} tokens of {path.name} within "
                                      f"{timeout_s:.0f} s in a test process")
    except OSError as exc:
        return Verdict(engine, False, f"cannot start a test process for {engine}: {exc}")
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode)
        return Verdict(engine, False, f"{engine} died with {sig.name} ({WHY.get(sig, 'a fatal signal')}) running "
                                      f"{path.name} in a test process", sig.name)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode == 0 and last.startswith("ok"):
        return Verdict(engine, True, f"{engine} ran {path.name} in a test process")
    error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return Verdict(engine, False, f"{engine} failed running {path.name} in a test process: {error[:300]}")


def _child(engine: str, path: str) -> None:
    if engine != "llama.cpp":
        raise SystemExit(f"no probe for engine {engine!r}")
    from .llamacpp import LlamaModel, greedy

    model = LlamaModel(path, n_ctx=256)
    out = greedy(model, [1, 2, 3, 4, 5, 6, 7, 8], PROBE_TOKENS)
    print("ok", *out, flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
