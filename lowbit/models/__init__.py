"""Models composed only of public lowbit ops: ``bdh`` (the BDH byte-level language model) and the
training beside it (``train``: batches, schedules, checkpoints, the loop).

``import lowbit.models.bdh`` / ``lowbit.models.train``; parameters are dicts of arrays under the
reference implementation's names.
"""
