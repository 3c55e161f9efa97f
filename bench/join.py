"""A friend joins or leaves (with notice) mid-reply: how long does the reply stop, and is
it the same reply?

For each kind, setup and context length, a fresh pipeline on this machine (the default
model) starts a greedy reply; once it has 10 tokens:

  join   (the head and one stage process) a new stage process is started and offered
         to the head, as a friend's node is by its invite: the head takes it in;
  leave  (the head and two stage processes) the middle one is sent SIGTERM: it says it
         is leaving (as on sharing off, its owner's limits, sleep) and waits for the
         head to let it go, at most 10 s.

Either way the head rearranges (every conversation replays on the new split); the reply
stops 20 steps after that, and the same request asked again of the new arrangement must
give the same tokens.

  --ahead on   what the product does: the machines load what their next share lacks
               while the pipeline serves (the newcomer its whole share; the stages
               serving now, the layers the shift gives them; for a leave, the leaving
               stage serves on meanwhile), and the rearrangement keeps it
               (engine/pipeline/recovery_driver.py _take_in, _take_out);
  --ahead off  POTLUCK_LOAD_AHEAD=0: they load during the rearrangement, while every
               conversation waits (as before).

Columns: the reply's longest stop between two steps' tokens after the change (what the
person chatting sees; a step may bring several tokens, by speculation), the usual gap
before it; the stop split into the wait from the last token to the rearrangement's
start, the rearrangement (letting go, reaching the machines, each taking its new share)
and its replay (the conversation's history prefilled again) up to the next token; how
long the machines loaded ahead while the reply went on, the layers kept in memory
through the rearrangement, and whether the reply is token for token the one asked
again. The ratio is the longest stop with loading ahead over without, per kind, setup
and context.

On this machine every process shares the CPU: loading ahead slows the reply a little
instead of stopping it; friends' own computers would not.

    .venv/bin/python bench/join.py [--kinds join,leave] [--threads 1] [--contexts 100,1000]
        [--ahead on,off] [--tokens 4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from failover import parse_setups, setup_name  # noqa: E402  (bench/, beside this script)

CHANGE_AT = 10
TEXT = ("The history of the city goes back many centuries. Merchants came from far away to trade "
        "salt, cloth and spices, and the river carried their boats to the sea. ")


async def one_row(kind: str, context: int, threads: int | None, n_tokens: int) -> dict:
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Delta
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.local import LocalStages

    pipe = await launch(PipelineConfig(model="default", stages=2 if kind == "join" else 3, threads=threads))
    head = pipe.head
    head.eos_ids = set()
    ids = head.tokenizer(TEXT * (context // 20 + 2))["input_ids"][:context]
    newcomer = LocalStages(1, threads=threads or 1)
    done_event = "rejoined" if kind == "join" else "recovered"
    try:
        async def change():
            if kind == "join":
                (address,) = await newcomer.start()
                head.offer(address)
            else:   # the middle stage's owner stops it: it says it is leaving, with notice
                pipe.local.procs[0].send_signal(signal.SIGTERM)

        # the reply runs until the change is done and 20 more steps came (or n_tokens),
        # then stops; the same reply is then asked of the new arrangement for the check
        h = head.submit(list(ids), SamplingParams(greedy=True, max_tokens=n_tokens))
        got, times, at, done_at = [], [], None, None
        async for ev in h:
            if not isinstance(ev, Delta):
                break
            got.extend(ev.token_ids)
            times.append(time.time())     # a step's tokens arrive together (speculation)
            if at is None and len(got) >= CHANGE_AT:
                at = times[-1]   # the change comes right after this step's tokens
                asyncio.ensure_future(change())   # off the reply's loop: its tokens keep coming
            if done_at is None and any(e["event"] == done_event for e in head.events):
                done_at = len(times)
            if done_at is not None and len(times) >= done_at + 20:
                h.cancel()
        deadline = time.monotonic() + 300
        while not any(e["event"] == done_event for e in head.events) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        back = next((e for e in head.events if e["event"] == done_event), None)
        await head.drop_kept()   # the reference computes the prompt on the new split
        reference = await tokens_of(head, ids, len(got))
        before = [t for t in times if t < at]
        after = [t for t in times if t >= at]
        gaps = [b - a for a, b in zip(after, after[1:])]
        # a step's tokens come as separate deltas within a millisecond: the gaps between steps
        usual = [g for g in (b - a for a, b in zip(before, before[1:])) if g > 1e-3]
        # the stop, split: the last token before the rearrangement began, the rearrangement,
        # its replay up to the next token
        lead = replay = None
        if back is not None:
            began = back["t"] - back["seconds"]
            prior = [t for t in times if t <= began]
            nxt = [t for t in times if t > back["t"]]
            lead = began - prior[-1] if prior else None
            replay = nxt[0] - back["t"] if nxt else None
        ahead = back.get("ahead_s") if back else None
        if kind == "leave":   # from its notice to its loss: the others loading its layers
            notice = next((e for e in head.events if e["event"] == "leaving"), None)
            left = next((e for e in head.events if e["event"] == "left"), None)
            ahead = left["t"] - notice["t"] if notice and left else None
        return {"kind": kind, "setup": setup_name(threads), "context": len(ids),
                "stop_s": max(gaps) if gaps else None, "gap_s": statistics.median(usual) if usual else None,
                "rearrange_s": back["seconds"] if back else None, "ahead_s": ahead,
                "kept": back.get("kept_layers") if back else None, "layers": back.get("layers") if back else None,
                "lead_s": lead, "replay_s": replay,
                "during": done_at is not None, "identical": got == reference, "stages_after": head.n_stages}
    finally:
        await pipe.close()
        await newcomer.stop()


async def tokens_of(head, ids, n) -> list[int]:
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Delta

    out = []
    async for ev in head.submit(list(ids), SamplingParams(greedy=True, max_tokens=n)):
        if isinstance(ev, Delta):
            out.extend(ev.token_ids)
        else:
            assert ev.error is None, ev.error
    return out


def fmt(v, spec=".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="100,1000")
    ap.add_argument("--kinds", default="join,leave", help="join, leave or join,leave")
    ap.add_argument("--threads", default="1",
                    help="torch threads per process, comma-separated, or 'default' (no --threads, as "
                         "potluck serve runs; the newcomer then takes 1)")
    ap.add_argument("--ahead", default="on,off", help="on, off or on,off (side by side)")
    ap.add_argument("--tokens", type=int, default=4000,
                    help="the most the reply runs: it stops 20 steps after the newcomer is in")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    rows = []
    for kind, threads, context, ahead in itertools.product(
            args.kinds.split(","), parse_setups(args.threads), [int(c) for c in args.contexts.split(",")],
            args.ahead.split(",")):
        os.environ["POTLUCK_LOAD_AHEAD"] = "1" if ahead == "on" else "0"   # read by the head, in this process
        try:
            row = asyncio.run(one_row(kind, context, threads, args.tokens))
        except Exception as exc:  # a join that fails is a row of the table, not a crash
            row = {"kind": kind, "setup": setup_name(threads), "context": context,
                   "failed": f"{type(exc).__name__}: {exc}"}
        row["ahead"] = ahead
        rows.append(row)
        print(f"  {kind}, {row['setup']}, {context} tokens, ahead {ahead}: "
              + (f"FAILED: {row['failed']}" if "failed" in row else
                 f"longest stop {fmt(row['stop_s'])} s, identical={row['identical']}"), file=sys.stderr, flush=True)
    print("\n| change | setup | context | load ahead | reply's longest stop s | usual gap between steps s | last token -> rearrangement s "
          "| rearrangement s | replay -> next token s | loaded ahead s | layers kept | done during the reply | identical |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['kind']} | {r['setup']} | {r['context']} | {r['ahead']} | | | | | | | | | FAILED: {r['failed'][:80]} |")
            continue
        print(f"| {r['kind']} | {r['setup']} | {r['context']} | {r['ahead']} | {fmt(r['stop_s'])} | {fmt(r['gap_s'], '.3f')} "
              f"| {fmt(r['lead_s'])} | {fmt(r['rearrange_s'])} | {fmt(r['replay_s'])} | {fmt(r['ahead_s'])} | {fmt(r['kept'], 'd')} "
              f"| {'yes' if r['during'] else 'no'} | {'yes' if r['identical'] else 'NO'} |")
    good = [r for r in rows if "failed" not in r and r["during"] and r["stop_s"]]
    pairs = [(a, b) for a in good for b in good if a["ahead"] == "on" and b["ahead"] == "off"
             and (a["kind"], a["setup"], a["context"]) == (b["kind"], b["setup"], b["context"])]
    if pairs:
        ratio = statistics.median(a["stop_s"] / b["stop_s"] for a, b in pairs)
        lo, hi = min(a["stop_s"] / b["stop_s"] for a, b in pairs), max(a["stop_s"] / b["stop_s"] for a, b in pairs)
        print(f"\nthe reply's longest stop, loading ahead / during the rearrangement (median of {len(pairs)}): "
              f"{ratio:.2f}x (range {lo:.2f}-{hi:.2f}x)")
    ok = rows and all("failed" not in r and r["identical"] and r["during"] for r in rows)
    print(f"every change landed inside its reply and the reply was unchanged: {'PASS' if ok else 'MISS'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
