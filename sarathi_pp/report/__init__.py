"""The pipeline-bubble report: from a run dir's ``events.jsonl`` and ``requests.csv`` to
``summary.json``, ``trace.json`` and ``timeline.png`` (see ``bubbles`` for how idle time
is attributed).

Modules: ``log`` (read and check the event log), ``bubbles`` (cut each stage's time into
compute and classified gaps), ``request_metrics`` (TTFT, TBT, ... from requests.csv),
``summary``, ``trace``, ``timeline``, ``text`` (tables, comparisons), ``writer`` (the run
dir), ``cli`` (``sarathi-pp report``). A run dir without a model or GPU: ``sarathi-pp
simulate`` (``sarathi_pp.sim``) writes one as a real run does.
"""

from sarathi_pp.report.bubbles import BUBBLE_CLASSES, BubbleAnalysis, analyze
from sarathi_pp.report.log import RunLog, load_log, parse_log
from sarathi_pp.report.writer import analyze_run, write_report

__all__ = [
    "BUBBLE_CLASSES",
    "BubbleAnalysis",
    "RunLog",
    "analyze",
    "analyze_run",
    "load_log",
    "parse_log",
    "write_report",
]
