#!/usr/bin/env bash
# Every GPU check in one go, in under 5 minutes on one GPU, without installing the project
# (PYTHONPATH=.; needs torch, transformers, safetensors, pyyaml, tqdm; pytest for the tests;
# Ray is not needed):
#   1. the environment: device, torch, CUDA, flash-attn / Triton / Ray present or not;
#   2. every test in tests/gpu/, with each skipped test and its reason (-rs);
#   3. the figures of benchmarks/gpu_checks.py on 7B layer shapes (4 layers), each with the
#      attention backend that ran it and every fallback, then the embedded model end to end
#      against transformers (tokens/s, greedy agreement in bf16).
# --smoke: the same on CPU with tiny shapes (tests/model/test_gpu_checks.py runs it).
# Usage: bash tests/gpu/run_checks.sh [--smoke]     (or: make gpu-check)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
FIGURES=(--layers 4)
if [[ "${1:-}" == "--smoke" ]]; then
    FIGURES=(--device cpu --tiny --layers 2 --repeats 1)
fi
status=0

echo "== environment"
"$PY" - <<'PY'
import importlib.util as u

import torch

cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda if cuda else 'unavailable'}, "
      f"{torch.cuda.device_count()} GPU(s)" + (f": {torch.cuda.get_device_name(0)}" if cuda else ""))
for mod in ("flash_attn", "triton", "ray", "pytest"):
    print(f"  {mod}: {'present' if u.find_spec(mod) else 'absent'}")
PY

echo "== GPU tests (tests/gpu)"
if "$PY" -c "import pytest" 2>/dev/null; then
    # SIGINT, not TERM: pytest stops and still prints its summary (the tests that ran)
    timeout -s INT 200 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu || status=$?
else
    echo "pytest is absent: the GPU tests were NOT run"
    status=1
fi

echo "== figures (benchmarks/gpu_checks.py ${FIGURES[*]})"
timeout -s INT 240 "$PY" benchmarks/gpu_checks.py "${FIGURES[@]}" || status=$?

echo "== done (exit ${status})"
exit "$status"
