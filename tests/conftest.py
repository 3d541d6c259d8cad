import os

# Ranks started by the harness set this themselves; the test process itself stays light too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
