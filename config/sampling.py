"""The bounds of a request's sampling parameters: one rule, checked at every door.

The API's request bodies (``api/schemas.py``, ``api/tgi.py``), the model
catalog's defaults (``config/catalog.py``) and the engine
(``models/sampling.py``) all check against these. The OpenAI routes cap
``temperature`` at :data:`OPENAI_MAX_TEMPERATURE` as OpenAI's own API does;
that is OpenAI's rule, not ours.
"""

from __future__ import annotations

MAX_TEMPERATURE = 5.0
"""Highest temperature (0 is greedy)."""
OPENAI_MAX_TEMPERATURE = 2.0
"""OpenAI's own cap on ``temperature``, kept on the OpenAI-compatible routes."""
MAX_REPETITION_PENALTY = 10.0
"""Highest repetition penalty (1 is none; it must be above 0)."""
MAX_TOP_K = 100_000
"""Highest ``top_k`` (0 is off)."""
MAX_STOP_STRINGS = 8
"""Stop strings one request may give."""
MAX_STOP_CHARS = 256
"""Characters in one stop string (at least 1)."""
MAX_SEED = 2**63 - 1
"""Highest seed (seeds are 0 to 2**63 - 1)."""
