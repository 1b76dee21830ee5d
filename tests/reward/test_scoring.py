"""Reward-model scores through RewardScorer vs transformers' *ForSequenceClassification (fp32):
HF's score position (rightmost token that is not the RM's pad id, pad == EOS included) and an RM
with its own tokenizer and chat template (prompt + response re-tokenized)."""

import json
import os
import string

import pytest
import torch

from remax_megatron.builtin.tokenizer import build_tokenizer
from remax_megatron.models.gpt import RewardModel
from tests._dist import SharedLaunches
from tools.make_tiny_model import make_tiny_model

PROMPTS = ["2+3=", "what is 7*6?", "say hi"]
# Responses as the actor's tokenizer decodes them; `eos` tokens appended to the ids (0, 1 or 2).
RESPONSES = [[("5", 1), ("5", 2), ("4 ", 0)], [("42", 1), (" forty", 2), ("", 1)], [("hi", 0), ("hello", 1)]]


def other_tokenizer():
    """Same characters, other ids (reversed, specials last), another chat template ending with EOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"][::-1]
    vocab = {t: i for i, t in enumerate(chars + ["<pad>", "<s>", "</s>", "<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = "<s>{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}</s>"
    return fast


def _set_config(model_dir, **values):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(values)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    kw = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, reward=True)
    actor_tok = build_tokenizer()
    # Llama-3 style: the RM's pad id is its EOS id.
    eos_rm = make_tiny_model(str(root / "eos_rm"), "llama", seed=4, **kw)
    _set_config(eos_rm, pad_token_id=actor_tok.eos_token_id)
    other_rm = make_tiny_model(str(root / "other_rm"), "llama", seed=5, **kw)
    tok = other_tokenizer()
    tok.save_pretrained(other_rm)
    _set_config(other_rm, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return {"eos_rm": eos_rm, "other_rm": other_rm}


def _actor_batch(actor_tok, chat_template: bool):
    """prompt_ids, prompt_texts and responses [(ids, text)] as the trainer hands them to the scorer."""
    texts = [
        actor_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        if chat_template
        else p
        for p in PROMPTS
    ]
    prompt_ids = [actor_tok(t, add_special_tokens=not chat_template)["input_ids"] for t in texts]
    responses = []
    for row in RESPONSES:
        out = []
        for text, eos in row:
            ids = actor_tok(text, add_special_tokens=False)["input_ids"] + [actor_tok.eos_token_id] * eos
            out.append((ids, actor_tok.decode(ids, skip_special_tokens=True)))
        responses.append(out)
    return prompt_ids, texts, responses


def _hf_scores(model_dir, sequences):
    """transformers on each sequence alone (batch 1, no padding): the score HF gives that text."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits.item() for s in sequences]


def _scorer_body(rank, world, model_dir, actor_tok, rm_tok, chat_template, batch, mbs, expected, passthrough):
    from remax_megatron.models import build_reward_model, read_hf_config
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.reward import RewardScorer
    from remax_megatron.reward.rm_inputs import RewardModelInputs
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize()
    model = build_reward_model(read_hf_config(model_dir), tp=1, pp=1, init_weights=False)
    load_hf_weights(model, model_dir)
    inputs = RewardModelInputs(actor_tok, rm_tok, chat_template=chat_template)
    assert inputs.passthrough == passthrough
    scorer = RewardScorer(None, model, micro_batch_size=mbs, rm_inputs=inputs)
    from remax_megatron.data.prompts import Prompt

    prompt_ids, texts, responses = batch
    prompts = [Prompt(index=i, text=t, token_ids=ids) for i, (ids, t) in enumerate(zip(prompt_ids, texts))]
    scores, _ = scorer.score(prompts, responses)
    flat = [s for row in scores for s in row]
    err = max(abs(a - b) for a, b in zip(flat, expected))
    assert err < 1e-5, f"max |score - transformers| = {err}: {flat} vs {expected}"


def _pad_eos_case(dirs, mbs):
    """(sequences, the scorer's args): pad id == EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["eos_rm"])
    batch = _actor_batch(tok, chat_template=False)
    prompt_ids, _, responses = batch
    sequences = [prompt_ids[i] + ids for i, row in enumerate(responses) for ids, _ in row]
    expected = _hf_scores(dirs["eos_rm"], sequences)
    return tok, sequences, (dirs["eos_rm"], tok, tok, False, batch, mbs, expected, True)


def _own_tokenizer_case(dirs, chat_template):
    """(actor tokenizer, RM tokenizer, the scorer's args): the RM has its own tokenizer (and template)."""
    from transformers import AutoTokenizer

    actor_tok = build_tokenizer()
    rm_tok = AutoTokenizer.from_pretrained(dirs["other_rm"])
    batch = _actor_batch(actor_tok, chat_template)
    _, _, responses = batch
    sequences = []
    for prompt, row in zip(PROMPTS, responses):
        for _, text in row:
            if chat_template:  # the RM's own template over the bare user message and the response
                conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
                sequences.append(rm_tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
            else:
                sequences.append(rm_tok(prompt + text)["input_ids"])
    expected = _hf_scores(dirs["other_rm"], sequences)
    return actor_tok, rm_tok, (dirs["other_rm"], actor_tok, rm_tok, chat_template, batch, 4, expected, False)


@pytest.fixture(scope="module")
def scorer_runs(dirs, tmp_path_factory):
    """The four single-process scorer cases below, prepared here and run in one launch: ({case: what
    the case's test checks in this process}, the launch)."""
    prepared = {f"pad_eos-{mbs}": _pad_eos_case(dirs, mbs) for mbs in (2, 8)}
    prepared.update({f"own_tokenizer-{ct}": _own_tokenizer_case(dirs, ct) for ct in (True, False)})
    launches = SharedLaunches(
        {1: {k: (_scorer_body, v[-1]) for k, v in prepared.items()}}, str(tmp_path_factory.mktemp("scorer"))
    )
    return {k: v[:-1] for k, v in prepared.items()}, launches


@pytest.mark.slow
@pytest.mark.parametrize("mbs", [2, 8])
def test_pad_equal_eos_scores_match_transformers(scorer_runs, mbs):
    """pad id == EOS: HF reads the token before the trailing EOS run; ours must too."""
    (tok, sequences), launches = scorer_runs[0][f"pad_eos-{mbs}"], scorer_runs[1]
    assert any(s[-1] == tok.eos_token_id for s in sequences)
    launches.check(f"pad_eos-{mbs}")


@pytest.mark.slow
@pytest.mark.parametrize("chat_template", [True, False])
def test_rm_with_own_tokenizer_scores_match_transformers(scorer_runs, chat_template):
    """Different ids for the same text: the scorer re-tokenizes with the RM's tokenizer (and template)."""
    (actor_tok, rm_tok), launches = scorer_runs[0][f"own_tokenizer-{chat_template}"], scorer_runs[1]
    assert actor_tok("2+3")["input_ids"] != rm_tok("2+3")["input_ids"]
    launches.check(f"own_tokenizer-{chat_template}")


def test_score_positions_follow_hf_rule():
    """Rightmost non-pad token within each length; 0 when all are pad; the last token without a pad id."""
    ids = torch.tensor([[5, 6, 2, 2], [5, 2, 6, 2], [2, 2, 9, 9], [7, 8, 9, 2]])
    lengths = torch.tensor([4, 4, 2, 3])
    assert RewardModel.score_positions(ids, lengths, 2).tolist() == [1, 2, 0, 2]
    assert RewardModel.score_positions(ids, lengths, None).tolist() == [3, 3, 1, 2]
    assert RewardModel.score_positions(ids, lengths, 0).tolist() == [3, 3, 1, 2]
    with pytest.raises(ValueError, match="empty sequence"):
        RewardModel.score_positions(ids, torch.tensor([4, 0, 1, 1]), 2)


def _layout_body(rank, world, model_dir, actor_tp, actor_pp, rm_tp, rm_pp, sequences, out_path):
    """One layout: this rank's groups and scores, written to out_path.rank<r> for the test to check."""
    from megatron.core import parallel_state as ps

    from remax_megatron.models import build_reward_model, read_hf_config
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.reward import RewardScorer
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=actor_tp, pp=actor_pp, world_size=world).initialize()
    model = build_reward_model(read_hf_config(model_dir), tp=rm_tp, pp=rm_pp, init_weights=False)
    load_hf_weights(model, model_dir)
    scorer = RewardScorer(None, model, micro_batch_size=2)
    # Each actor DP replica scores its own prompts (rows dp, dp + dp_size, ...); one prompt, many responses.
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = list(range(dp, len(sequences), dp_size))
    from remax_megatron.data.prompts import Prompt

    empty = [Prompt(index=0, text="", token_ids=[])]
    scores, _ = scorer.score(empty, [[(sequences[i], "") for i in mine]])
    # One item: the other RM replicas have nothing to score and still join the sum.
    single, _ = scorer.score(empty, [[(sequences[mine[-1]], "")]])
    result = {
        "groups": [model.tp_group.size(), model.pp_group.size()],
        "replicas": [model.layout.replicas, model.layout.actor_replicas],
        "mine": mine,
        "scores": scores[0],
        "single": single[0][0],
    }
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(result, f)


def test_replicas_share_the_items():
    from remax_megatron.parallel.nested import NestedGroups

    shares = [NestedGroups(None, None, r, 3, 0, 0, 1, 1).share(7) for r in range(3)]
    assert [list(s) for s in shares] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(NestedGroups(None, None, r, 2, 0, 0, 1, 1).share(1)) for r in range(2)] == [1, 0]


LAYOUTS = [  # actor_tp, actor_pp, rm_tp, rm_pp, world
    (2, 1, 1, 1, 2),  # actor TP=2, RM TP=1: two RM replicas split the items
    (1, 2, 1, 1, 2),  # actor PP=2, RM PP=1
    (2, 2, 1, 2, 4),  # RM pipeline (PP=2) on its own groups inside a TP=2 x PP=2 actor group
    (2, 1, 1, 1, 4),  # DP=2: each actor replica scores its own items
    (1, 1, 2, 1, 2),  # RM TP=2 over two actor DP replicas (TP=1): their items are gathered
    (1, 1, 1, 2, 2),  # RM PP=2 over two actor DP replicas
]


@pytest.fixture(scope="module")
def layout_runs(dirs, tmp_path_factory):
    """The layout cases' sequences, transformers' scores, the launches (one per world size: process
    starts and imports are most of a case's time on CPU) and where each case's results lie."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["eos_rm"])
    g = torch.Generator().manual_seed(1)
    sequences = []
    for n in [5, 9, 3, 12, 7, 4, 10]:  # 7 items: uneven split over replicas and micro-batches
        ids = torch.randint(4, len(tok), (n,), generator=g).tolist()
        sequences.append(ids + [tok.eos_token_id] * (n % 3))  # trailing EOS (= the RM's pad id) runs
    expected = _hf_scores(dirs["eos_rm"], sequences)
    top = str(tmp_path_factory.mktemp("layouts"))
    cases = {2: {}, 4: {}}
    for *layout, world in LAYOUTS:
        name = "-".join(map(str, layout))
        cases[world][name] = (_layout_body, (dirs["eos_rm"], *layout, sequences, os.path.join(top, name)))
    return expected, SharedLaunches(cases, top), top


@pytest.mark.slow
@pytest.mark.parametrize("actor_tp,actor_pp,rm_tp,rm_pp,world", LAYOUTS)
def test_reward_model_layout_independent_of_actor(layout_runs, actor_tp, actor_pp, rm_tp, rm_pp, world):
    expected, launches, top = layout_runs
    name = f"{actor_tp}-{actor_pp}-{rm_tp}-{rm_pp}"
    launches.check(name)
    case = f"actor ({actor_tp}, {actor_pp}) rm ({rm_tp}, {rm_pp})"
    for rank in range(world):
        with open(os.path.join(top, f"{name}.rank{rank}")) as f:
            r = json.load(f)
        assert r["groups"] == [rm_tp, rm_pp], (case, rank, r["groups"])
        replicas, actor_replicas = r["replicas"]
        assert replicas * actor_replicas == actor_tp * actor_pp // (
            rm_tp * rm_pp
        ) or actor_replicas == rm_tp * rm_pp // (actor_tp * actor_pp), (case, rank, r["replicas"])
        mine = r["mine"]
        err = max(abs(r["scores"][j] - expected[i]) for j, i in enumerate(mine))
        assert err < 1e-5, f"{case} rank {rank}: max |score - transformers| = {err}"
        # One item: the other RM replicas have nothing to score and still join the sum.
        assert abs(r["single"] - expected[mine[-1]]) < 1e-5, (case, rank, r["single"], expected[mine[-1]])


def _budget_body(rank, world, model_dir, sequences, out_path):
    """The same items scored with fixed-count micro-batches and under a token budget (trainer.micro_batch_tokens),
    and the micro-batch shapes the budget made."""
    from remax_megatron.models import build_reward_model, read_hf_config
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.reward import RewardScorer
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize()
    model = build_reward_model(read_hf_config(model_dir), tp=1, pp=1, init_weights=False)
    load_hf_weights(model, model_dir)
    from remax_megatron.data.prompts import Prompt

    empty = [Prompt(index=0, text="", token_ids=[])]
    items = [[(s, "") for s in sequences]]
    fixed, _ = RewardScorer(None, model, micro_batch_size=2).score(empty, items)
    budgeted = RewardScorer(None, model, micro_batch_size=2, micro_batch_tokens=24)
    shapes = [tuple(b["input_ids"].shape) for b in budgeted._budget_batches(sequences)[1]]
    scored, _ = budgeted.score(empty, items)
    with open(out_path, "w") as f:
        json.dump({"fixed": fixed[0], "budget": scored[0], "shapes": shapes}, f)


def test_reward_model_honours_the_token_budget(dirs, tmp_path):
    """trainer.micro_batch_tokens groups the RM's rows as the training forward does (longest first, each
    micro-batch as wide as its longest row, rows x width <= budget; a row over the budget alone); the scores
    equal the fixed-count ones to fp32 rounding."""
    from tests._dist import run_distributed

    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(4, 60, (n,), generator=g).tolist() for n in [5, 9, 3, 12, 7, 4, 10, 30]]
    out = str(tmp_path / "scores.json")
    run_distributed(_budget_body, 1, (dirs["eos_rm"], sequences, out))
    with open(out) as f:
        r = json.load(f)
    # longest first: [30] alone (over the budget: it runs alone), then 12+10 (2 x 12), 9+7 (2 x 9), 5+4+3 (3 x 5)
    assert [tuple(s) for s in r["shapes"]] == [(1, 30), (2, 12), (2, 9), (3, 5)]
    # Not bitwise: other shapes, other GEMM blockings (fp32 CPU: ~1e-7 apart); each equals transformers' too.
    err = max(abs(a - b) for a, b in zip(r["budget"], r["fixed"]))
    print(f"max |budget - fixed| = {err:.3g}")
    assert err < 1e-5, (r["budget"], r["fixed"])
