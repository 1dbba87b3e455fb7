"""``python -m bench``: the full benchmark (engine, farm, llama-cpp-python peer)."""

import sys

from workers.openmp import spin_briefly

spin_briefly()  # the engine's and the worker's OpenMP wait alike (before torch loads)

from bench.farm import main  # noqa: E402

sys.exit(main())
