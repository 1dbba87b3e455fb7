"""The fleet of workers, as the API, the workers and the scaler all see it.

Both sides import this package; it imports none of ``api/``, ``tasks/`` or
``workers/``.
``registry`` (heartbeats: typed :class:`~fleet.registry.WorkerReport`, with a
TTL, and the registry of every worker seen), ``capacity`` (ready, starting and
desired replicas per model), ``policy`` (the pure desired-replicas function),
``schedule`` (time-of-day windows), ``scaler_state`` (the scaler's Redis state
and its wake-up), ``controls`` (the operators' scaling changes), ``tokenizers`` (the
tokenizer files a worker publishes for its model) and ``reaper`` (re-queues
the jobs of lost workers).
"""
