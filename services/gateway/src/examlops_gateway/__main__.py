import os

# The semantic cache's lookup (a matrix product) runs on the event loop: one BLAS thread keeps its
# tail flat (measured over 10,000 entries: ~0.3 ms p50 / 0.6 ms p99 single-threaded, against
# ~0.14 ms p50 / 12 ms p99 with threads competing for two cores). Set before numpy is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from ._app import main

main()
