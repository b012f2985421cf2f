"""Lossless sampling: speculative decoding at temperature > 0 has exactly the target's distribution.

A tiny random Llama with a 5-token vocabulary: the exact probability of every 3-token continuation
is enumerated from the target itself, and thousands of seeded speculative samples (Medusa and EAGLE
trees) are compared with it by chi-square tests. Deliberately wrong acceptance rules, and Medusa's
lossy typical acceptance, fail the same test: it has teeth.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from headway.errors import HeadwayError
from headway.heads.dflash import DFlashConfig
from headway.heads.draft_layer import draft_layer_config
from headway.heads.eagle import EagleConfig
from headway.heads.eagle3 import Eagle3Config
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.inference.drafters.dflash import DFlashDrafter
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.drafters.hybrid import HybridConfig, HybridDrafter
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.cuda import accept as accept_device
from headway.inference.engines.cuda import runner as engine_cuda
from headway.inference.engines.tree import build_tree
from headway.inference.generate import plain_generate, speculative_generate
from headway.inference.sampling import (
    Sampler,
    SamplingConfig,
    accept_exact,
    greedy_token,
    target_distribution,
)
from headway.kinds.registry import build_head

V, N_TOKENS, PROMPT = 5, 3, [1, 2, 3, 4, 0, 2]
SAMPLES = 2000
ALPHA = 1e-3  # significance level: a correct rule must not be rejected, a wrong one must be
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama, float64, whose next-token distributions vary strongly with the
    context."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    m = AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # logits of a few units: far from uniform, and not one-hot
    return m


def medusa_drafter(m):
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(num_heads=3, lm_head="own"), 32, V).double()
    heads.init_from_target(m)
    heads.attach_target(m)
    for block in heads.blocks:
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    return MedusaDrafter(heads, build_tree(TREE), 2)


def eagle_drafter(m, kind: str):
    torch.manual_seed(2)
    if kind == "eagle3":
        cfg = Eagle3Config(draft_vocab_size=4, ttt_steps=2)
        cfg.feature_layers = [
            0,
            1,
            2,
        ]  # every hidden state of this 2-layer target (too shallow for the engines' rule)
        d2t = torch.tensor([0, 1, 2, 4])
    else:
        cfg, d2t = EagleConfig(), None
    heads = build_head(kind, cfg, 32, V, d2t=d2t, layer_config=draft_layer_config(m.config))
    heads.init_from_target(m)
    heads.attach_target(m)
    return EagleDrafter(heads.double().eval(), 2, 3, 3, 7)


def dflash_drafter(m):
    """A DFlash block over every hidden state of this 2-layer target, drafting a 3-deep tree from
    one forward."""
    torch.manual_seed(3)
    cfg = DFlashConfig(draft_vocab_size=4, block_size=4)
    cfg.feature_layers = [
        0,
        1,
        2,
    ]  # too shallow a target for the engines' rule: set past the config's check
    heads = build_head(
        "dflash",
        cfg,
        32,
        V,
        d2t=torch.tensor([0, 1, 2, 4]),
        layer_config=draft_layer_config(m.config, "llama"),
    )
    heads.init_from_target(m)
    heads.attach_target(m)
    return DFlashDrafter(heads.double().eval(), build_tree(TREE), 2)


def exact_probabilities(m, cfg: SamplingConfig) -> dict[tuple, float]:
    """P(first N_TOKENS tokens) under the target with `cfg`'s temperature, top-k and top-p, by
    enumeration."""
    probs: dict[tuple, float] = {}
    with torch.no_grad():
        for prefix in itertools.chain.from_iterable(
            itertools.product(range(V), repeat=k) for k in range(N_TOKENS)
        ):
            p = target_distribution(m(torch.tensor([PROMPT + list(prefix)])).logits[0, -1], cfg)
            base = probs[prefix] if prefix else 1.0
            for t in range(V):
                probs[prefix + (t,)] = base * float(p[t])
    return {k: v for k, v in probs.items() if len(k) == N_TOKENS}


def chi_square_p(counts: Counter, expected: dict[tuple, float], n: int) -> float:
    """p-value of observed counts against expected probabilities; cells expected < 5 are pooled."""
    stat, cells, pool_obs, pool_exp = 0.0, 0, 0, 0.0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        cells += 1
    dof = cells - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def sample(generate, cfg: SamplingConfig) -> Counter:
    out: Counter = Counter()
    for seed in range(SAMPLES):
        cfg.seed = seed
        r = generate(cfg)
        out[tuple(r.tokens[:N_TOKENS])] += 1
    return out


def p_value(counts: Counter, expected: dict[tuple, float]) -> float:
    """The test: chi-square on the first two tokens and on all three (the first catches errors at
    the root's children with more power, the second errors further down a path); Bonferroni, so the
    smaller p-value is doubled."""
    p = []
    for k in (2, N_TOKENS):
        c: Counter = Counter()
        e: dict[tuple, float] = {}
        for key, n in counts.items():
            c[key[:k]] += n
        for key, q in expected.items():
            e[key[:k]] = e.get(key[:k], 0.0) + q
        p.append(chi_square_p(c, e, SAMPLES))
    return min(1.0, 2 * min(p))


def spec_p_value(
    m, drafter, cfg: SamplingConfig, rule=None, engine: str = "auto"
) -> tuple[float, float]:
    """The test's p-value for speculative samples against the exact distribution, and their
    mean acceptance."""
    accepted: list[int] = []

    def generate(c):
        r = speculative_generate(m, drafter, PROMPT, N_TOKENS, [], c, rule, engine=engine)
        accepted.extend(r.accepted)
        return r

    counts = sample(generate, cfg)
    return p_value(counts, exact_probabilities(m, cfg)), sum(accepted) / len(accepted)


def test_target_distribution_is_hugging_faces(model):
    """Temperature, top-k and top-p as Hugging Face's sampling applies them (one function for both
    loops)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(3)
    logits = torch.randn(4, 50, dtype=torch.float64) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9)]:
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        torch.testing.assert_close(
            target_distribution(logits, SamplingConfig(temperature=t, top_k=k, top_p=p)),
            scores.softmax(-1),
        )


def test_plain_sampling_has_the_target_distribution(model):
    cfg = SamplingConfig(temperature=1.0)
    counts = sample(lambda c: plain_generate(model, PROMPT, N_TOKENS, [], c), cfg)
    assert p_value(counts, exact_probabilities(model, cfg)) > ALPHA


@pytest.mark.parametrize(
    "kind,cfg",
    [
        ("medusa", SamplingConfig(temperature=1.0)),
        ("medusa", SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)),
        ("eagle", SamplingConfig(temperature=1.0)),
        ("eagle3", SamplingConfig(temperature=1.0)),
        ("dflash", SamplingConfig(temperature=1.0)),
        ("hybrid", SamplingConfig(temperature=1.0)),
        ("ngram", SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)),
    ],
)
def test_speculative_sampling_is_lossless(model, kind: str, cfg: SamplingConfig):
    if kind in (
        "hybrid",
        "ngram",
    ):  # n-gram branches (and EAGLE-3's) in one tree, sized per step (node_cost 0: large)
        neural = eagle_drafter(model, "eagle3") if kind == "hybrid" else None
        hc = HybridConfig(
            node_cost=0.0, max_tokens=3, min_ngram=1
        )  # 5-token vocabulary: 1-grams match often
        drafter = HybridDrafter(neural, hc, lambda n, depth: 1.0, timed=False)
    else:
        makers = {"medusa": medusa_drafter, "dflash": dflash_drafter}
        drafter = makers[kind](model) if kind in makers else eagle_drafter(model, kind)
    p, mean_accepted = spec_p_value(model, drafter, cfg)
    assert p > ALPHA, (kind, cfg, p)
    assert mean_accepted > 0.3, "the drafts must often be accepted for the test to mean anything"


def accept_without_renormalising(tree, node_ids, logits, sampler):
    """WRONG: a rejected draft's mass is removed but the residual is not renormalised."""
    path, cur = [0], 0
    while True:
        residual = target_distribution(logits[cur], sampler.cfg).cpu()
        accepted = None
        for child in tree.children[cur]:
            if sampler.uniform() < float(residual[node_ids[child]]):
                accepted = child
                break
            residual[node_ids[child]] = 0.0
        if accepted is None:
            return path, sampler.sample(residual)
        path.append(accepted)
        cur = accepted


def accept_then_sample_from_target(tree, node_ids, logits, sampler):
    """WRONG: when every draft is rejected, sample from the target's full distribution, not the
    residual."""
    path, cur = [0], 0
    while True:
        p = target_distribution(logits[cur], sampler.cfg).cpu()
        nxt = next(
            (c for c in tree.children[cur] if sampler.uniform() < float(p[node_ids[c]])), None
        )
        if nxt is None:
            return path, sampler.sample(p)
        path.append(nxt)
        cur = nxt


@pytest.mark.parametrize(
    "rule", [accept_without_renormalising, accept_then_sample_from_target, "typical"]
)
def test_wrong_or_lossy_acceptance_fails_the_same_test(model, rule):
    cfg = SamplingConfig(temperature=1.0)
    if rule == "typical":
        cfg.acceptance, rule = "typical", None
    p, _ = spec_p_value(model, medusa_drafter(model), cfg, rule)
    print(f"{getattr(rule, '__name__', 'typical')}: p = {p:.2e}")
    assert p < ALPHA


def test_a_seed_reproduces_a_run(model):
    drafter = eagle_drafter(model, "eagle3")
    runs = [
        speculative_generate(
            model, drafter, PROMPT, 20, [], SamplingConfig(temperature=1.0, seed=s)
        ).tokens
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    plain = [
        plain_generate(model, PROMPT, 20, [], SamplingConfig(temperature=1.0, seed=s)).tokens
        for s in (7, 7)
    ]
    assert plain[0] == plain[1]


def test_exact_rule_is_exact_on_a_single_node():
    """The residual rule by hand: drafts [0, 1] under one root give P(0)=0.5, P(1)=0.3 and
    P(2)=0.2."""
    tree = build_tree([[0], [1]])
    logits = torch.log(
        torch.tensor([[0.5, 0.3, 0.2], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    )
    counts: Counter = Counter()
    n = 20000
    sampler = Sampler(SamplingConfig(temperature=1.0))
    for _ in range(n):
        node_ids = [0, 0, 1]
        path, bonus = accept_exact(tree, node_ids, logits, sampler)
        counts[node_ids[path[-1]] if len(path) > 1 else bonus] += 1
    for token, p in [(0, 0.5), (1, 0.3), (2, 0.2)]:
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_sampling_settings_are_checked():
    for bad in [
        dict(temperature=-1),
        dict(top_k=-2),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(acceptance="greedy"),
    ]:
        with pytest.raises(HeadwayError, match="inference.sampling"):
            SamplingConfig(**bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_token_is_the_first_largest_logit_among_ties(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 50_000, (), generator=gen))
        # a handful of distinct values, so a row's largest value repeats (bf16 logits tie often)
        logits = (torch.randint(-3, 4, (n,), generator=gen) * 0.5).to(dtype)
        first = int((logits == logits.max()).nonzero()[0])
        assert greedy_token(logits) == first == int(logits.argmax())


@pytest.mark.parametrize(
    "kind,cfg",
    [
        ("medusa", SamplingConfig(temperature=1.0)),
        ("eagle3", SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)),
        ("dflash", SamplingConfig(temperature=1.0)),
    ],
)
def test_sampling_on_the_device_is_lossless(model, kind: str, cfg: SamplingConfig):
    """The CUDA backend's loop (its code on CPU tensors): tree rejection sampling in the step
    (accept_device.sample_accept, uniforms drawn before it), the drafts on tensors."""
    makers = {"medusa": medusa_drafter, "dflash": dflash_drafter}
    drafter = makers[kind](model) if kind in makers else eagle_drafter(model, kind)
    p, mean_accepted = spec_p_value(model, drafter, cfg, engine="cuda")
    assert p > ALPHA, (kind, cfg, p)
    assert mean_accepted > 0.3


def test_a_wrong_rule_on_the_device_fails_the_same_test(model, monkeypatch):
    """The device rule without renormalising after a rejection (a child accepted with p(x), not
    p(x) / (1 - S)): the test rejects it."""
    real = accept_device.sample_accept

    def without_renormalising(tokens, parent, ancestors, probs, uniforms, n):
        # the real rule accepts child c when u < p / (1 - S); given u * ... / (1 - S) it accepts
        # when u < p
        m = tokens.shape[0]
        r = torch.arange(m)
        earlier = (parent[None, :] == parent[:, None]) & (r[None, :] < r[:, None])
        removed = (earlier.double() * probs[parent.clamp(min=0), tokens][None, :]).sum(1)
        scaled = uniforms.clone()
        scaled[:m] = uniforms[:m] / (1 - removed).clamp_min(1e-300)
        return real(tokens, parent, ancestors, probs, scaled, n)

    monkeypatch.setattr(engine_cuda, "sample_accept", without_renormalising)
    cfg = SamplingConfig(temperature=1.0)
    p, _ = spec_p_value(model, medusa_drafter(model), cfg, engine="cuda")
    assert p < ALPHA, p
