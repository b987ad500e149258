"""Process entry points: ``python -m sarathi_pp.launch.torchrun`` (one rank per stage under
torchrun), ``python -m sarathi_pp.launch.ray_job`` (``ray job submit``) and ``python -m
sarathi_pp.launch`` (the ``sarathi-pp`` command). The work is in ``cli`` and ``executors``."""
