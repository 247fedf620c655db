"""pytest-benchmark runner over the cases of every suite (``pytest bench --benchmark-only``).

The same ``cases(config)`` that ``python -m bench`` prints, on the quick configuration; each case
is checked against its reference before it is timed. Save and compare runs across commits with
pytest-benchmark's ``--benchmark-autosave`` / ``--benchmark-compare``.
"""
