"""``sarathi-pp simulate``: the real engine loop, schedulers and block manager against a
simulated executor and a virtual clock (simulation by substitution, not re-implementation).

Modules: ``clock`` (virtual time), ``executor`` (``SimExecutor``: the ``Executor``
contract on a cost model), ``cost_model`` (the interface and the analytic model),
``analytic`` (the roofline per operator), ``profiled`` (a ``sarathi-pp profile`` CSV),
``hardware`` (``configs/hardware/*.yaml``), ``cluster`` (replicas of engines, routing,
serving a workload, run dirs), ``setup`` (what a simulation runs on), ``suite``
(``SimBench``: the serving benchmark on a ``SimCluster``). The subcommand is
``cli/simulate.py``.

It may import the engine, the scheduler, the planner, the placement rule, ``bench``
(capacity search, workloads), ``report`` and the value types; never ``stages``, ``comm``,
the executors, torch or Ray (checked by the import contracts in ``pyproject.toml``)."""
