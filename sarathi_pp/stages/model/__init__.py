"""The model: a Llama-family decoder slice (``llama.py``) of decoder layers
(``decoder_layer.py``) over a flat batch of rows, their linears (``linear.py``), rotary
embeddings (``rope.py``), the attention backends (``attention.py``, ``flex_paged.py``; which
one runs and its fallbacks: ``backend_choice.py``), the
paged KV cache (``kv_cache.py``, on huge pages: ``host_pages.py``) and the CPU layer loop
(``layer_loop.py``)."""
