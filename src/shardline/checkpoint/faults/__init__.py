"""What a save reports while it runs (``observer``: phases and writes), and what tests inject at
those points: a rank killed or a write failed (``fault``), a process ended at a named step of the
commit protocol (``crashpoints``, armed only by tests).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
