"""tasks/combine.py with real threads: a batch never holds one key twice, each caller gets
its own result, a batch's error reaches every caller it held, and callers arriving while a
batch runs share the next one."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from tasks.combine import Combiner


def _run_all(
    combiner: Combiner[tuple[int, int], str], requests: list[tuple[int, int]]
) -> dict[int, object]:
    """Each request (caller number, key) submitted from a thread of its own, all at once."""
    results: dict[int, object] = {}
    start = threading.Barrier(len(requests))

    def call(request: tuple[int, int]) -> None:
        start.wait()
        try:
            results[request[0]] = combiner.submit(request, [request[1]])
        except Exception as exc:  # noqa: BLE001 (what the caller got is what is asserted)
            results[request[0]] = exc

    threads = [threading.Thread(target=call, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_combined_callers_share_batches_without_a_key_twice_and_get_their_own_results() -> None:
    batches: list[list[tuple[int, int]]] = []

    def run(requests: list[tuple[int, int]]) -> Sequence[str]:
        batches.append(list(requests))
        time.sleep(0.02)  # the next callers queue meanwhile
        return [f"caller {n} key {k}" for n, k in requests]

    combiner: Combiner[tuple[int, int], str] = Combiner(run, limit=50)
    requests = [(n, n % 10) for n in range(40)]  # every key asked for by four callers
    results = _run_all(combiner, requests)
    assert results == {n: f"caller {n} key {k}" for n, k in requests}
    assert sum(len(b) for b in batches) == 40
    assert combiner.requests == 40
    assert all(len({k for _, k in b}) == len(b) for b in batches), "a key twice in one batch"
    assert len(batches) < 40
    assert combiner.batches == len(batches)


def test_a_combined_batch_that_raises_raises_in_each_caller_it_held() -> None:
    class Broken(Exception):
        pass

    def run(requests: list[tuple[int, int]]) -> Sequence[str]:
        time.sleep(0.02)
        if any(k == 0 for _, k in requests):
            raise Broken("this batch failed")
        return ["ok"] * len(requests)

    combiner: Combiner[tuple[int, int], str] = Combiner(run, limit=50)
    results = _run_all(combiner, [(n, n) for n in range(12)])
    assert isinstance(results[0], Broken)
    # Those that shared caller 0's batch failed with it; the rest succeeded: none was lost.
    assert all(r == "ok" or isinstance(r, Broken) for r in results.values())
    assert len(results) == 12
    assert combiner.requests == 12


def test_a_lone_caller_runs_its_own_request_at_once() -> None:
    combiner: Combiner[int, int] = Combiner(lambda requests: [r * 2 for r in requests], limit=4)
    started = time.monotonic()
    assert combiner.submit(21, [21]) == 42
    assert time.monotonic() - started < 1.0
    assert (combiner.batches, combiner.requests) == (1, 1)
    with pytest.raises(ValueError):
        Combiner(lambda requests: [], limit=4).submit(1, [1])  # a result missing: zip's error
