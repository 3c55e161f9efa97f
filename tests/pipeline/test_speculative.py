"""Speculative decoding across the pipeline (issue 34): prompt lookup drafts on the head,
the last stage answers a token per drafted position, every stage rolls back what was
rejected -- and the reply is the one plain decoding gives, token for token.

One 3-stage pipeline of the default model (a head and two stage processes) serves the
module: each test runs its prompts with speculation off, then forced on (a policy that
drafts 4 tokens whenever prompt lookup has a guess), and compares. The KV test runs a
tiny random model in this process, where the cache can be read.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from conftest import pipeline_config

from engine.core.sampling import SamplingParams
from engine.core.speculation import SpecConfig, SpecPolicy
from engine.model.draft import DraftModel
from engine.model.sources import resolve
from engine.model.stage import StageBatch, StageModel
from engine.pipeline.head import Delta, Done
from engine.pipeline.launch import launch
from testkit.freed import all_freed
from testkit.streams import tokens

QUOTE = ("Repeat exactly, word for word: The quick brown fox jumps over the lazy dog. "
         "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!")
CHAT = "Name three colors and say why the sky is blue."
TOKENS = 40


class Always(SpecPolicy):
    """Drafts k tokens every round (where prompt lookup has any): the test's speculation on."""

    def __init__(self, k: int = 4, read_prompts: bool = False):
        super().__init__(SpecConfig(k_max=k))   # drafting ahead goes k + 1 past a draft
        self.k = k
        self.most_active = 0   # the most sequences the head said the pipeline held
        # whether a prompt is read into the draft model while its trip is out (untried=False:
        # drafting ahead known to pay); off, a new context is read when a round finds it
        self.read_prompts = read_prompts

    def k_for(self, seq_id: int, free: int = 0) -> int:
        self.most_active = max(self.most_active, self.active)
        return self.k

    def ahead_pays(self, seq_id: int, untried: bool = True) -> bool:   # a draft model drafts ahead every round
        return untried or self.read_prompts


class Patient(DraftModel):
    """Drafts ahead to the end whenever the step comes back, and reads a new context in
    the round that finds it (a draft faster than the trip): every round that could be
    served from the chain is, whatever this machine's speed. (On this machine's two
    cores, three busy stage processes leave the draft thread, at its lower priority,
    too little CPU to read a prompt before a 40-token reply is over.)"""

    def draft(self, asks, stop=None):
        return super().draft(asks)

    def unread(self, seq_id, context):
        return 0


class Recording(DraftModel):
    """Notes what each draft() was asked to read first, and whether a round waited on it
    (no `stop`: a round's own drafts) or a trip in flight hid it (drafting ahead)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple[bool, list[int]]] = []

    def draft(self, asks, stop=None):
        self.calls.append((stop is None, [self.unread(sid, ctx) for sid, ctx, _ in asks]))
        return super().draft(asks, stop=stop)


@pytest.fixture(scope="module")
async def pipe():
    p = await launch(pipeline_config(speculate="off"))
    p.head.eos_ids = set()   # every reply runs its full length: past the quote, drafts get rejected too
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
def head(pipe):
    return pipe.head


def greedy(n: int = TOKENS) -> SamplingParams:
    return SamplingParams(greedy=True, max_tokens=n)


async def reply(head, question: str, params: SamplingParams, on_token=None) -> tuple[list[int], str, Done]:
    h = head.submit(head.chat_prompt([{"role": "user", "content": question}]), params)
    toks, parts = [], []
    async for ev in h:
        if isinstance(ev, Delta):
            toks.extend(ev.token_ids)
            parts.append(ev.text)
            if on_token is not None:
                on_token(len(toks))
        else:
            assert ev.error is None, ev
            return toks, "".join(parts), ev
    raise AssertionError("no Done")


async def replies(head, asks) -> list[list[int]]:
    got = await asyncio.wait_for(asyncio.gather(*(reply(head, q, p) for q, p in asks)), 300)
    return [t for t, _, _ in got]


_PLAIN: dict[str, list[list[int]]] = {}


async def plain_replies(head, asks) -> list[list[int]]:
    """The replies without speculation, computed once per module (greedy and seeded
    replies are the same every time: test_pipeline.py's determinism tests)."""
    key = repr(asks)
    if key not in _PLAIN:
        plain(head)
        _PLAIN[key] = await replies(head, asks)
    return _PLAIN[key]


def speculate(head, k: int = 4, **kw) -> Always:
    head.speculate, head.spec_policy = "auto", Always(k, **kw)
    return head.spec_policy


def plain(head):
    head.speculate, head.spec_policy = "off", SpecPolicy()


async def speculated(head, asks, k: int = 4):
    """The replies to `asks` with speculation forced at k, and the policy that saw them."""
    policy = speculate(head, k)
    try:
        return await replies(head, asks), policy
    finally:
        plain(head)


async def test_greedy_replies_are_token_identical_and_drafts_are_accepted(head):
    asks = [(QUOTE, greedy()), (CHAT, greedy())]
    reference = await plain_replies(head, asks)
    got, policy = await speculated(head, asks)
    assert got == reference
    stats = policy.stats()
    # the quoting reply copies its prompt: drafts stand, and trips carry more than a token
    assert stats["acceptance"] and stats["acceptance"] > 0.15, stats
    assert stats["tokens_per_trip"] > 1.3, stats
    print(f"\nspeculation on a quote and a chat ({[len(t) for t in got]} tokens): "
          f"{stats['tokens_per_trip']:.2f} tokens per trip, acceptance {stats['acceptance']:.2f} "
          f"over {stats['rounds']} decode rounds")
    assert head.info()["speculation"]["mode"] == "off"
    await all_freed(head)


def chat_defaults(seed: int, n: int = TOKENS, **kw) -> SamplingParams:
    """What `potluck chat` sends with the default model (engine/core/sampling.py
    CHAT_DEFAULTS: repetition penalty 1.1), seeded so the reply can be compared."""
    return SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=seed, max_tokens=n, **kw)


async def test_penalized_replies_are_token_identical_and_drafts_are_accepted(head):
    # the last stage penalizes each drafted position after its own picks before it, and
    # the next step's position rolls the rejected picks out of its history and counts
    asks = [(QUOTE, SamplingParams(greedy=True, repetition_penalty=1.1, max_tokens=TOKENS)),
            (QUOTE, chat_defaults(1)),
            (QUOTE, chat_defaults(9, presence_penalty=0.4, frequency_penalty=0.3)),
            (CHAT, chat_defaults(2, 24))]
    reference = await plain_replies(head, asks)
    got, policy = await speculated(head, asks)
    assert got == reference
    stats = policy.stats()
    # drafts stood (a round that drafts nothing counts as a trip of one token)
    assert stats["acceptance"] > 0.15 and stats["tokens_per_trip"] > 1.05, stats
    # the chat defaults alone on the quote: what `potluck chat` gets when a reply quotes
    alone = [(QUOTE, chat_defaults(1))]   # seed 1 quotes (the 135M model at 0.7 often wanders off)
    got, policy = await speculated(head, alone)
    assert got == await plain_replies(head, alone)
    one = policy.stats()
    assert one["tokens_per_trip"] > 1.05, one

    print(f"\npenalized speculation ({[len(t) for t in reference]} tokens): {stats['tokens_per_trip']:.2f} "
          f"tokens per trip, acceptance {stats['acceptance']:.2f}; the chat defaults alone on the quote: "
          f"{one['tokens_per_trip']:.2f} tokens per trip, acceptance {one['acceptance']:.2f}")
    await all_freed(head)


async def test_concurrent_requests_with_and_without_speculation_side_by_side(head):
    # seeded sampling rows verify too (each position drawn from its own seed), and a
    # penalized one; a logprobs row decodes plainly in the same steps
    asks = [(QUOTE, greedy()), (CHAT, greedy(24)),
            (QUOTE, SamplingParams(temperature=0.7, seed=7, max_tokens=TOKENS)),
            (QUOTE, SamplingParams(greedy=True, max_tokens=16, logprobs=True, top_logprobs=2)),
            (QUOTE, SamplingParams(temperature=0.8, seed=3, max_tokens=16, presence_penalty=0.5))]
    plain(head)
    reference = await replies(head, asks)
    got, policy = await speculated(head, asks)
    assert got == reference
    assert policy.stats()["acceptance"] > 0.15
    # the busy cut-off counts every sequence the pipeline holds, not one micro-batch's rows
    assert policy.most_active == len(asks), (policy.most_active, head.micro_batches)
    await all_freed(head)


async def test_a_stop_string_ends_a_reply_inside_an_accepted_draft(head):
    params = SamplingParams(greedy=True, max_tokens=TOKENS, stop=["lazy"])
    plain(head)
    ref_toks, ref_text, ref_done = await reply(head, QUOTE, params)
    speculate(head)
    try:
        toks, text, done = await reply(head, QUOTE, params)
    finally:
        plain(head)
    assert (toks, text, done.finish_reason) == (ref_toks, ref_text, ref_done.finish_reason)
    assert done.finish_reason == "stop" and "lazy" not in text
    await all_freed(head)


async def test_max_tokens_is_never_passed_by_a_draft(head):
    speculate(head, 8)
    try:
        toks, _, done = await reply(head, QUOTE, greedy(7))
    finally:
        plain(head)
    assert len(toks) == done.completion_tokens <= 7
    await all_freed(head)


async def test_a_draft_model_gives_the_same_replies_and_its_drafts_stand(head):
    # the default model itself at 4 bits beside stage 0: its guesses drift from the
    # target's now and then (rejections roll back its own cache too), mostly they stand
    asks = [(QUOTE, greedy()), (CHAT, greedy())]
    reference = await plain_replies(head, asks)
    head.drafter = await head._run(lambda: Patient.load(
        "default@int8", dtype=head.dtype, device=head.device, target_tokenizer=head.tokenizer,
        target_vocab=head.config.vocab_size, kv_budget_tokens=head.capacity))
    policy = speculate(head)
    try:
        got = await replies(head, asks)
        info = head.info()["speculation"]
        served = head.drafter.from_chain
    finally:
        plain(head)
        head.drafter = None
    assert got == reference
    # the overlap: rounds whose guesses were drafted while the last verification was in
    # flight (every guess stood and the target's token was the draft's own next guess)
    assert served > 0
    stats = policy.stats()
    # the chat reply too: a draft model guesses prose that prompt lookup cannot
    assert stats["tokens_per_trip"] > 1.5 and stats["acceptance"] > 0.3, stats
    assert info["draft"] == "SmolLM2-135M-Instruct (int8)" and info["tokens_per_trip"] == stats["tokens_per_trip"]
    assert info["summary"].startswith("guessing ahead (SmolLM2-135M-Instruct (int8)): ") and "guesses right" in info["summary"]
    print(f"\ndraft model on a quote and a chat: {stats['tokens_per_trip']:.2f} tokens per trip, "
          f"acceptance {stats['acceptance']:.2f} over {stats['rounds']} decode rounds")
    await all_freed(head)


async def test_no_round_waits_for_the_draft_model_to_read_a_new_context(head):
    # a context new to the draft model (a prompt, or a sequence it never drafted for) is
    # a prompt's compute: it is read on the draft thread while a trip is in flight, the
    # rounds before it is read go without drafts, and the reply is the same
    asks = [(CHAT, greedy(16))]
    reference = await plain_replies(head, asks)
    head.drafter = await head._run(lambda: Recording.load(
        "default@int8", dtype=head.dtype, device=head.device, target_tokenizer=head.tokenizer,
        target_vocab=head.config.vocab_size, kv_budget_tokens=head.capacity))
    speculate(head, read_prompts=True)
    await head.drop_kept()   # the prompt's own trip, not a kept reply's one-token one
    try:
        got = await replies(head, asks)
        await head._on_draft_thread(lambda: None)   # what was queued has run
        calls = head.drafter.calls
    finally:
        plain(head)
        head.drafter = None
    assert got == reference
    waited = [n for sync, reads in calls if sync for n in reads]
    hidden = [n for sync, reads in calls if not sync for n in reads]
    k_max = Always().config.k_max
    assert all(n <= k_max + 2 for n in waited), calls    # a round's catch-up: its accepted tokens
    assert hidden and max(hidden) > 20, calls            # the prompt, read while a trip was out
    await all_freed(head)


async def test_a_follow_up_taking_its_kept_reply_over_leaves_the_draft_model_only_its_new_message(head):
    """The draft model keeps its cache of a kept reply too (engine/pipeline/kept_replies.py),
    through another conversation's drafts: a follow-up's first drafts read the new
    message, not the conversation again, and the reply is the one without speculation."""
    await head.drop_kept()
    turn = [{"role": "user", "content": QUOTE}]
    first, _ = await _tokens(head, head.chat_prompt(turn), greedy(16))
    turn += [{"role": "assistant", "content": head.tokenizer.decode(first, skip_special_tokens=True)},
             {"role": "user", "content": "Once more, please."}]
    follow = head.chat_prompt(turn)
    await head.drop_kept()
    want, _ = await _tokens(head, follow, greedy(16))              # from scratch, no drafts
    await head.drop_kept()
    head.drafter = await head._run(lambda: Recording.load(
        "default@int8", dtype=head.dtype, device=head.device, target_tokenizer=head.tokenizer,
        target_vocab=head.config.vocab_size, kv_budget_tokens=head.capacity))
    speculate(head)
    try:
        assert (await _tokens(head, head.chat_prompt(turn[:1]), greedy(16)))[0] == first
        # another conversation drafts meanwhile: the draft model lets go of every sequence
        # that ended, but not of a kept reply
        await _tokens(head, head.chat_prompt([{"role": "user", "content": CHAT}]), greedy(8))
        head.drafter.calls.clear()
        got, _ = await _tokens(head, follow, greedy(16))
        await head._on_draft_thread(lambda: None)   # what was queued has run
        reads = [n for _, ns in head.drafter.calls for n in ns]
    finally:
        plain(head)
        head.drafter = None
    kept = head.kept_info()
    assert got == want and kept["hits"] >= 1, kept
    asked = len(head.chat_prompt(turn[:1]))
    new = len(follow) - asked - len(first) + 1
    # the first draft reads what the draft model's cache of the kept reply lacks: the new
    # message (and the turn's end markers), and the reply's last tokens where its last
    # rounds went without drafts (the policy's call, which timing moves) -- never the
    # first message again (without it: all 99 tokens)
    assert reads and reads[0] <= new + len(first) + 4 and max(reads) < len(follow) // 2, (reads, new, len(follow))
    await all_freed(head)


async def _tokens(head, prompt: list[int], params: SamplingParams) -> tuple[list[int], Done]:
    toks, done = await tokens(head.submit(prompt, params))
    assert done.error is None, done
    return toks, done


# ---- what status says ------------------------------------------------------------------


def test_speculation_says_tokens_per_trip_and_acceptance_where_it_ran():
    # the head's status says it in words (engine/core/speculation.py describe, pure text);
    # the chat window's header, Pipeline status and the terminal chat show that summary
    from app.pipeline_text import speculation_label
    from engine.core.speculation import describe

    ran = {"mode": "auto", "draft": "prompt lookup", "tokens_per_trip": 2.4, "acceptance": 0.712, "rounds": 30}
    assert describe(ran) == "guessing ahead: 2.4 tokens a pass through the model, 71% of guesses right"
    drafted = dict(ran, draft="SmolLM2-135M-Instruct (nf4)")
    assert describe(drafted) == ("guessing ahead (SmolLM2-135M-Instruct (nf4)): 2.4 tokens a pass through the "
                                 "model, 71% of guesses right")
    # off, on but nothing drafted yet, or a head too old to say: nothing
    assert describe(dict(ran, mode="off")) == ""
    assert describe(dict(ran, acceptance=None, tokens_per_trip=1.0)) == ""
    # guesses so far all wrong ("1.0 tokens a trip, 0% of guesses right" said nothing of use)
    assert describe(dict(ran, acceptance=0.0, tokens_per_trip=1.0)) == ""
    # guesses that almost never land make no difference a person sees: not said as a figure
    assert describe(dict(ran, acceptance=0.02, tokens_per_trip=1.02)) == ""
    assert describe(None) == ""
    assert speculation_label({"speculation": dict(ran, summary=describe(ran))}) == describe(ran)
    assert speculation_label({"speculation": ran}) == "" and speculation_label({}) == ""


# ---- the KV cache after a rejection ---------------------------------------------------

def test_kv_after_a_rejected_draft_equals_kv_decoded_without_speculation(tiny_folder):
    folder, _ = tiny_folder("llama", seed=0)
    source = resolve(str(folder))
    n = source.config().num_hidden_layers
    # the whole model as one stage: first (token ids in) and last (logits out)
    stage = StageModel(source, 0, n, dtype=torch.float32, device="cpu")
    prompt = list(range(5, 25))

    def step(seq, start, toks, keep=None):
        return stage.forward(StageBatch([seq], [start], [len(toks)], keep), torch.tensor(toks))

    # plain: the prompt, then 6 tokens one at a time
    out = step(1, 0, prompt)
    plain_toks = [int(out[-1].argmax())]
    for i in range(6):
        out = step(1, len(prompt) + i, plain_toks[-1:])
        plain_toks.append(int(out[-1].argmax()))
    # speculative: the prompt, then the first token and a draft whose third guess is wrong
    step(2, 0, prompt)
    wrong = (plain_toks[3] + 1) % stage.vocab_size
    draft = plain_toks[1:3] + [wrong, plain_toks[4]]
    logits = step(2, len(prompt), plain_toks[:1] + draft, keep=[5])
    assert logits.shape[0] == 5
    target = logits.argmax(-1).tolist()
    assert target[:3] == plain_toks[1:4]   # the target's choice after each prefix
    assert stage.kv.length(2) == len(prompt) + 5 and stage.kv.seqs[2].tentative == 4
    # two drafted tokens stood: the next step starts after them, rolling back the rest
    at = len(prompt) + 3
    out = step(2, at, [target[2]])
    assert int(out[-1].argmax()) == plain_toks[4]
    out = step(2, at + 1, [plain_toks[4]])
    assert int(out[-1].argmax()) == plain_toks[5]
    length = at + 2
    assert stage.kv.length(2) == length and stage.kv.length(1) == len(prompt) + 6
    a, b = stage.kv.seqs[1].slot, stage.kv.seqs[2].slot
    for layer in stage.kv._k:
        for store in (stage.kv._k, stage.kv._v):
            assert torch.allclose(store[layer][a, :, :length], store[layer][b, :, :length], atol=1e-5), layer
    # verification steps are timed into the stage's profile, as decode steps of that many rows
    from engine.core.profile import StepLog

    stage.step_log = log = StepLog({"decode": [[1, 0.01], [4, 0.02], [8, 0.03]], "prefill": [[16, 0.05]]})
    step(2, length, [plain_toks[5], 1, 2], keep=[3])
    assert log.steps == 1 and len(log._ratio["decode"]) == 1
    stage.step_log = None
    # a step may not start before the tentative tail, nor after the end
    length += 3
    with pytest.raises(ValueError):
        step(2, 3, [1])
    with pytest.raises(ValueError):
        step(2, length + 1, [1])


async def test_failover_mid_reply_with_speculation_replays_the_same_reply(pipe):
    # last in this module: it leaves the pipeline with two stages
    head = pipe.head
    asks = [(QUOTE, greedy()), (CHAT, greedy())]
    reference = await plain_replies(head, asks)
    policy = speculate(head)
    procs = list(pipe.local.procs)
    killed = []

    def on_token(n):
        if n >= 12 and not killed:
            killed.append(n)
            os.kill(procs[1].pid, signal.SIGKILL)   # the last stage: the one that verifies

    try:
        got = await asyncio.wait_for(asyncio.gather(reply(head, QUOTE, greedy(), on_token),
                                                    reply(head, CHAT, greedy())), 300)
    finally:
        plain(head)
    assert killed
    assert [t for t, _, _ in got] == reference
    assert [e["event"] for e in head.info()["events"]].count("recovered") == 1
    assert policy.stats()["acceptance"] > 0.15
