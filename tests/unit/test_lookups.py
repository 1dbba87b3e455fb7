"""One load per key at a time (db/lookups.py) and the API's job-row cache built on it."""

from __future__ import annotations

import threading
import time

from db.lookups import RowCache


def test_a_lapsed_row_is_loaded_once_for_every_waiting_stream() -> None:
    rows = RowCache()
    loads: list[str] = []
    start = threading.Barrier(50)
    got: list[object] = []

    def load() -> object:
        loads.append("job-1")
        time.sleep(0.05)  # a query: the other streams arrive meanwhile
        return {"status": "running"}

    def stream() -> None:
        start.wait()
        got.append(rows.get("job-1", 10.0, load))

    threads = [threading.Thread(target=stream) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [{"status": "running"}] * 50
    assert loads == ["job-1"]
    # Another key is not held up by this one, and a value not kept is loaded again.
    assert rows.get("job-2", 10.0, lambda: None, keep=lambda v: v is not None) is None
    assert rows.get("job-2", 10.0, lambda: "ended", keep=lambda v: v is not None) == "ended"


def test_a_stored_value_is_seen_while_fresh_and_forgotten_on_demand() -> None:
    rows = RowCache()
    assert rows.peek("waiting:m", 1.0) is None  # never stored
    rows.put("waiting:m", 0)
    assert rows.peek("waiting:m", 1.0) == 0  # a falsy value is still a value
    time.sleep(0.06)
    assert rows.peek("waiting:m", 0.05) is None  # older than the caller allows
    assert rows.peek("waiting:m", 1.0) == 0
    # A local write (an operator's override) drops the copy: the next get loads.
    rows.forget("waiting:m")
    assert rows.peek("waiting:m", 1.0) is None
    assert rows.get("waiting:m", 1.0, lambda: 7) == 7
