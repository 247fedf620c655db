"""The one source of lowbit's version: pyproject.toml reads it (``attr:
lowbit._version.__version__``) and ``lowbit.__version__`` re-exports it."""

__version__ = "0.1.0"
