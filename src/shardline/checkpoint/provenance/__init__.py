"""Provenance: the in-toto statement of each checkpoint (``statement``), the hash-chained SQLite
ledger (``ledger``) and its audit against the checkpoints (``lineage``), a directory of
checkpoints with its ``latest`` pointer and quarantine (``directory``), retention behind
tombstones (``retention``), OpenSSF model-signing signatures (``signing``; of a checkpoint in an
object store: ``store_signing``).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
