"""The room for ``sarathi-pp simulate``: the real engine loop and schedulers against a
simulated executor and clock, with analytic or profiled cost models. It may import the
engine, the scheduler, the planner, the placement rule, ``bench`` (capacity search,
workloads) and the value types; never ``stages``, ``comm``, torch or Ray (checked by the
import contracts in ``pyproject.toml``). Its subcommand goes in ``cli/simulate.py``.
Nothing lives here yet."""
