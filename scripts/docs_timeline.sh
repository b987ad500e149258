#!/usr/bin/env bash
# Regenerates docs/assets/demo-timeline.png, the picture of README.md and the docs' home
# page: the run of `make demo` (SmolLM2-135M-Instruct, PP=2 on two Ray stage actors, chat
# prompts), recorded into a run dir, and that run's timeline.png copied under docs/.
# `make docs-timeline` runs it. MODEL=tiny runs the same prompts on builtin:tiny-llama at
# PP=2 instead (configs/tiny-llama-pp2.yaml, no chat template: plain prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${RUN:-runs/demo}  # the run dir's name titles the picture, as under make demo
if [[ "${MODEL:-demo}" == tiny ]]; then
    "$PY" -m sarathi_pp generate --config configs/tiny-llama-pp2.yaml \
        --prompts-file configs/demo-prompts-chat.txt --max-tokens 40 --run-dir "$RUN" --overwrite
else
    "$PY" -m sarathi_pp generate --config configs/smollm2-pp2.yaml --chat \
        --system "$(cat configs/demo-system.txt)" --prompts-file configs/demo-prompts-chat.txt \
        --max-tokens 40 --run-dir "$RUN" --overwrite
fi
cp "$RUN/timeline.png" docs/assets/demo-timeline.png
echo "wrote docs/assets/demo-timeline.png from $RUN"
