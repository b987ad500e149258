"""The serving benchmark: workload specs (``workload``) and what runs them."""
