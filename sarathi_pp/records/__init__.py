"""A run's records and the seam that feeds them: ``observer.py`` (what the engine loop
tells its observers, ``LLMEngine(observers=...)``), ``recorder.py`` (the observer that
streams a run into its run dir), ``events.py`` (``events.jsonl``: its schema, writer and
reader) and ``run_dir.py`` (every file name of a run dir). The report (``report/``) is
rebuilt from these files; nothing here imports it (the engine hands the recorder its
report writer)."""
