"""The lm-eval model ``infinikv`` and its launcher, on the tiny random model and small local tasks.

Scores are checked against plain transformers forward passes of the whole sequence (no infinikv cache), so
a wrong split of context and continuation, a mis-scored position or a lost stop string fails here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from infinikv.errors import InfinikvError
from infinikv.lm_eval import InfinikvLM
from infinikv.lm_eval.launcher import main as launch
from infinikv.lm_eval.launcher import with_defaults
from infinikv.models import default_device
from infinikv.policies import POLICIES

from .test_policy_matrix import CASES

DOCS = [
    {"question": "Alpha beta gamma delta.", "choices": [" epsilon", " zeta eta"], "label": 0, "answer": "x"},
    {"question": "One two three four five six", "choices": [" seven", " 8"], "label": 1, "answer": "y"},
    {"question": "The quick brown fox", "choices": [" jumps", " sleeps all day"], "label": 0, "answer": "z"},
]
SRC = Path(__file__).resolve().parents[1] / "src"
SELECTIVE = [name for name in POLICIES if CASES[name].selects]


def write_tasks(folder, data_file) -> None:
    """A multiple-choice task (loglikelihood), a generation task (generate_until, stopping at a newline after
    at most 8 tokens) and a perplexity task (loglikelihood_rolling) over ``data_file``."""
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\ntest_split: test\n"
        'doc_to_text: "{{question}}"\n'
    )
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\n"
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n"
        + common.replace('doc_to_text: "{{question}}"\n', "")
        + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{question}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    write_tasks(folder, data)
    return folder


def full_logprob(loaded, context: list[int], continuation: list[int]) -> float:
    """Log-probability of ``continuation`` after ``context`` from one dense forward pass."""
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logp = torch.log_softmax(loaded.model(input_ids=ids).logits.float()[0], dim=-1)
    return sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def greedy_text(loaded, prompt: str, new_tokens: int, stop: str) -> str:
    """Greedy text by full forward passes, cut before ``stop``."""
    ids = loaded.tokenizer(prompt)["input_ids"]
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(new_tokens):
            token = int(loaded.model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == loaded.tokenizer.eos_token_id:
                break
            out.append(token)
    return loaded.tokenizer.decode(out, skip_special_tokens=True).split(stop)[0]


def test_simple_evaluate_scores_local_tasks_as_full_forward_passes(tiny, task_folder):
    lm = InfinikvLM(tiny, policy="dense", batch_size=2)
    result = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc", "tiny_gen", "tiny_ppl"],
        task_manager=TaskManager(include_path=str(task_folder), include_defaults=False),
        log_samples=True,
    )
    tokenizer = tiny.tokenizer
    by_task = {task: sorted(result["samples"][task], key=lambda s: s["doc_id"]) for task in result["samples"]}
    for sample in by_task["tiny_mc"]:
        # the byte tokenizer has one token per byte and no special tokens: context and continuation split
        # where their texts do
        for (context, continuation), [(logprob, _greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ids = tokenizer(context)["input_ids"], tokenizer(continuation)["input_ids"]
            assert float(logprob) == pytest.approx(full_logprob(tiny, *ids), abs=1e-3)
    for doc, sample in zip(DOCS, by_task["tiny_gen"], strict=True):
        assert sample["resps"][0][0] == greedy_text(tiny, doc["question"], 8, "\n")
    for doc, sample in zip(DOCS, by_task["tiny_ppl"], strict=True):
        ids = tokenizer(doc["question"], add_special_tokens=False)["input_ids"]
        expected = full_logprob(tiny, [tokenizer.bos_token_id], ids)
        assert sample["resps"][0][0] == pytest.approx(expected, abs=1e-3)
    accuracy = result["results"]["tiny_mc"]["acc,none"]
    assert 0 <= accuracy <= 1 and math.isclose(accuracy * 3, round(accuracy * 3))


def loglikelihoods(loaded, policy: str, knobs: dict, batch_size: int = 2) -> list[tuple[float, bool]]:
    """Three pairs of different lengths, the longest with a context of 160 tokens."""
    pairs = [
        ("".join(f"line {i}: value {i * 7 % 13}\n" for i in range(10)), "line 10: value 5"),
        ("A short context", " and its end"),
        ("Tokens " * 10, "more tokens"),
    ]
    lm = InfinikvLM(loaded, policy=policy, batch_size=batch_size, **knobs)
    return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])


@pytest.mark.parametrize("policy", SELECTIVE)
def test_full_budget_scores_exactly_what_dense_scores(tiny, policy):
    full, dense = loglikelihoods(tiny, policy, CASES[policy].full), loglikelihoods(tiny, "dense", {})
    if policy != "h2o":
        assert full == dense
        return
    # H2O attends with explicit softmax weights (it accumulates them), not SDPA: the same sums, rounded
    # differently, so equal to float32 precision and greedy for greedy.
    assert [greedy for _, greedy in full] == [greedy for _, greedy in dense]
    assert [logprob for logprob, _ in full] == pytest.approx([logprob for logprob, _ in dense], rel=1e-6)


@pytest.mark.parametrize("policy", SELECTIVE)
def test_a_small_budget_changes_the_loglikelihoods(tiny, policy):
    """Every scored token is predicted under the policy: the longest pair's score moves at the tight
    setting (the shorter ones may fit whole in what it keeps)."""
    tight, dense = loglikelihoods(tiny, policy, CASES[policy].tight), loglikelihoods(tiny, "dense", {})
    assert tight[0][0] != pytest.approx(dense[0][0], abs=1e-4)


@pytest.mark.parametrize("setting", ["defaults", "tight"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_pairs_score_does_not_depend_on_its_batch(tiny, policy, setting):
    """Each pair is scored as its own sequence on the engine's decode step (no padding, each row's
    projections as alone): batched with pairs of other lengths, it gets its score alone, to the last bit."""
    knobs = CASES[policy].tight if setting == "tight" else {}
    alone = loglikelihoods(tiny, policy, knobs, batch_size=1)
    assert loglikelihoods(tiny, policy, knobs, batch_size=3) == alone


def test_an_empty_continuation_scores_zero_and_greedy(tiny):
    """A continuation that adds no token (lm-eval can ask for one) has log-probability 0 and is greedy,
    beside a pair that has tokens to score."""
    lm = InfinikvLM(tiny, policy="dense", batch_size=2)
    pairs = [("A context", ""), ("A", " b")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    empty, scored = lm.loglikelihood(requests)
    assert empty == (0.0, True)
    assert scored[0] < 0


def test_batching_and_decode_context_do_not_change_dense_scores(tiny):
    """Dense attention is the same whether a token is prefilled or decoded, alone or batched."""
    reference = loglikelihoods(tiny, "dense", {})
    for variant in (
        loglikelihoods(tiny, "dense", {}, batch_size=1),
        loglikelihoods(tiny, "dense", {"decode_context": 50}),
    ):
        assert [greedy for _, greedy in variant] == [greedy for _, greedy in reference]
        assert [lp for lp, _ in variant] == pytest.approx([lp for lp, _ in reference], abs=1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"policy": "nonesuch"}, "unknown policy"),
        ({"policy": "h2o", "budgett": 0.1}, "unknown model_args budgett"),
        ({"policy": "dense", "budget": 0.1}, "policy 'dense' has no knob budget"),
        ({"policy": "quest", "budget": -1}, "budget must be >"),
        ({"batch_size": "auto"}, "batch_size must be a whole number"),
        ({"decode_context": 0}, "decode_context must be a whole number of at least 1"),
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"pretrained": "no-such-model"}, "unknown model 'no-such-model'"),
    ],
)
def test_bad_model_args_are_refused_in_one_line(args, message):
    with pytest.raises(InfinikvError, match=message) as caught:
        InfinikvLM.create_from_arg_obj(args, {"device": "cpu"})
    assert "\n" not in str(caught.value)


def test_unsupported_generation_argument_is_refused(tiny):
    lm = InfinikvLM(tiny)
    request = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "top_k": 5}), 0)
    with pytest.raises(InfinikvError, match="generation argument top_k is not supported"):
        lm.generate_until([request])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny):
    """The tiny model as an HF directory, so the launcher loads it by path."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


def test_launcher_adds_the_tokenizer_folder_and_device_before_the_users_options(tiny_dir):
    args = ["--model", "infinikv", "--model_args", f"pretrained={tiny_dir}", "--tasks", "niah_single_1"]
    defaults = ["--metadata", json.dumps({"tokenizer": str(tiny_dir)}), "--device", str(default_device())]
    assert with_defaults(args) == defaults + args  # first, so that a --metadata or --device given wins
    assert with_defaults(["run", *args]) == ["run", *defaults, *args]
    named = ["--model", "infinikv", "--model_args", f'{{"pretrained": "{tiny_dir}", "device": "cpu"}}']
    assert with_defaults(named) == defaults[:2] + named
    assert with_defaults(["--model", "hf", "--model_args", "pretrained=gpt2"])[0] == "--model"


def test_launcher_refuses_bad_model_args_in_one_line_before_lm_eval_starts(tiny_dir, capsys):
    code = launch(
        ["--model", "infinikv", "--model_args", f"pretrained={tiny_dir},policy=h2o,budgett=0.1"]
        + ["--tasks", "tiny_gen"]
    )
    assert code == 2
    assert capsys.readouterr().err.startswith("infinikv lm-eval: error: unknown model_args budgett:")


def test_an_unknown_task_is_one_line(tiny_dir, capsys):
    code = launch(
        ["--model", "infinikv", "--model_args", f"pretrained={tiny_dir}", "--tasks", "no_such_task"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("infinikv lm-eval: error: Tasks not found: no_such_task") and "\n" not in err


def test_launcher_hands_options_to_lm_eval(tiny_dir, task_folder, tmp_path):
    code = launch(
        ["--model", "infinikv", "--model_args", f"pretrained={tiny_dir},policy=oracle,budget=0.5"]
        + ["--tasks", "tiny_gen", "--include_path", str(task_folder), "--limit", "2"]
        + ["--output_path", str(tmp_path), "--log_samples"]
    )
    assert code == 0
    [results] = tmp_path.rglob("results_*.json")
    saved = json.loads(results.read_text())
    assert saved["config"]["infinikv_policy"] == "oracle"
    assert saved["config"]["infinikv_knobs"]["budget"] == 0.5
    assert saved["n-samples"]["tiny_gen"]["effective"] == 2
    [samples] = tmp_path.rglob("samples_tiny_gen_*.jsonl")
    assert len(samples.read_text().splitlines()) == 2


def test_a_task_without_its_data_fails_in_one_line(tiny_dir, tmp_path):
    """As a user runs it: its own process, so lm-eval's logging is set up as it is for them."""
    write_tasks(tmp_path, tmp_path / "missing.jsonl")
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "infinikv", "lm-eval", "--model", "infinikv"]
        + ["--model_args", f"pretrained={tiny_dir}", "--tasks", "tiny_gen", "--include_path", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("infinikv lm-eval: error: a task's data is missing") and "missing.jsonl" in last
