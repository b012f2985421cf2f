"""The CUDA backend (inference.engine=cuda) proven on a CPU: its code on CPU tensors gives the
model's logits and plain greedy's tokens (float64), its device bookkeeping equals the host's, its
EAGLE expansion builds the host drafter's tree, and its step reads nothing from the host (see also
test_cuda_capture.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from headway.errors import HeadwayError
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.inference.config import cuda_buckets
from headway.inference.cost_model import verify_cost
from headway.inference.drafters.dflash import DFlashDrafter
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.cuda.accept import greedy_accept, tree_ancestors
from headway.inference.engines.cuda.runner import CudaRunner, pinned_sdpa
from headway.inference.engines.cuda.sync_guard import HostReads
from headway.inference.engines.kv import KVCache
from headway.inference.engines.options import EngineOptions
from headway.inference.engines.runner import HFRunner, engine_name, make_runner
from headway.inference.engines.tree import build_tree, tree_from_parents
from headway.inference.generate import greedy_generate, speculative_generate
from headway.inference.sampling import Sampler, SamplingConfig, accept_greedy
from headway.inference.tuned import gpu_sized
from headway.run_config import RunConfig
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from tests.helpers.decode_helpers import chat_ids, load64
from tests.inference.test_speculative_exact import WIDE_TREE, OracleDrafter, prompts_for
from tests.kinds.test_dflash import random_head as dflash_head
from tests.kinds.test_eagle import random_head

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


class DeviceOracle(OracleDrafter):
    """The oracle drafter (the greedy continuation on some branches, noise on others) on tensors."""

    drafts_on_device = True

    def reserve(self, max_len: int, graphs=None) -> None:
        pass

    def draft_tensors(self, root: torch.Tensor):
        nodes, tree = self.draft(int(root))
        return nodes.to(root.device), torch.tensor(tree.parent, device=root.device)


def random_tree(rng: random.Random, n: int):
    parents = [-1] + [rng.randrange(i) if rng.random() < 0.7 else i - 1 for i in range(1, n)]
    tree, _ = tree_from_parents([p - 1 if p > 0 else -1 for p in parents[1:]])
    return tree


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_runner_matches_the_model_forward(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    hf, cu = HFRunner(t.model), CudaRunner(t.model, 64, buckets=(1, 8, 16))
    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    steps = [
        (torch.arange(10, 40), None, None),
        (torch.tensor([5, 6, 7, 8, 9, 10]), tree, [0, 1, 3]),
        (torch.tensor([11]), None, None),
        (torch.tensor([3, 4, 5, 6, 7, 8]), tree, [0, 2, 4, 5]),
        (torch.tensor([12, 13, 14, 15, 16, 17]), tree, [0, 1]),
        (torch.tensor([18, 19]), None, None),  # a chain of two continuing the cache
        (torch.tensor([24]), None, None),
    ]
    for ids, t_, keep in steps:
        (la, ha), (lb, hb) = hf.forward(ids, t_, hidden=True), cu.forward(ids, t_, hidden=True)
        rows = [len(ids) - 1] if t_ is None and len(ids) > 2 else range(len(ids))
        assert all(torch.allclose(la[i], lb[i], atol=1e-10, rtol=0) for i in rows)
        assert len(ha) == len(hb) == t.config.num_hidden_layers + 1
        assert all(torch.allclose(x, y, atol=1e-10, rtol=0) for x, y in zip(ha, hb))
        if keep:
            hf.keep(tree.size, keep)
            cu.keep(tree.size, keep)
        assert hf.length == cu.length


def test_the_cuda_engine_is_chosen_and_refused_with_a_reason(tiny_dirs):
    llama, gemma, mistral = (load64(tiny_dirs[a]) for a in ("llama", "gemma3", "mistral"))
    assert engine_name(llama.model) == "static"  # on a CPU; cuda on a CUDA device
    assert engine_name(gemma.model) == "hf"
    assert isinstance(make_runner(llama.model, 32, "cuda"), CudaRunner)
    assert isinstance(make_runner(gemma.model, 32, "cuda"), CudaRunner)
    mistral.model.config.sliding_window = (
        16  # a Mistral with a window is neither static nor Gemma-3
    )
    with pytest.raises(
        HeadwayError,
        match="inference.engine=cuda cannot run this Mistral target: the CUDA backend runs sliding "
        "windows for Gemma-3 only",
    ):
        make_runner(mistral.model, 32, "cuda")
    with pytest.raises(HeadwayError, match="largest row bucket"):
        CudaRunner(llama.model, 32, buckets=(1, 4)).bucket(5)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_backend_greedy_equals_plain(tiny_dirs, arch: str):
    """The device loop (drafts, verification and acceptance on tensors) writes plain greedy's
    tokens, with accepted paths of every length, and plain decoding on the backend writes the hf
    engine's."""
    t = load64(tiny_dirs[arch])
    tree = build_tree(WIDE_TREE)
    for seed, prompt in enumerate(prompts_for(t.tokenizer)):
        ids = t.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref = greedy_generate(t.model, ids, 48, [], engine="hf").tokens
        assert greedy_generate(t.model, ids, 48, [], engine="cuda").tokens == ref
        oracle = DeviceOracle(tree, ref, t.config.vocab_size, seed)
        res = speculative_generate(t.model, oracle, ids, 48, [], engine="cuda")
        assert res.tokens == ref
        assert max(res.accepted) >= 3 and min(res.accepted) == 0, res.accepted


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_backend_drafters_on_tensors_are_exact(tiny_dirs, arch: str):
    """EAGLE-3 and EAGLE-1 (the device expansion), Medusa and DFlash (static trees) through the
    device loop: plain greedy's tokens, and every step accepts what the host loop accepts."""
    t = load64(tiny_dirs[arch])
    stop = [t.tokenizer.eos_token_id]
    host_engine = "hf" if arch == "gemma3" else "static"  # (Gemma-3: no static engine on the host)
    eagle = EagleDrafter(random_head(t, "eagle3"), t.config.num_hidden_layers, 4, 3, 10)
    eagle1 = EagleDrafter(random_head(t, "eagle"), t.config.num_hidden_layers, 3, 2, 6)
    torch.manual_seed(0)
    hidden, vocab = t.config.hidden_size, t.config.vocab_size
    medusa_heads = MedusaHeads(MedusaConfig(num_heads=4, lm_head="shared"), hidden, vocab).double()
    medusa_heads.init_from_target(t.model)
    medusa_heads.attach_target(t.model)
    for block in medusa_heads.blocks:
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    medusa = MedusaDrafter(medusa_heads, build_tree(WIDE_TREE), t.config.num_hidden_layers)
    dflash_heads = dflash_head(t)
    dflash = DFlashDrafter(
        dflash_heads,
        build_tree(DFlashDrafter.default_tree(dflash_heads)),
        t.config.num_hidden_layers,
    )
    for text in ["What is two plus three?", "Write a short poem about the sea."]:
        ids = chat_ids(t, text)
        ref = greedy_generate(t.model, ids, 32, stop, engine="hf")
        for drafter in (eagle, eagle1, medusa, dflash):
            spec = speculative_generate(t.model, drafter, ids, 32, stop, engine="cuda")
            host = speculative_generate(t.model, drafter, ids, 32, stop, engine=host_engine)
            assert spec.tokens == ref.tokens
            assert spec.accepted == host.accepted


def test_device_acceptance_is_the_host_walk():
    """greedy_accept gives accept_greedy's path and bonus on random trees, duplicate sibling tokens,
    pads and argmax ties included (first max)."""
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randrange(1, 14)
        m = n + rng.randrange(0, 4)
        tree = random_tree(rng, n)
        vocab = rng.choice([3, 5, 50])
        node_ids = [rng.randrange(vocab) for _ in range(n)]
        logits = torch.randint(0, 3, (n, vocab)).double()  # small integers: ties are common
        for i in range(
            n
        ):  # the walk should often go deep: make some nodes the argmax of their parent
            for c in tree.children[i]:
                if rng.random() < 0.6:
                    logits[i, node_ids[c]] = 9.0
                    break
        path, bonus = accept_greedy(tree, node_ids, logits, Sampler(SamplingConfig()))
        parent = torch.tensor(tree.parent + [-1] * (m - n))
        tokens = torch.tensor(node_ids + [0] * (m - n))
        argmax = torch.cat([logits.argmax(-1), torch.zeros(m - n, dtype=torch.long)])
        v = greedy_accept(tokens, parent, tree_ancestors(parent), argmax, torch.tensor(n)).tolist()
        assert v[0] == len(path) - 1 and v[1] == bonus and v[2 : 2 + len(path)] == path, trial


def test_tree_ancestors_are_the_host_trees():
    rng = random.Random(1)
    for _ in range(100):
        tree = random_tree(rng, rng.randrange(1, 40))
        parent = torch.tensor(tree.parent)
        assert torch.equal(tree_ancestors(parent), tree.ancestors)
        assert torch.equal(tree_ancestors(parent).sum(1) - 1, tree.depth)


def test_kv_compaction_is_one_gather_copy_equal_to_the_per_layer_loop():
    torch.manual_seed(0)
    for trial in range(20):
        cache = KVCache(3, 2, 40, 4, torch.float64, torch.device("cpu"))
        cache.data.normal_()
        ref = [t.clone() for t in (*cache.k, *cache.v)]
        first = 10 + trial
        keep = sorted(random.Random(trial).sample(range(8), random.Random(trial).randrange(1, 8)))
        keep[0] = 0
        src = torch.tensor(keep) + first
        for c in ref:
            c[:, first : first + len(keep)] = c.index_select(1, src)
        as_tensor = trial % 2 == 0  # the CUDA backend passes the first slot as a device tensor
        cache.compact(torch.tensor(first) if as_tensor else first, src)
        assert all(torch.equal(a, b) for a, b in zip((*cache.k, *cache.v), ref))
    # each layer's keys and values stay views of the one tensor, which the layer step writes in
    # place
    assert (
        cache.k[2].data_ptr() == cache.data[2, 0].data_ptr()
        and cache.v[1].data_ptr() == cache.data[1, 1].data_ptr()
    )


@pytest.mark.parametrize("setting", [(3, 3, 8), (4, 4, 15), (1, 5, 1), (2, 1, 2), (3, 8, 20)])
def test_eagle_device_expansion_builds_the_host_tree(tiny_dirs, setting):
    """draft_tensors (the expansion on tensors) gives draft()'s tree: the same node ids in the same
    order, the same parents, step after step."""
    depth, k, total = setting
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3", seed=depth)
    drafter = EagleDrafter(heads, t.config.num_hidden_layers, depth, k, total)
    ids = chat_ids(t, "Write a short poem about the sea.")
    _, hidden = HFRunner(t.model).forward(torch.tensor(ids), hidden=True)
    feats = torch.cat([hidden[i][0] for i in drafter.feature_layers], -1)
    drafter.begin(ids, 7, feats)
    for step in range(4):
        root = 5 + step
        nodes, tree = drafter.draft(root)
        d_nodes, d_parent = drafter.draft_tensors(torch.tensor([root]))
        assert d_nodes.tolist() == nodes.tolist(), step
        assert d_parent.tolist() == tree.parent, step
        drafter.accept([3 + step, 4], feats[step : step + 2])


def test_cuda_backend_loop_reads_the_host_once_a_step(tiny_dirs):
    """On CPU tensors, the device loop with the EAGLE expansion reads the host once per speculative
    step (the verdict), plus the prompt's first token; the host loop reads many times per node and
    level."""
    t = load64(tiny_dirs["llama"])
    drafter = EagleDrafter(random_head(t, "eagle3"), t.config.num_hidden_layers, 3, 3, 8)
    ids = chat_ids(t, "What is two plus three?")
    counts = {}
    for engine in ("cuda", "static"):
        with HostReads() as reads:
            res = speculative_generate(t.model, drafter, ids, 16, [], engine=engine)
        counts[engine] = (reads.count, res.target_forwards)
    reads, steps = counts["cuda"]
    assert reads == steps + 1, counts
    assert counts["static"][0] > 5 * counts["static"][1], counts


def test_sdpa_is_pinned_off_cudnn():
    with pinned_sdpa():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()


def test_the_cuda_backend_costs_a_step_function_of_its_buckets(tiny_dirs):
    """verify_cost on the CUDA backend: one value per bucket, every node count from 1 up, so tune
    and the hybrid price a tree by its bucket."""
    t = load64(tiny_dirs["llama"])
    opts = EngineOptions(engine="cuda", cuda_buckets=(1, 4, 12))
    costs = verify_cost(t.model, [1, 3, 9], prefix_len=16, repeats=1, engine=opts)
    assert sorted(costs) == list(range(1, 10))
    assert costs[2] == costs[3] == costs[4] and len({costs[n] for n in range(5, 10)}) == 1


def test_gpu_targets_get_gpu_sized_trees():
    cfg = gpu_sized(RunConfig())
    assert (cfg.inference.depth, cfg.inference.top_k, cfg.inference.total_tokens) == (6, 10, 60)
    assert cfg.inference.hybrid.max_nodes == 60
    # the largest tree fits the largest default bucket
    assert cfg.inference.total_tokens + 1 <= max(cuda_buckets(cfg.inference))


def test_gemma3_past_its_sliding_window_matches_the_model_forward(tiny_dirs):
    """A prompt longer than Gemma-3's window (128 in the tiny model), then one-token steps: the
    sliding layers' masks (the prompt's, and each step's over the whole cache) keep the model's own
    logits."""
    t = load64(tiny_dirs["gemma3"])
    assert t.config.sliding_window == 128
    hf, cu = HFRunner(t.model), CudaRunner(t.model, 200, buckets=(1, 4))
    (la, _), (lb, _) = hf.forward(torch.arange(3, 153)), cu.forward(torch.arange(3, 153))
    assert torch.allclose(la[-1], lb[-1], atol=1e-10, rtol=0)
    for token in range(20, 30):
        (la, _), (lb, _) = hf.forward(torch.tensor([token])), cu.forward(torch.tensor([token]))
        assert torch.allclose(la[0], lb[0], atol=1e-10, rtol=0)
    # and the same step padded into a 4-row bucket
    cu.buckets = (4,)
    (la, _), (lb, _) = hf.forward(torch.tensor([31])), cu.forward(torch.tensor([31]))
    assert torch.allclose(la[0], lb[0], atol=1e-10, rtol=0)


def test_one_exact_bucket_fits_every_tree_of_the_config():
    ic = RunConfig().inference
    assert cuda_buckets(ic) == (48,)  # the hybrid's 32 nodes and the root
    assert cuda_buckets(gpu_sized(RunConfig()).inference) == (
        64,
    )  # EAGLE-2's 60 and the hybrid's 60
    assert cuda_buckets(dataclasses.replace(ic, cuda_buckets=[1, 16])) == (1, 16)
    with pytest.raises(HeadwayError, match="inference.cuda_buckets must be row counts >= 1"):
        dataclasses.replace(ic, cuda_buckets=[0, 16])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_equals_plain_in_one_bucket(tiny_dirs, arch, dtype):
    """bf16 and float32, the CUDA algorithm on CPU tensors through `speculative_generate` and
    `plain_generate` called directly, with no buckets asked for: the runner's default is the one
    exact bucket for every step (plain decoding included) and the row-exact tree attention:
    speculative tokens equal plain ones, for accepted paths of every length (the oracle) and for
    every head kind: the EAGLE-3 and EAGLE-1 expansions, Medusa and DFlash trees."""
    t = load_target(
        TargetConfig(name_or_path=str(tiny_dirs[arch]), device="cpu", num_threads=1, dtype=dtype)
    )
    assert not [
        a for a in vars(t.model) if a.startswith(("headway", "_headway"))
    ]  # (no buckets asked for)
    low = getattr(torch, dtype)
    tree = build_tree(WIDE_TREE)
    eagle = EagleDrafter(random_head(t, "eagle3").to(low), t.config.num_hidden_layers, 3, 3, 8)
    medusa_heads = MedusaHeads(
        MedusaConfig(num_heads=4, lm_head="shared"), t.config.hidden_size, t.config.vocab_size
    )
    medusa_heads.init_from_target(t.model)
    medusa_heads.attach_target(t.model)
    medusa = MedusaDrafter(medusa_heads.to(low), tree, t.config.num_hidden_layers)
    eagle1 = EagleDrafter(random_head(t, "eagle").to(low), t.config.num_hidden_layers, 3, 2, 6)
    dflash_heads = dflash_head(t).to(low)
    dflash = DFlashDrafter(
        dflash_heads,
        build_tree(DFlashDrafter.default_tree(dflash_heads)),
        t.config.num_hidden_layers,
    )
    for seed, prompt in enumerate(prompts_for(t.tokenizer)):
        ids = t.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref = greedy_generate(t.model, ids, 40, [], engine="cuda").tokens
        oracle = DeviceOracle(tree, ref, t.config.vocab_size, seed)
        for drafter in (oracle, eagle, eagle1, medusa, dflash):
            assert (
                speculative_generate(t.model, drafter, ids, 40, [], engine="cuda").tokens == ref
            ), drafter


def test_the_cpu_emulation_trims_only_what_no_real_row_reads(tiny_dirs):
    """On CPU tensors the tree attention skips the pad rows and the blocks past the longest row
    (CudaRunner.trim_blocks): every real row's logits and hidden states keep the bits of the full
    pass."""
    outs = []
    for trim in (True, False):
        t = load_target(
            TargetConfig(
                name_or_path=str(tiny_dirs["qwen2"]), device="cpu", num_threads=1, dtype="bfloat16"
            )
        )
        runner = CudaRunner(t.model, 96, buckets=(16,), graphs=False)
        runner.trim_blocks = trim
        runner.forward(torch.arange(5, 30))
        tree = random_tree(random.Random(3), 7)
        logits, states, _ = runner.step(torch.arange(40, 47), torch.tensor(tree.parent), 7)
        outs.append((logits[:7].clone(), [h[:7].clone() for h in states]))
    (a, ha), (b, hb) = outs
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ha, hb))
