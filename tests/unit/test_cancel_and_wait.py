"""`streams.runner.cancel_and_wait`: a background loop that swallows a cancel (as a client call can turn one into
its own timeout error) still ends, where one cancel and a gather would wait for it forever."""

from __future__ import annotations

import asyncio
import gc

from streams.runner import cancel_and_wait


async def _swallows_first_cancels(n: int, swallowed: list[int]) -> None:
    """A retry loop that takes its first `n` cancels for a transient error and goes on."""
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if len(swallowed) >= n:
                raise
            swallowed.append(1)


def test_a_loop_that_swallows_its_cancels_still_ends() -> None:
    async def main() -> tuple[bool, bool, int]:
        swallowed: list[int] = []
        once = asyncio.create_task(_swallows_first_cancels(2, swallowed))
        await asyncio.sleep(0.02)
        once.cancel()
        _, pending = await asyncio.wait({once}, timeout=0.2)
        one_cancel_left_it_running = once in pending  # what gather after one cancel would wait on, forever
        await asyncio.wait_for(cancel_and_wait(once, every_s=0.05), timeout=5.0)
        return one_cancel_left_it_running, once.cancelled(), len(swallowed)

    ran_on, cancelled, swallowed = asyncio.run(main())
    assert ran_on
    assert cancelled
    assert swallowed == 2


def test_none_and_finished_tasks_are_fine_and_errors_are_retrieved_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def cancel_becomes_an_error() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("a client call's own error") from None

    async def main() -> None:
        t = asyncio.create_task(fails())
        u = asyncio.create_task(cancel_becomes_an_error())
        await asyncio.sleep(0)
        await cancel_and_wait(None, t, u)
        await cancel_and_wait()
        assert t.done() and u.done()  # (u.exception() here would retrieve it: the check below is the point)

    unretrieved: list[dict[str, object]] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        loop.run_until_complete(main())
        gc.collect()  # a task whose exception nobody retrieved reports it when it is collected
    finally:
        loop.close()
    assert not unretrieved, unretrieved
