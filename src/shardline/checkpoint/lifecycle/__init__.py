"""The lifecycle of a checkpoint, on top of everything else: what a save captures (``capture``,
``host_buffers``), ``save`` and its commit protocol, verified ``load``, the ``CheckpointManager``
and what it wires (``recovery`` on open, ``resume`` selection, ``quarantine``, the
``async_writer``; its ledger rows are written by ``provenance.records``), and the read-only views:
``summary`` (``inspect``) and ``consolidate`` (safetensors export).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
