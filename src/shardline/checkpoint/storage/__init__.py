"""Where checkpoint bytes live, behind one seam: the ``CheckpointStore`` protocol (``protocol``; found with
``stores.store_for``), implemented for a local file system (``local``, on ``fsutil``: fsync, atomic small
writes, temp names and their locks) and for an object store (``object_store``, on ``objects``: locations
through fsspec, with ``object_clients``, ``object_errors``, ``object_versions`` and ``object_listing``;
``claims``: a save's claim on its prefix; ``object_leftovers``: clearing a dead save's).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
