"""Scoring pinned to hand-worked cases of the official rules (vqaEval.py, EvalAI/m4c, MMBench, eval_pope)."""

import pytest
from mm_oval.eval.mmbench import MMBenchTask, build_prompt, extract_answer
from mm_oval.eval.pope import POPETask, yes_no
from mm_oval.eval.tasks import Item
from mm_oval.eval.textvqa import evalai_normalize, textvqa_accuracy
from mm_oval.eval.vqa import (
    aggregate,
    normalize_ground_truth,
    normalize_prediction,
    process_punctuation,
    vqa_accuracy,
)

# ---------------------------------------------------------------- VQAv2 normaliser (vqaEval.py)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("2.5", "2.5"),  # a period before a digit stays
        ("2.", "2"),
        ("1,000", "1000"),  # digit-comma-digit: every punctuation mark is deleted, not spaced
        ("ten", "10"),
        ("Ten", "10"),
        ("none", "0"),
        ("a dog", "dog"),
        ("The Dog.", "dog"),
        ("dont", "don't"),
        ("don't", "don't"),  # the apostrophe is not in the punctuation list
        ("yes!", "yes"),
        ("Yes.", "yes"),
        ("red-white", "red white"),  # no space next to '-': replaced by a space
        ("red - white", "red white"),  # a space next to '-': deleted
        ("hot dog?", "hot dog"),
        ("  two\ndogs\t", "2 dogs"),
        ("e.g.", "eg"),  # the misspelt look-behind: any '.' not before a digit goes
        ("3:30", "3:30"),  # ':' is not in the list
        ("dog's", "dog's"),
    ],
)
def test_vqav2_prediction_normalisation(raw, expected):
    assert normalize_prediction(raw) == expected


def test_vqav2_period_regex_gets_re_unicode_as_count():
    # re.UNICODE == 32 is passed positionally as `count`: only the first 32 periods are removed
    assert process_punctuation("." * 40) == "." * 8


def test_vqav2_ground_truth_punctuation_only_when_answers_differ():
    assert normalize_ground_truth(["hot-dog"] * 10) == ["hot-dog"] * 10
    assert normalize_ground_truth(["hot-dog"] * 9 + ["hotdog"])[:1] == ["hot dog"]
    # never lowercased or digit-mapped
    assert normalize_ground_truth(["Two", "two"]) == ["Two", "two"]


def test_vqav2_2017_rule_answers_that_differ_only_by_punctuation():
    # the vqaeval-2017 rule (test_eval_rules.py compares the three rules)
    # differing answers: "hot-dog" is punctuation-processed to "hot dog" and matches the prediction
    assert vqa_accuracy("hot dog", ["hot-dog"] * 5 + ["hot dog"] * 5, "vqaeval-2017") == 1.0
    # ten identical "hot-dog" are left alone while the prediction becomes "hot dog": no match (the quirk)
    assert vqa_accuracy("hot-dog", ["hot-dog"] * 10, "vqaeval-2017") == 0.0
    # ground truth is not lowercased: ten identical "Yes" match nothing
    assert vqa_accuracy("Yes", ["Yes"] * 10, "vqaeval-2017") == 0.0
    assert vqa_accuracy("Yes", ["yes"] * 10, "vqaeval-2017") == 1.0
    # nor digit-mapped: "two" in the ground truth never matches (predictions become "2")
    assert vqa_accuracy("two", ["two"] * 10, "vqaeval-2017") == 0.0
    assert vqa_accuracy("2", ["2"] * 10, "vqaeval-2017") == 1.0


@pytest.mark.parametrize(
    "k, expected",
    [
        (0, 0.0),
        (1, 0.3),
        (2, 0.6),
        (3, 0.9),
        (4, 1.0),
        (5, 1.0),
        (6, 1.0),
        (7, 1.0),
        (8, 1.0),
        (9, 1.0),
        (10, 1.0),
    ],
)
def test_vqa_leave_one_out_average_for_k_matching_answers(k, expected):
    # by hand: k answers match. Leaving out a matching one leaves k-1, a non-matching one k:
    # mean = (k*min(1,(k-1)/3) + (10-k)*min(1,k/3)) / 10 -> 0, .3, .6, .9, 1, ...
    answers = [{"answer": "cat", "answer_confidence": "yes", "answer_id": i + 1} for i in range(k)]
    answers += [{"answer": "dog", "answer_confidence": "yes", "answer_id": i + 1} for i in range(k, 10)]
    assert vqa_accuracy("cat", answers) == pytest.approx(expected, abs=1e-12)
    assert vqa_accuracy("cat", [a["answer"] for a in answers]) == pytest.approx(expected, abs=1e-12)


def test_vqa_aggregate_rounds_like_the_script():
    rows = [(1.0, "what", "other"), (0.3, "what", "other"), (0.0, "is", "yes/no")]
    out = aggregate(rows)
    assert out["overall"] == round(100 * 1.3 / 3, 2) == 43.33
    assert out["perQuestionType"] == {"what": 65.0, "is": 0.0}
    assert out["perAnswerType"] == {"other": 65.0, "yes/no": 0.0}


# ---------------------------------------------------------------- TextVQA normaliser (EvalAIAnswerProcessor)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("2.5", "2.5"),
        ("1,000", "1000"),
        ("Ten", "10"),
        ("A Dog", "dog"),
        ("dont", "don't"),
        ("Dog's", "dog 's"),  # "'s" is split off (vqaEval keeps "dog's")
        ("Stop?", "stop"),
        ("coca-cola", "coca cola"),
        ("The End.", "end"),
    ],
)
def test_evalai_normalisation(raw, expected):
    assert evalai_normalize(raw) == expected


def test_normalisers_differ_where_the_sources_do():
    # ground truth is fully normalised for TextVQA, only punctuation-processed for VQAv2
    assert textvqa_accuracy("2", ["two"] * 10) == 1.0
    assert vqa_accuracy("2", ["two"] * 10) == 0.0
    assert textvqa_accuracy("Yes", ["Yes"] * 10) == 1.0
    assert normalize_prediction("dog's") != evalai_normalize("dog's")


@pytest.mark.parametrize("k, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_textvqa_leave_one_out(k, expected):
    assert textvqa_accuracy("cat", ["cat"] * k + ["dog"] * (10 - k)) == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------- MMBench


CHOICES = {"A": "red", "B": "blue", "C": "green", "D": "yellow"}


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B)", "B"),
        ("The answer is B", "B"),
        ("The answer is B.", "B"),
        ("blue", "B"),  # option text only
        ("It is blue.", "B"),
        ("A B", None),  # two letters: a miss
        ("(A) or (B)", None),
        ("red or blue", None),  # two option texts: a miss
        ("purple", None),
        ("", None),
        ("A cat on a mat", None),  # "A" with >3 tokens is read as the article
    ],
)
def test_mmbench_answer_extraction(answer, expected):
    assert extract_answer(answer, dict(CHOICES)) == expected


def test_mmbench_prompt_is_llava_15s():
    p = build_prompt("What color?", "Look closely.", ["red", "blue"])
    assert (
        p
        == "Look closely.\nWhat color?\nA. red\nB. blue\nAnswer with the option's letter from the given choices directly."
    )
    for no_hint in ("nan", "None", None, float("nan"), ""):  # LLaVA's is_none, and an empty cell
        assert build_prompt("Q?", no_hint, ["x", "y"]).startswith("Q?\nA. x")
    assert build_prompt("Q?", " ", ["x"]).startswith(" \nQ?")  # a blank hint is text, as in LLaVA


def test_the_bundled_models_training_prompts_are_the_harness_mmbench_prompts():
    from mm_oval.zoo.generate import Question

    for hint in ("", "the object is in row 2 column 3 ."):
        q = Question("hint lookup", "what color is the object ?", "B", [], hint=hint, options=["red", "blue"])
        assert q.mmbench_prompt() == build_prompt(q.text, hint, q.options)
    assert q.mmbench_prompt().startswith("the object is in row 2 column 3 .\nwhat color")


def _mm_item(index, answer, category="cat1", l2="l2a"):
    return Item(
        id=str(index),
        prompt="",
        image=lambda: None,
        meta={
            "answer": answer,
            "choices": dict(CHOICES),
            "category": category,
            "l2_category": l2,
            "question": "q",
        },
    )


def test_mmbench_circular_eval_one_rotation_wrong():
    # question 1: four rotations, answers rotate; all right -> hit. question 2: one rotation wrong -> miss.
    items = [_mm_item(1 + k * 1_000_000, "ABCD"[k]) for k in range(4)]
    items += [_mm_item(2 + k * 1_000_000, "ABCD"[(k + 1) % 4], category="cat2", l2="l2b") for k in range(4)]
    preds = {str(1 + k * 1_000_000): "ABCD"[k] for k in range(4)}
    preds.update({str(2 + k * 1_000_000): "ABCD"[(k + 1) % 4] for k in range(4)})
    assert MMBenchTask().score(items, preds)["circular_accuracy"] == 100.0
    preds[str(2 + 2 * 1_000_000)] = "A"  # the third rotation of question 2 is wrong
    s = MMBenchTask().score(items, preds)
    assert s["circular_accuracy"] == 50.0
    assert s["per_category"] == {"cat1": 100.0, "cat2": 0.0}
    assert s["per_l2_category"] == {"l2a": 100.0, "l2b": 0.0}
    assert s["single_pass_accuracy"] == 100.0 * 7 / 8
    # an extraction miss in a rotation also sinks the question
    preds[str(2 + 2 * 1_000_000)] = "I cannot tell"
    s = MMBenchTask().score(items, preds)
    assert s["circular_accuracy"] == 50.0 and s["num_extraction_misses"] == 1


# ---------------------------------------------------------------- POPE


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Yes", "yes"),
        ("No", "no"),
        ("no", "no"),
        ("Yes, there is a dog.", "yes"),
        ("No, there is not.", "no"),
        ("There is not a dog in the image", "no"),
        ("Yes. No.", "yes"),  # only the first sentence counts
        ("NO", "yes"),  # LLaVA's rule only knows "No", "no", "not"
        ("No.", "no"),
    ],
)
def test_pope_yes_no_extraction(text, expected):
    assert yes_no(text) == expected


def test_pope_metrics_hand_worked():
    labels = ["yes", "yes", "yes", "no", "no"]
    preds = ["Yes", "No", "Yes", "Yes", "No"]  # TP=2 FN=1 FP=1 TN=1
    items = [
        Item(
            id=str(i),
            prompt="",
            image=lambda: None,
            meta={"label": lab, "category": "random", "question_id": i},
        )
        for i, lab in enumerate(labels)
    ]
    s = POPETask().score(items, {str(i): p for i, p in enumerate(preds)})
    assert (s["TP"], s["FP"], s["TN"], s["FN"]) == (2, 1, 1, 1)
    assert s["accuracy"] == pytest.approx(60.0)
    assert s["precision"] == pytest.approx(200 / 3)
    assert s["recall"] == pytest.approx(200 / 3)
    assert s["f1"] == pytest.approx(200 / 3)
    assert s["yes_ratio"] == pytest.approx(60.0)
    assert s["mean_over_categories"]["f1"] == pytest.approx(200 / 3)
