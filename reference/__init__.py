"""Float64 reference implementations, installed as ``lowbit.reference``.

One module per op (``reference/<op>.py``): explicit loops that are obviously right, used by the
tests in ``tests/`` and by the benchmark cases in ``bench/`` to check results before timing.
"""
