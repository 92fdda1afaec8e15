"""Trees of drafts: several candidate branches per row verified in one step (the shape
Lookahead and multi-candidate n-gram proposers give). Test-only proposers put the true
continuation on one branch among wrong ones; output must equal decoding without drafts
(greedy, seeded sampling, penalties), on the torch backend and the Triton kernels."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.engine.test_multi_token_steps import _prompts, _run, _summary
from tests.tiny_models import save_tiny_model
from tokenmill import SamplingParams
from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.draft_tree import (
    DraftTree,
    branch_drafts,
    chain_parents,
    tree_layout,
    walk_tree,
)
from tokenmill.engine.cuda_graphs import _padded_masks, _padded_rows
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

MAX_TOKENS = 24
L = 3  # the true branch's length


def build_tree(branches: list[tuple[int, list[int]]], width: int) -> tuple[list, list]:
    """Flatten branches (parent step token, its chain of tokens) into (tokens, parents) of
    ``width`` entries (-1 padded); step token i + 1 is entry i."""
    tokens: list[int] = []
    parents: list[int] = []
    for parent, chain in branches:
        for t in chain:
            tokens.append(t)
            parents.append(parent)
            parent = len(tokens)  # the next token hangs under this one
    pad = width - len(tokens)
    return tokens + [-1] * pad, parents + [0] * pad


class TreeProposer:
    """Per row: a wrong chain, the true continuation (L tokens), and a branch that shares the
    true first token then goes wrong; ``true_first`` puts the true branch first."""

    makes_trees = True  # CUDA graphs for its tree steps

    def __init__(self, outputs: dict[str, list[int]], true_first: bool = False) -> None:
        self.outputs = outputs
        self.true_first = true_first
        self.max_drafts = 2 + L + 2

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> DraftTree:
        tokens, parents = [], []
        for slot in rows.tolist():
            want = self.outputs[slots.requests[slot].request_id]
            done = int(slots.num_tokens[slot] - slots.num_prompt[slot])
            true = want[done : done + L]
            wrong = [(t + 1) % 250 + 5 for t in true[:2]]
            if self.true_first:
                branches = [(0, true), (0, wrong)]
                if true:
                    branches.append((1, wrong[:2]))  # under the true first token
            else:
                branches = [(0, wrong), (0, true)]
                if true:
                    branches.append((len(wrong) + 1, wrong[:2]))
            t, p = build_tree(branches, self.max_drafts)
            tokens.append(t)
            parents.append(p)
        return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("trees") / "m")


@pytest.mark.parametrize("true_first", [True, False], ids=["in-place", "recomputed"])
def test_greedy_output_equals_plain_decoding(model_path: Path, true_first: bool) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6
    want, base_steps, _ = _run(model_path, params)
    proposer = TreeProposer({r: o.token_ids for r, o in want.items()}, true_first)
    got, steps, engine = _run(model_path, params, proposer)
    assert _summary(got) == _summary(want)
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens > 0
    if true_first:  # every tree step keeps L drafts + the bonus, KV in place
        assert steps == 1 + -(-(MAX_TOKENS - 1) // (L + 1))
    else:  # the accepted branch's KV is not in place: the next step recomputes it
        assert steps < base_steps


def test_seeded_sampling_and_penalties_follow_the_branch(model_path: Path) -> None:
    """A seeded row draws each token from (seed, output position): a tree node's position is
    its depth, so the tokens equal plain decoding's; penalties see the node's ancestors."""
    params = []
    for i in range(6):
        kwargs = {"seed": 7 + i, "temperature": 0.9, "top_k": 50}
        if i % 2:
            kwargs = {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5}
        params.append(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs))
    want, base_steps, _ = _run(model_path, params)
    for true_first in (True, False):
        proposer = TreeProposer({r: o.token_ids for r, o in want.items()}, true_first)
        got, steps, _ = _run(model_path, params, proposer)
        assert _summary(got) == _summary(want)
        assert steps < base_steps


def test_triton_kernels_take_trees(model_path: Path) -> None:
    """The Triton backend (the interpreter here) sends tree rows to the prefill kernel with
    their masks: the torch backend's tokens."""
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)] * 3
    want, _, _ = _run(model_path, params, block_size=16, backend="torch")
    proposer = TreeProposer({r: o.token_ids for r, o in want.items()})
    got, _, engine = _run(model_path, params, proposer, block_size=16, backend="triton")
    assert _summary(got) == _summary(want)
    assert engine.scheduler.stats.num_accepted_tokens > 0


def test_layout_walk_and_ancestors() -> None:
    #  t ─┬─ a(1) ─┬─ b(2)
    #     │        └─ c(5)
    #     └─ x(3) ── y(4)
    parents = np.array([[0, 1, 0, 3, 1]])
    drafts = np.array([[10, 11, 20, 21, 12]])
    depth, masks = tree_layout(parents, np.array([5]))
    assert depth.tolist() == [[0, 1, 2, 1, 2, 2]]
    assert masks.tolist() == [[0b1, 0b11, 0b111, 0b1001, 0b11001, 0b100011]]
    assert branch_drafts(parents[0], 5) == [0, 4]  # c's logits follow a, c
    assert branch_drafts(parents[0], 4) == [2, 3]  # y's follow x, y
    assert branch_drafts(parents[0], 0) == []
    # samples: t -> 10 (a), a -> 12 (c), c -> 99 (bonus): the path t, a, c
    sampled = np.array([[10, 12, 0, 0, 0, 99]])
    path, accepted = walk_tree(sampled, drafts, parents, np.array([5]))
    assert accepted.tolist() == [2]
    assert path.tolist() == [[0, 1, 5, -1, -1, -1]]
    # t -> 20 (x), x -> 21 (y), y -> 7: the path t, x, y; a row of no drafts keeps t's sample
    sampled = np.array([[20, 0, 0, 21, 7, 0], [5, 0, 0, 0, 0, 0]])
    both = np.vstack([parents, parents])
    path, accepted = walk_tree(sampled, np.vstack([drafts, drafts]), both, np.array([5, 0]))
    assert accepted.tolist() == [2, 0]
    assert path[0, :3].tolist() == [0, 3, 4] and path[1, 0] == 0
    assert chain_parents(2, 3).tolist() == [[0, 1, 2], [0, 1, 2]]


def test_bad_trees_are_refused() -> None:
    with pytest.raises(ValueError, match="parent"):
        DraftTree(np.array([[5, 6]]), np.array([[0, 2]]))  # draft 2 under itself
    with pytest.raises(ValueError, match="rows, drafts"):
        DraftTree(np.array([[5, 6]]), np.array([0, 1]))


def test_left_padded_masks_attend_as_the_unpadded_step() -> None:
    """Tree graphs left-pad each row to T tokens inside its own context: with the shifted
    masks, every real token attends exactly as in the unpadded step (reference kernel)."""
    from tests.kernels.test_paged_prefill_attention import make_batch
    from tests.kernels.test_tree_attention import masks_for, random_tree

    g = torch.Generator().manual_seed(5)
    t = 9
    requests = [(6, 30), (1, 12), (9, 40), (3, 20)]  # (step tokens, seq_len)
    trees = {0: random_tree(6, g), 2: random_tree(9, g), 3: random_tree(3, g)}
    args = make_batch(requests, 4, 2, 32, 16, torch.float32, device="cpu")
    masks = masks_for(requests, trees).cpu()
    want = paged_prefill_attention_ref(*args, tree_mask=masks)

    lens = np.array([q for q, _ in requests])
    batch = SimpleNamespace(query_lens=lens, tree_mask=masks.numpy())
    dest = _padded_rows(lens, t)
    padded_masks = torch.from_numpy(_padded_masks(batch, t, dest))
    q = args[0]
    padded_q = torch.zeros(len(requests) * t, *q.shape[1:])
    padded_q[torch.from_numpy(dest)] = q
    qsl = torch.arange(0, len(requests) * t + 1, t, dtype=torch.int32)
    padded = (padded_q, args[1], args[2], args[3], qsl, args[5], t, args[7])
    rows = torch.from_numpy(dest)
    got = paged_prefill_attention_ref(*padded, tree_mask=padded_masks)
    torch.testing.assert_close(got[rows], want, atol=1e-6, rtol=1e-6)
    # the kernel (the interpreter here), keys through the cache as the Triton backend asks
    got = paged_prefill_attention(*padded, tree_mask=padded_masks)
    torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tree_steps_replay_cuda_graphs(model_path: Path) -> None:
    """On CUDA: decode steps whose rows carry trees replay the tree graphs (rows left-padded
    to 1 + max_drafts tokens) with the tokens of eager tree steps and of plain decoding."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6
    want, _, _ = _run(model_path, params, device="cuda", block_size=16)
    runs = {}
    for graphs in (True, False):
        proposer = TreeProposer({r: o.token_ids for r, o in want.items()})
        config = EngineConfig(model=str(model_path), device="cuda", dtype="float32",
                              block_size=16, kv_cache_memory=1 << 26, profile_steps=True,
                              cuda_graphs=graphs)  # fmt: skip
        engine = LLMEngine(config, proposer)
        for i, (prompt, p) in enumerate(zip(_prompts(), params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step())
        runs[graphs] = (done, engine.step_profile())
    assert _summary(runs[True][0]) == _summary(runs[False][0]) == _summary(want)
    assert runs[True][1]["decode"]["graph_steps"] > 0
    assert runs[False][1]["decode"]["graph_steps"] == 0
