"""How ranks and threads of a save or load work together: every go/no-go decided once and
agreed by all ranks (``coord``), and how many files and threads each rank uses (``parallelism``).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
