"""A seeded mixed OpenAI workload against a real server (loopback only), with clients that read
in full, disconnect mid-stream, or cancel before the first token."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Action = Literal["read", "disconnect", "cancel"]
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Short words for chat prompts: about one token each, so 64 of them stay well inside the
# server's max_model_len with 48 new tokens.
_WORDS = ("the of and to in is for on with as by at from self return def if else not none "
          "true false import class data value name list").split()


@dataclass(frozen=True)
class Planned:
    index: int
    path: str
    body: dict[str, Any]
    action: Action
    disconnect_after: int = 0  # content chunks read before a disconnect
    cancel_delay_s: float = 0.0  # between sending and closing, for a cancel

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool(self.body.get("stream_options", {}).get("include_usage"))


@dataclass
class Result:
    planned: Planned
    status: int | None = None  # None: the client closed before a status line (cancels)
    usage: dict[str, Any] | None = None
    content_chunks: int = 0
    complete: bool = False  # the whole response arrived (JSON body, or `data: [DONE]`)
    error: str | None = None
    body_text: str = field(default="", repr=False)

    def __str__(self) -> str:
        p = self.planned
        kind = (f"stream (include_usage={p.include_usage})" if p.stream else "non-streaming")
        return (f"request {p.index}: {p.action} {p.path} {kind} max_tokens="
                f"{p.body['max_tokens']} -> status {self.status}, {self.content_chunks} "
                f"content chunks, complete={self.complete}, error={self.error!r} "
                f"{self.body_text[:300]}")


def plan(n: int, seed: int, *, disconnect_share: float = 0.15,
         cancel_share: float = 0.10) -> list[Planned]:
    """`n` requests: completions and chat, streaming (with and without include_usage) and not,
    a few with `n: 2` or `stop`; `disconnect_share` of streams are dropped after 1-2 content
    chunks, `cancel_share` of all requests closed before any byte is read.

    Dropped and cancelled requests get max_tokens >= 24, ignore_eos and no stop strings: they
    cannot finish in the moment between the client's last read and the server noticing."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chat = rng.random() < 0.5
        stream = rng.random() < 0.6
        include_usage = stream and rng.random() < 0.5
        action: Action = "read"
        if stream and rng.random() < disconnect_share:
            action = "disconnect"
        elif rng.random() < cancel_share:
            action = "cancel"
        prompt_len = rng.randint(1, 64)
        body: dict[str, Any] = {"model": "model", "temperature": 1.0}
        if chat:
            body["messages"] = [{"role": "user",
                                 "content": " ".join(rng.choices(_WORDS, k=prompt_len))}]
        else:
            body["prompt"] = [rng.randrange(10, 2000) for _ in range(prompt_len)]
        if action == "read":
            body["max_tokens"] = rng.randint(1, 48)
            if rng.random() < 0.5:
                body["ignore_eos"] = True
            if rng.random() < 0.06:
                body["stop"] = rng.sample(["e", " ", "\n", "(", "s"], k=2)
            if rng.random() < 0.06:
                body["n"] = 2
        else:
            body["max_tokens"] = rng.randint(24, 48)
            body["ignore_eos"] = True
        if stream:
            body["stream"] = True
            if include_usage:
                body["stream_options"] = {"include_usage": True}
        out.append(Planned(i, CHAT if chat else COMPLETIONS, body, action,
                           disconnect_after=rng.randint(1, 2),
                           cancel_delay_s=rng.uniform(0.0, 0.05)))
    return out


def _content_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk carrying generated text (not chat's opening role chunk, not the usage chunk)."""
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _stream(client: httpx.AsyncClient, p: Planned, result: Result) -> None:
    async with client.stream("POST", p.path, json=p.body) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            result.body_text = (await resp.aread()).decode(errors="replace")[:2000]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.complete = True
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            if _content_chunk(chunk):
                result.content_chunks += 1
                if p.action == "disconnect" and result.content_chunks >= p.disconnect_after:
                    return  # leaving the block closes the unfinished response's connection


async def _cancel(host: str, port: int, p: Planned) -> None:
    """Send the request on a fresh connection and close it without reading a byte."""
    payload = json.dumps(p.body).encode()
    _, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST {p.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                 "Connection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    await asyncio.sleep(p.cancel_delay_s)
    writer.close()
    await writer.wait_closed()


async def _one(client: httpx.AsyncClient, host: str, port: int, p: Planned) -> Result:
    result = Result(p)
    try:
        if p.action == "cancel":
            await _cancel(host, port, p)
        elif p.stream:
            await _stream(client, p, result)
        else:
            resp = await client.post(p.path, json=p.body)
            result.status = resp.status_code
            result.body_text = resp.text[:2000]
            if resp.status_code == 200:
                result.usage = resp.json().get("usage")
                result.complete = True
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run(base_url: str, planned: list[Planned], concurrency: int,
              timeout_s: float = 180.0) -> list[Result]:
    """All planned requests, at most `concurrency` at a time, in plan order."""
    url = httpx.URL(base_url)
    host, port = url.host, int(url.port or 80)
    gate = asyncio.Semaphore(concurrency)
    # No keep-alive: a pooled connection that the server times out just as a request goes out
    # on it fails on the client's side (a POST is not retried), which is no server error.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        async def gated(p: Planned) -> Result:
            async with gate:
                return await _one(client, host, port, p)

        return list(await asyncio.gather(*(gated(p) for p in planned)))
