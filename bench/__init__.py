"""lowbit's benchmark harness: ``python -m bench [suite ...]`` (the main job) and
``pytest bench --benchmark-only`` over the same cases. See ``bench/_harness.py``."""
