"""A job's life outside the database, as the API, the workers and the reaper all see it.

Both sides import this package; it imports none of ``api/``, ``tasks/``,
``workers/`` or ``fleet/``. ``queues`` (queue naming and the task name),
``messages`` (the generate message: sending it, and the broker's view of which
jobs' messages it holds), ``events`` (each job's event log: a Redis Stream plus
a pub/sub channel), ``joblog`` (one log line per event in a job's life),
``metrics`` (the farm's counters and histograms of jobs, tokens and requests,
kept in Redis so every process adds to the same numbers), ``limits`` (the
callers' rate and concurrency limits and the queues' length, in Redis),
``errors`` (why a request is refused, with no HTTP) and ``service``
(:class:`~jobs.service.JobService`: submit, enqueue, cancel and expire jobs,
for every front door).
"""
