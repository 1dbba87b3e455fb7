"""``python -m bench``: the full benchmark (engine, farm, llama-cpp-python peer)."""

import sys

from bench.farm import main

sys.exit(main())
