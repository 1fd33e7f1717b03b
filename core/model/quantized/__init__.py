"""specx's quantized engine: a GGUF's own quantized weights, verified in trees on the CPU.

    quant.py       the GGUF block types, unpacked exactly and repacked in panels of 16 outputs
    kernel.py      the batch-invariant int8 linear kernel (activations quantized per row), built
                   for the CPU's instruction-set family from arch/ (avx512vnni, avxvnni, avx2,
                   generic: the same names in each, and each family's requirements)
    target.py      the CPU the kernels compile for (its LLVM features, asked once) and its family
    ir.py          the LLVM-IR pieces the kernels share
    keys.py        how the cache keeps keys (int8 with scales, or float16) and scores a query on them
    values.py      how the cache keeps values (bfloat16 pairs where the CPU sums them, or float16) and sums them
    attention.py   row-exact attention over the cached keys and values, in parts of fixed positions
    forward.py     norms, rotary, SiLU and the whole pass as one compiled call
    model.py       a GGUF file's model (llama, qwen2) and its passes
    engine.py      the engine, its KV cache and prefix cache (its sessions, trees and batches:
                   core/model/sessions.py, shared with the GPU engine)
"""
