"""Provenance: the in-toto statement of each checkpoint (``statement``), the hash-chained SQLite
ledger (``ledger``), its rows, one operation per kind (``records``: the one writer of lineage), and
its audit against the checkpoints (``lineage``), the names and the scan of a directory of
checkpoints (``directory``), retention behind tombstones (``retention``), OpenSSF model-signing
signatures of a checkpoint on disk or in an object store (``signing``; ``store_signing`` keeps
earlier names).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
