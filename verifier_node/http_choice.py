"""A generation's answer in OpenAI's shapes (``ChoiceRun``: one choice, its text held back
where a stop string may begin, its logprobs beside it), and a response of one or more choices
(``n``), streamed (``stream_choices``: their chunks as they come, then usage and ``[DONE]``) or
whole (``whole_choices``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from bisect import bisect_left

import anyio
from fastapi import Request
from fastapi.responses import Response

from edgespec.config import is_lossy
from edgespec.models.text_stream import TextStream

from .admission import Admission
from .api_errors import ApiError
from .logprob_shapes import ChoiceLogprobs, LogprobShapes, joined
from .tickets import ShuttingDown, Ticket

# the status logged for a request whose client left before it was read whole (nginx's "client
# closed request"; no client receives it)
CLIENT_CLOSED = 499
log = logging.getLogger("edgespec.http")


class ChoiceRun:
    """One admitted generation turned into OpenAI's response shapes: the choice ``index`` of
    its response (a request with ``n`` > 1 has one a choice, all under the first's ``id``)."""

    def __init__(self, admission: Admission, ticket: Ticket, params, chat: bool, model: str,
                 shapes: LogprobShapes | None = None, index: int = 0, prompt_index: int = 0,
                 echo: tuple[str, list[int]] | None = None):
        self.admission, self.ticket, self.p, self.chat, self.model = (admission, ticket, params,
                                                                      chat, model)
        self.index = index
        self.prompt_index = prompt_index  # which prompt of a completions batch it answers
        self.id = ("chatcmpl-" if chat else "cmpl-") + ticket.session_id
        self.created = int(time.time())
        self.pieces: list[str] = []
        # completions' ``echo``: the prompt's text as a stream of its tokens writes it, where
        # each of its tokens begins in it (``echo_texts``, decoded off the event loop); the
        # output's text then continues that stream (a tokenizer that writes a word's leading
        # space only after a text's start, a character split between the prompt and the output)
        if not chat and params.echo and echo is None:
            raise ValueError("an echoed choice needs its prompt's text (echo_texts)")
        self.echo = None if chat or not params.echo else echo
        self._echoed_logprobs: dict | None = None  # ``echo_logprobs``'s, once read
        self.text = TextStream(admission.tokenizer, self.pieces.append,
                               shown_ids=ticket.request.prompt_ids if self.echo else ())
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.shown = 0  # characters of the text already sent (or decided) before any stop
        self.starts: list[int] = []  # where each token read begins in the output's text
        self.read = False  # the response began reading the ticket (``_events``)
        # the logprobs asked for, each sent with the chunk its token's text begins in
        self.logprobs = ChoiceLogprobs(shapes, ticket, chat, self.starts,
                                       len(self.echo[0]) if self.echo else 0) \
            if shapes is not None and ticket.request.logprobs is not None else None

    def cancel_if_never_read(self) -> None:
        """A streamed response whose client left before its first read never followed its
        ticket, so no reader's leaving cancels it: its session would hold a KV slot to its
        end. Run after the response (Starlette's background): cancelled as an orphan then."""
        if not self.read:
            self.admission.scheduler.cancel(self.ticket.session_id, orphaned=True)

    async def _events(self):
        """Yields text increments (held back where a stop string may begin), then returns with
        ``finish_reason`` set. Cancels the session when a stop string ends it."""
        self.read = True
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        wake = lambda: loop.call_soon_threadsafe(changed.set)  # noqa: E731
        t = self.ticket
        t.listeners.append(wake)
        cursor, full = 0, ""
        hold = max((len(s) for s in self.p.stop), default=1) - 1
        try:
            with self.admission.follow(t):
                while True:
                    changed.clear()
                    with t.cond:
                        new, result, error = t.tokens[cursor:], t.result, t.error
                    if new:
                        cut = None
                        for tok in new:  # a token at a time: usage stops at the stop string
                            cursor += 1
                            self.starts.append(len(full))
                            self.text([tok])
                            # a stop string not in the text so far ends in what comes now
                            since = max(0, len(full) - hold)
                            full += "".join(self.pieces)
                            self.pieces.clear()
                            cut = _find_stop(full, self.p.stop, since)
                            if cut is not None:
                                break
                        self.completion_tokens = cursor
                        if cut is not None:
                            self.finish_reason = "stop"
                            piece, self.shown = full[self.shown:cut], cut
                            yield piece
                            self.admission.scheduler.cancel(t.session_id, reason="stop")
                            while not t.ended:  # for its stats; the cancel ends it promptly
                                changed.clear()
                                if not t.ended:
                                    await changed.wait()
                            return
                        # held back even once the result is in: the flush below may add to
                        # the text a stop string begins in
                        safe = len(full) - hold if error is None else len(full)
                        if safe > self.shown:
                            piece, self.shown = full[self.shown:safe], safe
                            yield piece
                        continue
                    if isinstance(error, ShuttingDown):  # the SDK resumes such a session by
                        # id; over HTTP it is sent again, to this server once back or another
                        raise ApiError(503, "generation failed: the verifier is shutting down; "
                                            "send the request again", "server_error")
                    if error is not None:
                        raise ApiError(500, f"generation failed: {error}", "server_error")
                    if result is not None and result.finish_reason not in ("stop", "length"):
                        # cancelled on the server (an operator's Cancel): not a whole answer,
                        # whatever it holds, so not a finish OpenAI's clients would take as one
                        raise ApiError(503, f"the session was {result.finish_reason} on the "
                                       f"server after {cursor} token(s), before it finished",
                                       "server_error", retry=False)
                    if result is not None:
                        self.text.flush()  # an output that ends mid-character: its last bytes
                        since = max(0, len(full) - hold)
                        full += "".join(self.pieces)
                        self.pieces.clear()
                        cut = _find_stop(full, self.p.stop, since)  # one the flushed text ends
                        end = len(full) if cut is None else cut
                        if end > self.shown:
                            piece, self.shown = full[self.shown:end], end
                            yield piece
                        self.finish_reason = result.finish_reason if cut is None else "stop"
                        return
                    await changed.wait()
        finally:
            t.listeners.remove(wake)

    def _stats(self) -> dict:
        res = self.ticket.result
        s = res.stats if res is not None else None
        return {"session_id": self.ticket.session_id, "device": self.ticket.device or None,
                "drafted": s.draft_tokens if s else 0, "accepted": s.accepted_tokens if s else 0,
                "acceptance_rate": round(s.acceptance_rate, 4) if s else 0.0,
                "mean_acceptance_length": round(s.mean_acceptance_length, 4) if s else 1.0,
                "lossless": not (s.lossy if s else is_lossy(self._mode())),
                "verify": s.verify if s else self._mode(),
                "lenient_tokens": s.lenient_tokens if s else 0}

    def _mode(self) -> str:
        return self.ticket.request.verify or self.admission.scheduler.engine.cfg.verify

    def _choice(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        """A streamed chunk's choice, with the logprobs of the tokens whose text begins in it
        (the last chunk: the rest, a stop token's, those past a stop string)."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs.upto(self.completion_tokens if finish is not None
                                          else bisect_left(self.starts, self.shown))
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else \
                ({"content": text} if text else {})
            return {"index": self.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish}
        if first and self.echo is not None:  # the prompt, then the completion's first text
            text, logprobs = self.echo[0] + (text or ""), joined(self._echoed_logprobs, logprobs)
        return {"index": self.index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish}

    async def _read_echo_logprobs(self) -> None:
        """The echoed prompt's logprobs (with ``logprobs``), read once its prompt was in (a
        first chunk or a whole answer comes after that), in a worker thread: a long prompt's
        tokens' texts and alternatives would hold the event loop, and every other client and
        /health with it."""
        if self.logprobs is None or self.echo is None or self._echoed_logprobs is not None:
            return
        prompt = self.ticket.request.prompt_ids
        entries = self.ticket.prompt_logprobs
        if entries is None or len(entries) != len(prompt) - 1:  # a guard, never sent short
            raise ApiError(500, "the prompt's logprobs were not read", "server_error")
        self._echoed_logprobs = await anyio.to_thread.run_sync(
            self.logprobs.shapes.echoed, prompt, entries, self.echo[1])

    def _chunk(self, choices: list, **extra) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "system_fingerprint": self.admission.kernels, "choices": choices, **extra}
        return f"data: {json.dumps(obj)}\n\n"

    async def chunks(self):
        """The choice's streamed chunks (``data:`` lines): its text as it comes, then its finish
        with the ``edgespec`` figures. Raises ApiError where its generation failed."""
        first = True
        async for text in self._events():
            if first:
                yield await self._first_chunk(text)
                first = False
            elif text:
                yield self._chunk([self._choice(text, None)])
        if first:  # no text at all (an end of sequence first): the role is still said
            yield await self._first_chunk("")
        yield self._chunk([self._choice(None, self.finish_reason)], edgespec=self._stats())

    async def _first_chunk(self, text: str) -> str:
        """The first chunk: with an echo, the prompt's text and logprobs before the completion's
        first text, rendered in a worker thread (a long prompt's JSON would hold the loop)."""
        await self._read_echo_logprobs()
        choice = self._choice(text, None, True)
        if self.echo is None:
            return self._chunk([choice])
        return await anyio.to_thread.run_sync(self._chunk, [choice])

    async def whole(self) -> tuple[dict, dict]:
        """The choice whole, and its ``edgespec`` figures."""
        text = "".join([t async for t in self._events()])
        logprobs = self.logprobs.upto(self.completion_tokens) if self.logprobs else None
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs, "finish_reason": self.finish_reason}, self._stats()
        if self.echo is not None:
            await self._read_echo_logprobs()
            text, logprobs = self.echo[0] + text, joined(self._echoed_logprobs, logprobs)
        return {"index": self.index, "text": text, "logprobs": logprobs,
                "finish_reason": self.finish_reason}, self._stats()


def echo_texts(tokenizer, prompts: list[list[int]]) -> list[tuple[str, list[int]]]:
    """``decoded`` of each prompt, each distinct prompt decoded once (the ``n`` choices of a
    prompt share it). Run it in a worker thread: decoding a prompt token by token costs a few
    tokenizer calls a token, seconds for a batch of long prompts, which on the event loop
    would hold every other client and /health."""
    texts: dict[tuple[int, ...], tuple[str, list[int]]] = {}
    out = []
    for ids in prompts:
        key = tuple(ids)
        if key not in texts:
            texts[key] = decoded(tokenizer, ids)
        out.append(texts[key])
    return out


def decoded(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """``ids`` as text, as a stream of them writes it (``TextStream``: to its last whole
    character; a stream given them as ``shown_ids`` goes on from there), and where each
    token's text begins in it."""
    pieces: list[str] = []
    stream = TextStream(tokenizer, pieces.append)
    text, starts = "", []
    for tok in ids:
        starts.append(len(text))
        stream([tok])
        text += "".join(pieces)
        pieces.clear()
    return text, starts


def _find_stop(text: str, stops: list[str], since: int = 0) -> int | None:
    """Where the earliest stop string begins in ``text`` from ``since`` on, or None (a stream
    searches only where one may begin in what came since its last search: a search of the
    whole text at every token was quadratic in the output, on the event loop)."""
    hits = [i for i in (text.find(s, since) for s in stops) if i >= 0]
    return min(hits) if hits else None


async def stream_choices(runs: list[ChoiceRun], include_usage: bool):
    """A response's Server-Sent Events: every choice's chunks as they come (interleaved where
    ``n`` > 1), a usage chunk if asked, ``[DONE]``. A choice that fails ends the response with
    an ``error`` event, the other choices cancelled."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for chunk in run.chunks():
                await queue.put(chunk)
            await queue.put(None)
        except ApiError as e:
            await queue.put(e)
        except Exception:  # a bug of ours: said, not left for the reader to wait on
            log.exception("a streamed choice of session %s failed", run.ticket.session_id)
            await queue.put(ApiError(500, "generation failed: internal error", "server_error"))

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        done = 0
        while done < len(runs):
            item = await queue.get()
            if isinstance(item, ApiError):
                error = {"error": {"message": str(item), "type": item.kind,
                                   "param": item.param, "code": item.code}}  # the body's shape
                yield f"data: {json.dumps(error)}\n\n"
                break
            if item is None:
                done += 1
                continue
            yield item
        else:
            if include_usage:
                yield runs[0]._chunk([], usage=_usage(runs))
        yield "data: [DONE]\n\n"
    finally:
        _stop_choices(runs, tasks)


async def whole_choices(runs: list[ChoiceRun], request: Request) -> Response:
    """The whole response; a client that disconnects meanwhile cancels its sessions (a plain
    endpoint is not cancelled by the server, so a watcher does it)."""
    async def left() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    work: asyncio.Future = asyncio.gather(*[r.whole() for r in runs])
    watch = asyncio.create_task(left())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():  # the client is gone: stop following (the sessions are cancelled)
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        return Response(status_code=CLIENT_CLOSED)
    try:
        answers = work.result()
    except BaseException:  # one choice failed: the others' sessions end with it
        _stop_choices(runs, [])
        raise
    first = runs[0]
    stats = [s for _, s in answers]
    body = {"id": first.id, "object": "chat.completion" if first.chat else "text_completion",
            "created": first.created, "model": first.model,
            "system_fingerprint": first.admission.kernels,
            "choices": [c for c, _ in answers], "usage": _usage(runs),
            "edgespec": stats[0] if len(stats) == 1 else stats}
    # rendered (the response made) in a worker thread: n choices of long echoed prompts with
    # their logprobs make megabytes of JSON, which on the event loop would hold every other
    # client and /health
    return await anyio.to_thread.run_sync(rendered, body)


def rendered(body: dict) -> Response:
    """``JSONResponse(body)``, the same bytes, its choices rendered one at a time: a JSON
    encoder's call holds the interpreter's lock throughout, so one call over a response of 64
    echoed 511-token prompts with 20 logprobs a token (17 MB) held the event loop, and
    ``/health`` with it, for a second; between two choices' calls the loop takes its turn."""
    def dumps(obj) -> str:  # as JSONResponse renders
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":"))

    choices = "[" + ",".join(dumps(c) for c in body["choices"]) + "]"
    text = "{" + ",".join(dumps(k) + ":" + (choices if k == "choices" else dumps(v))
                          for k, v in body.items()) + "}"
    return Response(text.encode("utf-8"), media_type="application/json")


def _usage(runs: list[ChoiceRun]) -> dict:
    """Each prompt once, every choice's completion tokens (as OpenAI counts a response of
    ``n``, or of a batch of prompts)."""
    firsts = {r.prompt_index: r for r in reversed(runs)}  # each prompt's first choice
    prompt = sum(len(r.ticket.request.prompt_ids) for r in firsts.values())
    completion = sum(r.completion_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _stop_choices(runs: list[ChoiceRun], tasks: list[asyncio.Task]) -> None:
    """The choices' readers stopped and any session still running cancelled (a response that
    ended early: an error, a client gone)."""
    for t in tasks:
        t.cancel()
    for r in runs:
        if not r.ticket.ended:
            r.admission.scheduler.cancel(r.ticket.session_id)
