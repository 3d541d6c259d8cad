"""Integrity: every file hashed while written (``hashing``), the manifest that records them
(``manifest``), checks against it (``verify``, ``export_verify``), the order in which a
checkpoint is opened before use (``opening``), the reader that hashes while it loads
(``reading``), and an async save's check that the bytes written are those staged (``copy_check``).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
