"""Where checkpoint bytes live: durable steps on a local file system (``fsutil``: fsync, atomic
small writes, temp names and their locks) and object-store locations through fsspec (``objects``).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
