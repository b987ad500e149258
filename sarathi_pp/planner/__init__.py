"""The chunk-size planner: how many sequences fit and which chunk size suits a workload.

Pure Python, no torch (the simulator and the scheduler's online tuner call it):
``memory`` (KV blocks and the decode batch bound B), ``chunk`` (the chunk from the P:D
ratio, tile rounding, decode coverage), ``tuner`` (``chunk_size: auto``), ``recommend``
(the plan of ``sarathi-pp plan``), ``render`` (its text, JSON and YAML), ``profile_csv`` and
``profile_analysis`` (a ``sarathi-pp profile`` CSV and what it says about chunks and tiles).
The word "plan" belongs here: the scheduler's output is a micro-batch.
"""
