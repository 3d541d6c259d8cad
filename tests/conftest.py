import getpass
import os
import tempfile

# Ranks started by the harness set this themselves; the test process itself stays light too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Note: one inductor cache per CPU kernel set. .ci/run repeats the numerics tests under
# ATEN_CPU_CAPABILITY=avx2/default after the native run; inductor's cache does not key its
# compiled kernels by that setting, so a second run reused the native run's kernels and the
# compiled models computed garbage (seen: every compile parity case off by inf after an AVX-512
# run). A capability gets a cache of its own; the native run keeps inductor's default.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    try:
        _user = getpass.getuser()
    except Exception:  # no login name in some containers
        _user = "user"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{_user}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}"
    )
