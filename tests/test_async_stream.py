"""The server's per-request output stream (``server/async_engine._Stream``): outputs that queued while the reader
was busy come out as one (a step's worth of tokens per chunk under load), never past a finished output, an error
or another completion's output; a reader that keeps up gets each output alone."""

from __future__ import annotations

import asyncio

from specserve import CompletionOutput, RequestOutput
from specserve.server.async_engine import _deliver, _Stream


def _out(text: str, ids: list[int], index: int = 0, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids, "length" if finished else None)],
                         finished, delta_text=text[-1], delta_token_ids=ids[-1:], delta_index=index)


def test_outputs_that_queued_come_out_as_one_up_to_a_boundary():
    async def run():
        s = _Stream(asyncio.get_running_loop())
        _deliver([(s, _out("a", [1])), (s, _out("ab", [1, 2])), (s, _out("abc", [1, 2, 3]))])
        first = await s.get()  # three waiting: one output, the latest, with all three deltas
        assert (first.delta_text, first.delta_token_ids, first.outputs[0].text) == ("abc", [1, 2, 3], "abc")
        err = ValueError("x")
        for item in (_out("abcd", [1, 2, 3, 4], index=1), _out("abcde", [1, 2, 3, 4, 5], index=1), err,
                     _out("f", [6])):
            s.push(item)
        second = await s.get()
        assert second.delta_index == 1 and second.delta_text == "de" and await s.get() is err
        assert (await s.get()).delta_text == "f" and not s.items
        s.push(_out("g", [7], finished=True))
        s.push(_out("h", [8]))  # nothing merges into a finished output
        assert (await s.get()).finished and (await s.get()).delta_text == "h"
        s.push(_out("i", [9]))
        s.push(_out("j", [10], index=2))  # another completion's: not merged
        assert (await s.get()).delta_text == "i" and (await s.get()).delta_index == 2

        async def late():  # a reader waiting before anything arrives gets it when it does
            await asyncio.sleep(0.01)
            s.put(_out("k", [11]))

        task = asyncio.ensure_future(late())
        assert (await s.get()).delta_text == "k"
        await task

    asyncio.run(run())
