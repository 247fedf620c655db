"""One subpackage per op, and the contract every op's backends keep.

Layout: ``lowbit/ops/<op>/__init__.py`` holds the public API, the validation and the ctx (larger
ops keep their math in a sibling module, e.g. ``lowrank_residual/_layer.py``); ``_numpy``,
``_numba`` and ``_cuda`` (launchers for ``cuda/<op>.cu``, used by the cuda and cudasim backends)
are the backend modules, each a file or a package. Kernels are in ``cuda/<op>.cu``, the float64
reference in ``reference/<op>.py``, the tests in ``tests/test_<op>.py``.

The backend contract (held for every op by ``tests/test_backend_contract.py``):

- An op's backend API is the set of functions its own modules call through dispatch
  (``_, impl = _dispatch.resolve(op, *arrays)``, then ``impl.<name>(...)``). Every backend module
  of the op defines each of them, with the same parameters (names, order, defaults), so the
  module that dispatch returns is interchangeable.
- Backend functions take validated, contiguous arrays of one array kind and allocate their
  outputs; they do not validate arguments, they never modify their inputs, and their results are
  deterministic.
- The incoming gradient is the first argument of every backend backward (``backward(dout,
  ...)``, ``matmul_dx(dy, ...)``, ``matmul_dw(dy, ...)``).
- Backend function names do not reuse public names (of ``lowbit`` or of the op's package),
  which take other arguments: the public ``gated_delta_scan_forward`` validates and builds a
  ctx; the backend ``forward`` computes.
- Launch constants that a ``.cu`` file and its ``_cuda.py`` both name are checked against each
  other (``tests/test_launch_constants.py``), and every instantiation a ``_cuda.py`` declares
  compiles under NVRTC (``tests/test_nvrtc.py``).
"""
