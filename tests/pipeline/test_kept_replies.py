"""An ended reply's KV kept on every stage for its follow-up (engine/pipeline/kept_replies.py).

A chat sends the whole conversation every turn. The follow-up must compute only what is
new on every stage and reply token for token as it would from scratch, and another
conversation must leave it alone: on the pipeline `potluck chat` starts by default (the real model), and on tiny models over stage
processes where kept replies fill the cache and must make room, and where a request of
n choices forks from a reply it took over.
"""

from __future__ import annotations

import asyncio

from engine.core.kept_prefixes import MIN_MATCH, common_prefix
from engine.core.sampling import SamplingParams
from engine.pipeline.head import Delta, Done
from engine.pipeline.launch import PipelineConfig, launch
from testkit.freed import all_freed
from testkit.tiny_models import start_tiny_head as start_head

STORY = "Here is a list. " + " ".join(f"Item {i} is a {c} fruit." for i, c in
                                      zip(range(60), ["red", "green", "yellow", "small"] * 15))


async def reply(head, prompt, params) -> tuple[list[int], Done]:
    toks = []
    async for ev in head.submit(prompt, params):
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
        else:
            return toks, ev
    raise AssertionError("no Done event")


def computed_by_stage0(head, counts: dict):
    """Counts the tokens the head's own stage computes, per sequence."""
    forward = head.stage0.forward

    def counting(batch, x):
        for sid, n in zip(batch.seq_ids, batch.ns):
            counts[sid] = counts.get(sid, 0) + n
        return forward(batch, x)

    head.stage0.forward = counting


async def test_a_follow_up_computes_only_what_is_new_and_replies_as_from_scratch():
    # what `potluck chat` runs on a CPU: the default model and stage count, no options
    pipe = await launch(PipelineConfig())
    head = pipe.head
    try:
        assert head.n_stages == 1
        params = SamplingParams(greedy=True, max_tokens=24)
        turn = [{"role": "user", "content": STORY + " Which items are red?"}]
        first, done = await reply(head, head.chat_prompt(turn), params)
        assert done.finish_reason in ("stop", "length") and head.kept_info()["replies"] == 1
        # a second conversation (a friend's, or a new chat) starts with the same template and
        # system prompt, and takes nothing over: the first's reply stays for its follow-up
        other = head.chat_prompt([{"role": "user", "content": "Name a color."}])
        assert common_prefix(other, head.chat_prompt(turn)) >= MIN_MATCH
        await reply(head, other, params)
        assert (head.kept_info()["replies"], head.kept_info()["hits"]) == (2, 0), head.kept_info()
        turn += [{"role": "assistant", "content": head.tokenizer.decode(first, skip_special_tokens=True)},
                 {"role": "user", "content": "And which are green?"}]
        prompt = head.chat_prompt(turn)
        counts: dict[int, int] = {}
        computed_by_stage0(head, counts)
        follow, done = await reply(head, prompt, params)
        kept = head.kept_info()
        assert kept["hits"] == 1 and kept["reused_tokens"] > len(prompt) - 40, (kept, len(prompt))
        # the new turn's tokens and the reply's steps (with drafts checked): a fraction of it
        assert sum(counts.values()) < len(prompt) // 2, (counts, len(prompt))
        # from scratch, nothing kept: the same reply, token for token
        await head.drop_kept()
        counts.clear()
        again, _ = await reply(head, prompt, params)
        assert again == follow and sum(counts.values()) >= len(prompt)
        await all_freed(head)
    finally:
        await pipe.close()


def turns(n: int, length: int = 40) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 200 for j in range(length)] for i in range(n)]


async def test_kept_replies_make_room_and_forks_start_from_one_taken_over(tiny_folder, spare_stages):
    """A cache of 200 tokens: four ended conversations of 49 fill it, so a follow-up of
    the second lets the oldest go (in its first frame, ahead of its step), and n = 3
    choices of that follow-up take its reply over, let the other two go and fork from it
    on every stage. Every reply is the one a head that keeps nothing gives."""
    folder, _ = tiny_folder("llama")
    params = SamplingParams(greedy=True, max_tokens=10)
    prompts = turns(4)
    plain = await start_head(folder, spare_stages, kv_budget_tokens=200, keep_replies=0)
    try:
        want = [await reply(plain, p, params) for p in prompts]
        follow = prompts[1] + want[1][0] + [9, 9, 9]
        want_follow = await reply(plain, follow, params)
        want_n = await asyncio.gather(*(h.text() for h in plain.submit_n(follow, params, 3)))
        await all_freed(plain)
    finally:
        await plain.close()
    head = await start_head(folder, spare_stages, kv_budget_tokens=200)
    try:
        for p, (toks, _) in zip(prompts, want):
            assert (await reply(head, p, params))[0] == toks
        assert len(head.kept) == 4 and head.kept.tokens == 4 * 49, head.kept_info()
        assert all(s["seqs"] == 4 for s in await head.stage_stats())
        # the follow-up takes the second over; 3 x 49 kept beside its 63 do not fit
        got = await reply(head, follow, params)
        assert got[0] == want_follow[0] and head.kept_info()["hits"] == 1
        assert len(head.kept) == 3 and all(s["seqs"] == 3 for s in await head.stage_stats())
        got_n = await asyncio.gather(*(h.text() for h in head.submit_n(follow, params, 3)))
        assert [t for t, _ in got_n] == [t for t, _ in want_n] and head.kept_info()["hits"] == 2
        assert len(head.kept) == 3      # the three choices; the two others went for their room
        await all_freed(head)
    finally:
        await head.close()


async def test_a_request_that_never_starts_gives_the_reply_it_took_over_back(tiny_folder, spare_stages):
    """Cancelled while it waits: the stages still hold the kept reply it took over, which
    is kept again (or freed), never left behind."""
    folder, _ = tiny_folder("llama")
    params = SamplingParams(greedy=True, max_tokens=10)
    head = await start_head(folder, spare_stages[:1], kv_budget_tokens=160)
    try:
        a, b = turns(2)
        first, _ = await reply(head, a, params)
        # b (100 reserved) runs beside the kept reply (49); the follow-up of a (62) waits behind it
        running = head.submit(b, SamplingParams(greedy=True, max_tokens=60))
        waiting = head.submit(a + first + [3, 3], params)
        assert waiting.seq.rewind_to is not None and len(head.kept) == 0
        head.cancel(waiting.seq.id)
        await running.text()
        assert waiting.seq.id in head.kept
        await all_freed(head)
    finally:
        await head.close()


async def test_a_kept_reply_nobody_follows_up_is_let_go_on_every_stage(tiny_folder, spare_stages):
    folder, _ = tiny_folder("llama")
    head = await start_head(folder, spare_stages[:1])
    try:
        head.kept.idle_s = 1.0   # (ten minutes as it ships)
        await reply(head, turns(1)[0], SamplingParams(greedy=True, max_tokens=5))
        assert len(head.kept) == 1 and all(s["seqs"] == 1 for s in await head.stage_stats())
        for _ in range(100):     # nothing asks: the head's own timer lets it go
            stats = await head.stage_stats()
            if all(s["seqs"] == 0 and s["kv_tokens"] == 0 for s in stats):
                break
            await asyncio.sleep(0.1)
        assert len(head.kept) == 0 and all(s["seqs"] == 0 for s in stats), stats
    finally:
        await head.close()


async def test_the_same_request_again_reads_the_first_sends_bits_where_it_must():
    """A greedy or seeded request sent again computes the kept prompt's step again, as the
    first send did (core/kept_prefixes.py same_step): its first token's log-probabilities
    are the first send's to the last bit, where the last prompt token computed alone read
    other bits and could part the two replies at a near tie. A sampled request without a
    seed takes every kept token. On the pipeline `potluck chat` starts by default."""
    pipe = await launch(PipelineConfig())
    head = pipe.head
    try:
        prompt = head.chat_prompt([{"role": "user", "content": STORY + " Which items are small?"}])

        async def send(params):
            lps, counts = [], {}
            computed_by_stage0(head, counts)
            async for ev in head.submit(prompt, params):
                if isinstance(ev, Delta):
                    lps.extend(lp.logprob for lp in ev.logprobs or ())
            head.stage0.forward = forward
            return lps, sum(counts.values())

        forward = head.stage0.forward
        for params in (SamplingParams(greedy=True, max_tokens=3, logprobs=True),
                       SamplingParams(temperature=0.9, seed=4, max_tokens=3, logprobs=True)):
            first, _ = await send(params)
            again, computed = await send(params)
            # the prompt's last step again (its last piece: a long prompt goes through the
            # prompt lane in pieces first), not its last token alone and two decode steps
            assert again == first and computed > 8, (first, again, computed)
        reused = head.kept_info()["reused_tokens"]
        _, computed = await send(SamplingParams(temperature=0.9, max_tokens=3))
        assert head.kept_info()["reused_tokens"] - reused == len(prompt) - 1 and computed < 8, computed
        await all_freed(head)
    finally:
        await pipe.close()
