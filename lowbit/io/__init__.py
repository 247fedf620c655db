"""Interchange formats: lowbit's own checkpoints, GGUF's ternary types, Hugging Face BitNet.

One module per format: ``safetensors.py`` (``save`` / ``load``: lowbit's checkpoints, the
safetensors file format written and read with NumPy alone), ``gguf.py`` (``to_gguf`` /
``from_gguf``, ``save_gguf`` / ``load_gguf``: llama.cpp's TQ1_0 and TQ2_0), ``hf_bitnet.py``
(``to_hf_bitnet`` / ``from_hf_bitnet``, ``load_hf_bitnet``: transformers' packed BitLinear
weights). The conversions are in ``_numpy.py`` and ``_numba.py`` (chosen by ``_codecs.py``),
atomic writes in ``_files.py``. Tests: ``tests/test_io_*.py``; speed: ``bench/io.py``.

``import lowbit.io`` needs no optional package; ``save_gguf`` / ``load_gguf`` need the ``gguf``
package (``pip install "lowbit[io]"``).
"""

from .gguf import from_gguf, load_gguf, save_gguf, to_gguf
from .hf_bitnet import from_hf_bitnet, load_hf_bitnet, to_hf_bitnet
from .safetensors import load, save

__all__ = ["from_gguf", "from_hf_bitnet", "load", "load_gguf", "load_hf_bitnet", "save",
           "save_gguf", "to_gguf", "to_hf_bitnet"]
