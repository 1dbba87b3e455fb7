"""``python -m workers``: the command line's name before it moved to ``cli/``.

Kept so that images, manifests and scripts written for it still run; it is
``python -m cli``, the same program (spin count first, then the parser).
"""

import runpy

runpy.run_module("cli", run_name="__main__", alter_sys=True)
