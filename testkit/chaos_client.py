"""The chaos run's clients: N people and agents using the host's OpenAI API at once, each
request's outcome written as one JSON line (testkit/chaos_plan.py judges them).

    python -m testkit.chaos_client --url http://127.0.0.1:8000 --out run.jsonl \
        --clients 3 --seconds 300 --seed 7          # draw from the pool until time is up
    python -m testkit.chaos_client --url ... --out ref.jsonl --reference   # each once, in turn

Runs inside the host's home (its network namespace), where the API listens on loopback.
A request that gets no answer by its deadline is written as "hang": the clients never
give up silently. Streams are read chunk by chunk: a choice finished twice, a second
[DONE], or text after a finish are recorded as duplicates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import aiohttp

from testkit.chaos_plan import Request, requests

DEADLINE_S = 300.0


async def one(session: aiohttp.ClientSession, url: str, req: Request, rid: str, deadline_s: float) -> dict:
    out = {"id": rid, "key": req.key, "kind": req.kind, "t0": time.time(), "deadline_s": deadline_s,
           "status": None, "choices": None, "error": None, "dupes": [], "max_gap_s": 0.0, "chunks": 0}
    body = dict(req.body, model="default")
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        msg = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        msg = text[:300]
                    out.update(status="error", error=f"HTTP {resp.status}: {msg}")
                elif req.stream:
                    await _read_stream(resp, out)
                else:
                    data = await resp.json()
                    out.update(status="done", choices=[
                        {"index": c["index"], "text": c["message"].get("content") or "",
                         "tool_calls": _calls(c["message"].get("tool_calls")), "finish_reason": c["finish_reason"]}
                        for c in sorted(data["choices"], key=lambda c: c["index"])])
                    seen = [c["index"] for c in data["choices"]]
                    if len(seen) != len(set(seen)):
                        out["dupes"].append(f"choice indices {seen}")
    except TimeoutError:
        out.update(status="hang")
    except (aiohttp.ClientError, ConnectionError, OSError) as exc:
        out.update(status="error", error=f"connection: {type(exc).__name__}: {exc}".strip())
    out["t1"] = time.time()
    return out


async def _read_stream(resp, out: dict):
    texts: dict[int, list[str]] = {}
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str] = {}
    done = 0
    last = time.monotonic()
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue          # an SSE comment: the keep-alive while the pipeline rearranges
        now = time.monotonic()
        if now - last > out["max_gap_s"]:
            out["max_gap_s"], out["gap_at"] = now - last, time.time()   # when (to find its episode)
        last = now
        data = line[5:].strip()
        if data == "[DONE]":
            done += 1
            if done > 1:
                out["dupes"].append("a second [DONE]")
            continue
        if done:
            out["dupes"].append("data after [DONE]")
        obj = json.loads(data)
        if "error" in obj:
            out.update(status="error", error=obj["error"].get("message") or "")
            continue
        out["chunks"] += 1
        for c in obj.get("choices", []):
            i = c["index"]
            d = c.get("delta", {})
            if (d.get("content") or d.get("tool_calls")) and i in finish:
                out["dupes"].append(f"choice {i} went on after it finished")
            texts.setdefault(i, []).append(d.get("content") or "")
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(i, {}).setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                if i in finish:
                    out["dupes"].append(f"choice {i} finished twice")
                finish[i] = c["finish_reason"]
    if out["status"] == "error":
        return
    if not done:
        out.update(status="error", error="")      # the stream ended without [DONE] or a reason
        return
    out.update(status="done", choices=[
        {"index": i, "text": "".join(texts.get(i, [])), "finish_reason": finish.get(i),
         "tool_calls": json.dumps([calls[i][k] for k in sorted(calls[i])], sort_keys=True) if i in calls else ""}
        for i in sorted(set(texts) | set(finish))])


def _calls(tool_calls) -> str:
    if not tool_calls:
        return ""
    return json.dumps([{"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                       for t in tool_calls], sort_keys=True)


async def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=DEADLINE_S)
    ap.add_argument("--reference", action="store_true", help="each request of the pool once, one at a time")
    ap.add_argument("--pause-file", default=None, help="while this file exists no request starts; once none "
                    "is in flight, <file>.ack is written (the harness samples memory at such quiet moments)")
    args = ap.parse_args(argv)
    pool = requests()
    n = 0
    with open(args.out, "a") as f:
        def write(o):
            f.write(json.dumps(o) + "\n")
            f.flush()

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            if args.reference:
                for req in pool:
                    write(await one(session, args.url, req, f"ref-{req.key}", args.deadline))
                return 0
            end = time.monotonic() + args.seconds
            inflight = 0

            async def paused():
                while args.pause_file and os.path.exists(args.pause_file) and time.monotonic() < end:
                    if inflight == 0:
                        with open(args.pause_file + ".ack", "w"):
                            pass
                    await asyncio.sleep(0.2)

            async def client(c: int):
                nonlocal n, inflight
                rng = random.Random(args.seed * 1000 + c)
                k = 0
                while time.monotonic() < end:
                    await paused()
                    if time.monotonic() >= end:
                        break
                    req = rng.choice(pool)
                    inflight += 1
                    try:
                        o = await one(session, args.url, req, f"c{c}-{k}", args.deadline)
                    finally:
                        inflight -= 1
                    k += 1
                    n += 1
                    write(o)
                    if o["status"] == "error":
                        await asyncio.sleep(rng.uniform(0.5, 2.0))   # a person tries again shortly

            await asyncio.gather(*(client(c) for c in range(args.clients)))
    print(f"{n} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
