import itertools
import random

import pytest

from moetrain.errors import UserError
from moetrain.rl.tasks import (
    TASKS,
    Addition,
    Countdown,
    Problem,
    Sort,
    get_task,
    heldout_problems,
    problem_at,
    split_of,
)
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.rl.warmup import validation_problems


@pytest.mark.parametrize("name", sorted(TASKS))
def test_reference_answers_score_one_and_problems_follow_the_seed(name):
    task = TASKS[name]
    problems = [problem_at(task, 7, "rl", i) for i in range(50)]
    assert problems == [problem_at(task, 7, "rl", i) for i in range(50)]
    assert problems != [problem_at(task, 8, "rl", i) for i in range(50)]
    for problem in problems:
        assert task.score(problem, problem.answer) == 1.0
        assert task.score(problem, problem.answer + "1") == 0.0
        assert len(problem.prompt) <= task.max_prompt_chars and len(problem.answer) <= task.max_answer_chars
        CharTokenizer().encode(problem.prompt + problem.answer)  # every character has an id


def test_training_never_draws_a_heldout_prompt():
    task = get_task("addition")
    heldout = {p.prompt for p in heldout_problems(task, 0, 100)}
    assert len(heldout) == 100 and all(split_of(p) == "heldout" for p in heldout)
    trained = {problem_at(task, 0, purpose, i).prompt for purpose in ("sft", "rl") for i in range(2000)}
    assert not trained & heldout
    assert all(split_of(p) == "train" for p in trained)


def test_addition_formats():
    rng = random.Random(0)
    plain, padded = Addition(max_digits=3, padded=False), Addition(max_digits=3)
    assert plain.score(Problem("417+38=", "455"), " 455 ") == 1.0
    problem = padded.sample(rng)
    a, b = (int(x) for x in problem.prompt[:-1].split("+"))
    assert len(problem.prompt) == 8 and problem.answer == f"{a + b:04d}"
    reversed_ = Addition(max_digits=2, padded=True, reversed=True)
    assert reversed_._show(47, 1) == "740"


def test_sort_scores_exactly():
    task = Sort()
    problem = Problem("sort:3914=", "1349")
    assert task.score(problem, "1349") == 1.0 and task.score(problem, "1394") == 0.0


def test_countdown_accepts_any_correct_expression_and_nothing_else():
    task = Countdown()
    problem = Problem("3,5,7>22=", "3*5+7", (3, 5, 7), 22)
    for good in ("3*5+7", "7+5*3", "(7+5*3)", "5*3+7"):
        assert task.score(problem, good) == 1.0, good
    for bad in ("3*5+8", "3*5", "3*5+7+7", "22", "3**5", "__import__('os')", "3*5+7/0", "(3*5+7", "", "3 5 7"):
        assert task.score(problem, bad) == 0.0, bad
    assert task.score(Problem("4,2,3>6=", "4/2*3", (4, 2, 3), 6), "4/2*3") == 1.0  # exact rationals


def _every_heldout_countdown_prompt() -> set[str]:
    """Countdown's whole problem space enumerated, apart from its sampler: three numbers of 1-9, two of + - *
    applied left to right (a product after a sum brackets the sum), a positive target; then the held-out
    tenth of the hash split."""
    prompts = set()
    for numbers in itertools.product(range(1, 10), repeat=3):
        for ops in itertools.product("+-*", repeat=2):
            value = numbers[0]
            for op, number in zip(ops, numbers[1:], strict=True):
                value = value + number if op == "+" else value - number if op == "-" else value * number
            if value > 0:
                prompts.add(f"{','.join(map(str, numbers))}>{value}=")
    return {p for p in prompts if split_of(p) == "heldout"}


def test_an_evaluation_set_beyond_the_tasks_heldout_problems_is_refused_with_their_count():
    everything = _every_heldout_countdown_prompt()
    assert len(everything) == 474
    task = get_task("countdown")
    assert {p.prompt for p in heldout_problems(task, 0, 474)} == everything  # the search finds every one
    with pytest.raises(UserError) as caught:
        heldout_problems(task, 0, 2000)
    assert str(caught.value) == ("--eval-size 2000: the countdown task gave only 474 distinct held-out problems "
                                 "(4,740 draws in a row brought no new one); give --eval-size 474 or less")
    # the warm-up's validation set takes what the evaluation set leaves, and says how many it checks on
    evaluation = heldout_problems(task, 0, 256)
    validation = validation_problems(task, 0, 256, evaluation)
    assert {p.prompt for p in validation} == everything - {p.prompt for p in evaluation}


def test_unknown_task_is_a_user_error():
    with pytest.raises(UserError, match="unknown task 'multiply'"):
        get_task("multiply")


def test_tokenizer_round_trip_and_vocab_check():
    tok = CharTokenizer()
    ids = [tok.bos_id] + tok.encode("12+3=15") + [tok.eos_id] + tok.encode("9")
    assert tok.decode(ids) == "12+3=15"  # BOS skipped, stops at EOS
    with pytest.raises(UserError, match="not in the task alphabet"):
        tok.encode("12#")
    with pytest.raises(UserError, match="vocabulary of 10"):
        tok.check_fits(10, "toy")
