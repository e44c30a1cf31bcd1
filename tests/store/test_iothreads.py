"""IOThreads: every block once, really on several threads, the other threads taking
over from a held-up one, and a failure raised only once every thread has stopped."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.store.iothreads import IOThreads


@given(count=st.integers(0, 40), threads=st.integers(1, 5))
def test_every_index_is_worked_exactly_once(count: int, threads: int) -> None:
    io = IOThreads(threads, "test")
    seen: list[int] = []
    io.for_each(count, seen.append)  # list.append is atomic under the GIL
    io.close()
    assert sorted(seen) == list(range(count))


def test_the_threads_work_at_once_and_the_caller_is_one_of_them() -> None:
    io = IOThreads(3, "test")
    barrier = threading.Barrier(3, timeout=30)  # broken (raises) unless 3 threads meet
    where: dict[int, int] = {}

    def work(index: int) -> None:
        where[index] = threading.get_ident()
        if index < 3:
            barrier.wait()

    io.for_each(9, work)
    io.close()
    assert len(set(where[i] for i in range(3))) == 3
    assert threading.get_ident() in where.values()


def test_a_held_up_thread_leaves_the_rest_of_the_job_to_the_others() -> None:
    io = IOThreads(2, "test")
    rest_done = threading.Event()
    where: dict[int, int] = {}

    def work(index: int) -> None:
        where[index] = threading.get_ident()
        if index == 0:  # held up until every other block is done, by another thread
            assert rest_done.wait(timeout=30)
        elif len(where) == 10:
            rest_done.set()

    io.for_each(10, work)
    io.close()
    assert {where[i] for i in range(1, 10)} == {where[1]} != {where[0]}


def test_a_failure_stops_new_blocks_and_is_raised_after_the_others_stop() -> None:
    io = IOThreads(2, "test")
    other_taken = threading.Event()
    failing = threading.Event()
    finished: list[int] = []

    def work(index: int) -> None:
        if index == 0:  # fails once the other thread is inside a block
            assert other_taken.wait(timeout=30)
            failing.set()
            raise OSError("block 0 failed")
        other_taken.set()
        assert failing.wait(timeout=30)  # finishes after block 0 has raised
        finished.append(index)

    with pytest.raises(OSError, match="block 0 failed"):
        io.for_each(100, work)
    assert finished[:1] == [1]  # the block in flight finished before the raise
    assert len(finished) < 10  # and (nearly) nothing was taken after the failure
    io.close()


def test_a_helper_failure_is_raised_and_the_threads_restart_after_close() -> None:
    io = IOThreads(2, "test")
    caller = threading.get_ident()
    helper_failed = threading.Event()

    def work(index: int) -> None:
        if threading.get_ident() != caller:
            helper_failed.set()
            raise KeyError("the helper's block")
        assert helper_failed.wait(timeout=30)  # the caller's block outlasts the helper's

    with pytest.raises(KeyError, match="the helper's block"):
        io.for_each(4, work)
    io.close()
    seen: list[int] = []
    io.for_each(3, seen.append)  # usable again after close
    io.close()
    assert sorted(seen) == [0, 1, 2]


def test_fewer_than_one_thread_is_refused() -> None:
    with pytest.raises(ValueError, match="io_threads must be >= 1, got 0"):
        IOThreads(0, "test")
