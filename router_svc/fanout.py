"""Several router Streams behind one HTTP request (`n` > 1, or a batch of prompts): submitted
together, read as one sequence of (choice index, Chunk), closed together.

- `submit_all`: every choice is admitted or none is — a refusal part way (429 at the admission
  limit) closes the ones already submitted, which aborts them on their decode workers.
- `Choices` iterates the merged chunks in arrival order. One choice reads its Stream directly (the
  common case costs no task); several are read by one pump task each into a shared queue. The first
  RouterError from any choice ends the whole request.
- `close()` (always, in `finally:`) cancels the pumps and closes every Stream: a client that went
  away, or an error in one choice, aborts the others on D.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from router_svc.core import Chunk, Router, Stream
from router_svc.errors import RouterError
from tandem.sampling_params import BeamSearchParams, SamplingParams

_DONE = object()


def choice_ids(rid: str, count: int) -> list[str]:
    """Worker-side request ids: the client's id for a single choice, `id-i` for each of several."""
    return [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]


def submit_all(router: Router, prompts: list[list[int]], params: list[SamplingParams], n: int,
               rid: str, beam: BeamSearchParams | None = None) -> list[Stream]:
    """`beam`: one beam search per prompt (`params` has one entry per prompt), its n hypotheses in one answer."""
    per_prompt = beam is not None
    streams: list[Stream] = []
    try:
        for i, (sub_id, p) in enumerate(zip(choice_ids(rid, len(params)), params)):
            streams.append(router.submit(prompts[i] if per_prompt else prompts[i // n], p, sub_id, beam=beam))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


class Choices:
    def __init__(self, streams: list[Stream]) -> None:
        self.streams = streams
        self._tasks: list[asyncio.Task] = []

    def __aiter__(self) -> AsyncIterator[tuple[int, Chunk]]:
        return self._single() if len(self.streams) == 1 else self._merged()

    async def _single(self) -> AsyncIterator[tuple[int, Chunk]]:
        async for chunk in self.streams[0]:
            yield 0, chunk

    async def _merged(self) -> AsyncIterator[tuple[int, Chunk]]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int, stream: Stream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((index, chunk))
            except RouterError as exc:
                queue.put_nowait((index, exc))
                return
            queue.put_nowait((index, _DONE))

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        left = len(self.streams)
        while left:
            index, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, RouterError):
                raise item
            else:
                yield index, item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            stream.close()
