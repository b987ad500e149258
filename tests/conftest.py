"""Session-wide fixtures: tiny random HF model folders, each built once per test session
(and a config-only one for simulated runs, ``sim_model_dir``).

``tiny_model(name)`` builds a variant of ``helpers.VARIANTS`` on first request; the named
fixtures below are shorthands. ``any_model_dir`` runs a test once per variant.
"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import VARIANTS, build_variant
from sim_runs import write_model_dir

# The benchmark scripts some tests run append nothing to benchmarks/results.jsonl (it holds
# real runs only); tests/unit/test_results_file.py lifts this for a temp results file.
os.environ["SARATHI_PP_NO_RECORD"] = "1"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_variant(name, root)
        return built[name]

    return get


@pytest.fixture(scope="session")
def llama_dir(tiny_model: Callable[[str], Path]) -> Path:
    """Llama, GQA (4 heads, 2 KV heads), untied embeddings."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def llama3_rope_dir(tiny_model: Callable[[str], Path]) -> Path:
    """Llama with 3 layers and llama3 rope scaling (original_max_position_embeddings=128)."""
    return tiny_model("llama3-rope")


@pytest.fixture(scope="session")
def mistral_dir(tiny_model: Callable[[str], Path]) -> Path:
    """Mistral without a sliding window."""
    return tiny_model("mistral")


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model: Callable[[str], Path]) -> Path:
    """Qwen2: qkv bias, tied embeddings."""
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def llama_sharded_dir(tiny_model: Callable[[str], Path]) -> Path:
    """The ``llama`` weights saved as several safetensors shards with an index json."""
    return tiny_model("llama-sharded")


@pytest.fixture(scope="session")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder of a small Llama shape with only ``config.json``: what a simulated
    run (``sim_runs``) needs."""
    return write_model_dir(tmp_path_factory.mktemp("sim_model"))


@pytest.fixture(scope="session", params=list(VARIANTS))
def any_model_dir(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the session: engines find it initialised and only start actors
    (seconds each) instead of a whole Ray (and leave it running for the next test)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture
def python_ctrl_c():
    """Ctrl-C as Python sets it up in a fresh process (an earlier test of the session may
    have left SIGINT ignored, which a child process inherits too)."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """Every test leaves SIGINT and SIGTERM as it found them: a handler left behind changes
    how a later test's Ctrl-C or SIGTERM behaves, and a child process inherits an ignored
    one. Restored; with a warning naming the test unless it is what every in-process
    ``main()`` run does on purpose (``cli.common.sigterm_as_interrupt``: its SIGTERM handler,
    and SIGINT un-ignored when the test process started with it ignored, as a background job
    of a script does; ``cli.common.hold_signals``: a run that stopped holds both)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        now = signal.getsignal(sig)
        if handler is None or now == handler:
            continue
        cli_sigint = (
            sig == signal.SIGINT and handler == signal.SIG_IGN and now is signal.default_int_handler
        )
        on_purpose = ("sigterm_as_interrupt", "hold_signals")  # cli.common's, see above
        qualname = getattr(now, "__qualname__", "")
        if not any(name in qualname for name in on_purpose) and not cli_sigint:
            warnings.warn(
                f"{request.node.nodeid} left the {signal.Signals(sig).name} handler changed "
                f"({now!r}; was {handler!r}): restored",
                stacklevel=1,
            )
        signal.signal(sig, handler)
