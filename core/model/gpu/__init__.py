"""specx's GPU engine: a GGUF's weights in bfloat16 on CUDA, batch-invariant Triton kernels, draft
trees and batched requests, lossless (core/model/gpu/engine.py; docs/gpu.md)."""
