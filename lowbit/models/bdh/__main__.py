"""``python -m lowbit.models.bdh train|sample|eval ...``: train BDH on a file of bytes, sample
from a run, evaluate it (``_cli.py``)."""

import sys

from ._cli import main

sys.exit(main())
