"""Model loading: a stage's weights from a Hugging Face folder (``weights.py``), the builtin
models (``builtin.py``) and the GGUF import that makes the real one (``gguf.py``). Nothing is
fetched from a hub here."""
