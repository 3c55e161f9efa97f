"""Token-exact parity of the stage engine with transformers' own generate().

For every supported architecture a tiny random-weight checkpoint (tests/tiny_models.py)
is split into stages that are chained in one process; greedy decoding must produce
exactly the tokens, and very nearly the logits, of the same model's single-process
`generate(do_sample=False)` on each prompt alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.model.sources import ModelError, resolve  # noqa: E402
from engine.model.stage import StageBatch, StageModel  # noqa: E402
from testkit.tiny_models import ARCHS, SLIDING_WINDOW, VOCAB, build_tiny_model  # noqa: E402

MAX_NEW = 12
PROMPT_LENS = (5, 11, 17)  # two of them longer than the sliding window
LOGIT_ATOL = 1e-4

assert max(PROMPT_LENS) > SLIDING_WINDOW


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()


class Tiny:
    """One built checkpoint, its full model, and cached reference generations."""

    def __init__(self, arch: str, root: Path):
        self.arch = arch
        self.model = build_tiny_model(arch, root)
        self.source = resolve(str(root))
        self.n_layers = self.source.config().num_hidden_layers
        self._refs: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def reference(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        key = tuple(prompt)
        if key not in self._refs:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                    output_logits=True, return_dict_in_generate=True,
                )
            tokens = out.sequences[0, len(prompt):].tolist()
            logits = torch.stack([step[0] for step in out.logits]).float()
            self._refs[key] = (tokens, logits)
        return self._refs[key]

    def stages(self, n_stages: int) -> list[StageModel]:
        L = self.n_layers
        cuts = [round(i * L / n_stages) for i in range(n_stages + 1)]
        return [StageModel(self.source, a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    cache: dict[str, Tiny] = {}

    def get(arch: str) -> Tiny:
        if arch not in cache:
            cache[arch] = Tiny(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


def run_stages(stages, prompts, max_new=MAX_NEW, joins=None, chunk=None):
    """Greedy decoding through a chain of stages, the way the server batches it.

    Sequence i joins the batch at step joins[i]; its prompt is prefilled in pieces of
    at most `chunk` tokens (all at once when None), sharing steps with rows that are
    already decoding. Returns each sequence's tokens and per-token logits.
    """
    joins = joins or [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    pos = [0] * len(prompts)
    step = 0
    while any(len(o) < max_new for o in outs):
        ids, starts, ns, xs = [], [], [], []
        for i, p in enumerate(prompts):
            if step < joins[i] or len(outs[i]) >= max_new:
                continue
            if pos[i] < len(p):
                piece = p[pos[i]: pos[i] + (chunk or len(p))]
            else:
                piece = [outs[i][-1]]
            ids.append(i)
            starts.append(pos[i])
            ns.append(len(piece))
            xs.extend(piece)
        step += 1
        if not ids:
            continue
        batch = StageBatch(ids, starts, ns)
        h = torch.tensor(xs)
        for s in stages:
            h = s.forward(batch, h)
        assert h.shape == (len(ids), VOCAB)
        for r, i in enumerate(ids):
            pos[i] += ns[r]
            if pos[i] >= len(prompts[i]):  # a finished prefill or a decode step
                outs[i].append(int(h[r].argmax()))
                logits[i].append(h[r])
    for s in stages:
        for i in range(len(prompts)):
            assert s.free(i)
        assert s.kv.used_tokens == 0
    return outs, [torch.stack(x) for x in logits]


def check_against_reference(t: Tiny, prompts, outs, logits):
    for prompt, got, got_logits in zip(prompts, outs, logits):
        want, want_logits = t.reference(prompt)
        assert got == want, f"{t.arch}: prompt of {len(prompt)} tokens: stages {got} != generate {want}"
        torch.testing.assert_close(got_logits, want_logits, atol=LOGIT_ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_sequence(tiny, arch):
    t = tiny(arch)
    prompts = [PROMPTS[2]]
    outs, logits = run_stages(t.stages(3), prompts)
    check_against_reference(t, prompts, outs, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_different_lengths(tiny, arch):
    t = tiny(arch)
    outs, logits = run_stages(t.stages(3), PROMPTS)
    check_against_reference(t, PROMPTS, outs, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_stage_holds_everything(tiny, arch):
    t = tiny(arch)
    (stage,) = t.stages(1)
    assert stage.first and stage.last and (stage.start, stage.end) == (0, t.n_layers)
    outs, logits = run_stages([stage], PROMPTS)
    check_against_reference(t, PROMPTS, outs, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_staggered_joins_and_chunked_prefill(tiny, arch):
    """Rows prefill (in chunks that straddle the sliding window) beside rows decoding."""
    t = tiny(arch)
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    outs, logits = run_stages(t.stages(2), prompts, joins=[0, 2, 3], chunk=6)
    check_against_reference(t, prompts, outs, logits)


@pytest.mark.parametrize(
    "model_type, make_config",
    [
        ("bert", lambda T: T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64)),
        ("t5", lambda T: T.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                    num_heads=2)),
    ],
)
def test_unsupported_architecture_is_refused(tmp_path, model_type, make_config):
    import transformers

    cfg = make_config(transformers)
    torch.manual_seed(0)
    transformers.AutoModel.from_config(cfg).save_pretrained(str(tmp_path))
    source = resolve(str(tmp_path))
    with pytest.raises(ModelError, match=f"'{model_type}'"):
        StageModel(source, 0, 1)


def test_every_supported_family_has_a_parity_case():
    from engine.model.families import SUPPORTED_MODEL_TYPES
    from testkit.tiny_models import tiny_config

    tested = {tiny_config(arch).model_type for arch in ARCHS}
    assert set(SUPPORTED_MODEL_TYPES) == tested


@pytest.mark.parametrize("model_type", ["jamba", "qwen3_next", "falcon_h1", "mamba"])
def test_recurrent_hybrid_family_is_refused_with_its_reason(model_type):
    from transformers import AutoConfig

    from engine.model.families import REFUSED_MODEL_TYPES, SUPPORTED_MODEL_TYPES, check_supported

    assert model_type not in SUPPORTED_MODEL_TYPES
    cfg = AutoConfig.for_model(model_type)
    with pytest.raises(ModelError, match=f"'{model_type}'") as err:
        check_supported(cfg)
    assert REFUSED_MODEL_TYPES[model_type] in str(err.value)
    assert "recurrent state" in str(err.value) and "key/value cache" in str(err.value)


def test_refused_family_reaches_the_user_from_a_checkpoint(tmp_path):
    """A hybrid checkpoint on disk is refused when its config is read, naming the reason."""
    import transformers

    transformers.AutoConfig.for_model("jamba").save_pretrained(str(tmp_path))
    source = resolve(str(tmp_path))
    with pytest.raises(ModelError, match="recurrent state"):
        StageModel(source, 0, 1)
