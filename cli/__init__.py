"""The ``switchyard`` command line: a package of its own, above everything it drives.

``main`` (the parser, and the commands that start a process: ``run``,
``worker``, ``migrate``, ``healthcheck``, ``chat``), ``accounts`` (users and
tokens), ``operations`` (models, workers, the reaper), ``scaling`` (the scaler
and the operators' scaling changes) and ``steering`` (which farm a command
steers). ``python -m cli`` and the ``switchyard`` console script run
:func:`cli.main.main`; nothing in the farm imports this package.
"""
