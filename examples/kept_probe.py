"""Replay issue 47's cases against the command line, each in a fresh SPECX_HOME, so the next probe starts from them.

Each case damages something specx keeps (an engine file, a successor-table row, the trial lock, the
store's folder) or hands a command something hostile, runs the command as a user would, and reports
its exit status, its last line of stderr, whether a traceback appeared, and its peak memory.
`/detokenize` (case 2) is replayed against a running server by examples/hostile_probe.py --detokenize 15000000.

    .venv/bin/python examples/kept_probe.py [--json] [--only merge]

Expected (docs/reliability.md, rows 26-35): no traceback anywhere; one line naming the file, field
or store; the command goes on (rc 0) where it can, rc 1 with that line where it cannot; under 2 GB.
Cases that need a model (`generate`, a GGUF for the engine files) load the built-in one once per case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

Case = tuple[str, Callable[[Path], None], list[str]]  # (name, set-up in a fresh home, the command's arguments)


def specx(home: Path, args: list[str], timeout: float = 600) -> dict:
    """`specx ARGS` with SPECX_HOME=home: rc, the stderr line that names the case (else the last),
    traceback seen, peak RSS of the largest child so far (MB; shown when this one raised it)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        done = subprocess.run([sys.executable, "-m", "specx", *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "SPECX_HOME": str(home)}, stdin=subprocess.DEVNULL)
        rc, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, err = "hung", (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far (KB on Linux)
    lines = [line for line in err.splitlines() if line.strip()]
    named = [line for line in lines if any(w in line for w in ("cannot use", "damaged", "read-only", "error"))]
    return {"rc": rc, "said": (named or lines[-1:] or [""])[0][:160], "traceback": "Traceback" in err,
            "peak_mb": round(peak / 1024) if peak > before else None}


def a_store(home: Path) -> Path:
    """A small store with one served call, made by the library (no model)."""
    from specx.store.db import Store
    from specx.store.formats import Call
    from specx.store.served import record_served

    db = home / "specx.db"
    with Store(db) as store:
        record_served(store, "m", [Call(session_id="s", position=0, output_text="SELECT 1",
                                        prompt_messages=[{"role": "user", "content": "one"}])], [[1, 2, 3]],
                      "fp", "m", 49152)
    return db


def table_row(home: Path, blob: object, vocab: int = 49152) -> Path:
    """A store whose successor table for the built-in model is `blob` (bytes, text or an integer)."""
    from specx.core.index.successors import SuccessorTable
    from specx.core.model.load import load_tokenizer, tokenizer_fingerprint
    from specx.store.successors import save_table, table_key
    from specx.store.db import Store

    db = a_store(home)
    key = table_key("smollm2-135m", tokenizer_fingerprint(load_tokenizer("smollm2-135m", home / "models")))
    with Store(db) as store:
        save_table(store, key, SuccessorTable(vocab, k=2))
        store.db.execute("UPDATE successors SET blob = ?", [blob])
        store.db.conn.commit()
    return db


def huge_header(home: Path) -> Path:
    """A ~200-byte table whose npy headers declare (10^9, 8): 29.8 GiB before issue 47."""
    import io
    import zipfile

    import numpy as np

    from specx.core.index.successors import _MAGIC
    from specx.store import codec

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, descr in (("next", "<i4"), ("prob", "<f2")):
            npy = io.BytesIO()
            np.lib.format.write_array_header_1_0(npy, {"descr": descr, "fortran_order": False, "shape": (10**9, 8)})
            archive.writestr(f"{name}.npy", npy.getvalue())
    return table_row(home, codec.compress(_MAGIC + out.getvalue()))


def engine_file(kind: str, doc: object) -> Callable[[Path], None]:
    """Write `doc` as every kept engine file of `kind` the built-in model's start reads."""
    def setup(home: Path) -> None:
        from specx import backends
        from specx.core.model.load import builtin_gguf

        os.environ["SPECX_HOME"] = str(home)
        path = builtin_gguf("smollm2-135m")
        key = backends._probe_key(path) if kind == "probe" else backends.choice_key("smollm2-135m", path)
        at = backends.kept_path(kind, key)
        at.parent.mkdir(parents=True, exist_ok=True)
        at.write_text(json.dumps(doc))
    return setup


def lock(kind: str) -> Callable[[Path], None]:
    def setup(home: Path) -> None:
        path = home / "engines" / "trial.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path) if kind == "fifo" else path.mkdir()
    return setup


def read_only(home: Path) -> None:
    db = a_store(home)
    (home / "log.jsonl").write_text(json.dumps({"prompt": "rows?", "completion": "SELECT 1;"}) + "\n")
    db.chmod(0o444)
    db.parent.chmod(0o555)


GEN = ["generate", "SELECT", "--max-tokens", "4"]
CHOICE = {"engine": "transformers", "tokens_per_s": {"specx transformers": 9.0}, "tokens_per_step": 2.0,
          "vs_reference": 1.1, "reason": "ok"}


def cases() -> list[Case]:
    db = ["--db", "{home}/specx.db"]
    return [
        ("1 choice-*.json = {\"choice\": \"x\"}", engine_file("choice", {"choice": "x"}), GEN),
        ("1 choice-*.json with a 400-digit tokens_per_s", engine_file("choice", {"choice": CHOICE | {
            "tokens_per_s": {"specx transformers": 10**400}}}), GEN),
        ("1 probe-*.json = {\"verdict\": [1]}", engine_file("probe", {"verdict": [1]}), GEN),
        ("8 choice-*.json with NaN tokens_per_step", engine_file("choice", {"choice": CHOICE | {
            "tokens_per_step": float("nan")}}), GEN),
        ("8 choice-*.json with an escape sequence in reason", engine_file("choice", {"choice": CHOICE | {
            "reason": "\x1b[2J\x1b[31mcleared\nnext line"}}), GEN),
        ("8 choice-*.json naming an unknown engine", engine_file("choice", {"choice": CHOICE | {"engine": "x"}}), GEN),
        ("3 successor table blob as TEXT (generate --drafter hybrid)", lambda h: table_row(h, "text"),
         GEN + ["--drafter", "hybrid"] + db),
        ("3 successor table blob declaring (10^9, 8)", huge_header, GEN + ["--drafter", "hybrid"] + db),
        ("3 successor table blob as INTEGER (merge)", lambda h: (table_row(h, 42), a_store(h / "dest")),
         ["merge", "{home}/specx.db", "--db", "{home}/dest/specx.db", "--json"]),
        ("4 a FIFO at engines/trial.lock", lock("fifo"), ["engines", "--db", "/dev/null"]),
        ("4 a folder at engines/trial.lock", lock("dir"), ["engines", "--db", "/dev/null"]),
        ("5 a store in a read-only folder: ls", read_only, ["ls"] + db),
        ("5 a store in a read-only folder: ingest", read_only, ["ingest", "{home}/log.jsonl"] + db),
        ("9 engines --db missing.db", lambda h: None, ["engines", "--db", "{home}/missing.db"]),
        ("9 engines --db an empty file", lambda h: (h / "empty.db").write_bytes(b""),
         ["engines", "--db", "{home}/empty.db"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the cases whose name holds this text")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() == 0:
        print("note: as root a read-only folder is writable: case 5 needs a read-only mount or another user",
              file=sys.stderr)
    rows = []
    for name, setup, command in cases():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            shared = Path(os.environ.get("SPECX_HOME", Path.home() / ".specx")) / "models"
            if shared.is_dir():
                (home / "models").symlink_to(shared)  # the converted model, shared: no conversion per case
            setup(home)
            result = specx(home, [a.replace("{home}", str(home)) for a in command])
            for path in (home, home / "specx.db"):
                if path.exists():
                    path.chmod(0o755 if path.is_dir() else 0o644)
        rows.append({"case": name} | result)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['case'][:58]:<58} rc {str(r['rc']):<4} {'TRACEBACK ' if r['traceback'] else ''}"
                  f"{r['peak_mb'] or '-':>5} MB  {r['said']}")
    bad = [r for r in rows if r["traceback"] or r["rc"] == "hung" or (r["peak_mb"] or 0) > 2048]
    print(f"{len(bad)} case(s) with a traceback, a hang or over 2 GB", file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
