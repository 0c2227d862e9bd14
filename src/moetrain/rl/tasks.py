"""Tasks with verifiable rewards, generated from a seed (no downloads), each with an exact scorer.

- ``addition``: ``"417+038="`` → ``"0455"`` (zero-padded; ``Addition(padded=False)``: ``"417+38="`` → ``"455"``);
- ``sort``: the digits of ``"sort:3914="`` in ascending order → ``"1349"``;
- ``countdown``: reach the target with each given number exactly once, ``+ - * /`` and brackets:
  ``"3,5,7>22="`` → ``"3*5+7"`` (any correct expression scores 1; exact rational arithmetic).

A problem is a function of (seed, purpose, index): ``problem_at`` seeds Python's ``random`` with that
triple, so a resumed run, a test and a benchmark see the same problems without any stored state.

Held-out split: a problem is held out when the SHA-256 of its prompt falls in the first tenth of the
hash range. Training (SFT and RL) draws only the other nine tenths, evaluation only held-out prompts, so
measured accuracy is on prompts the policy never trained on, whatever the seeds.
Torch-free.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
from dataclasses import dataclass
from fractions import Fraction

from moetrain.errors import UserError
from moetrain.rl.gym_tasks import gym_task
from moetrain.rl.problem import Problem, Split, Task


@dataclass(frozen=True)
class Addition:
    max_digits: int = 3
    padded: bool = True
    """Operands zero-padded to ``max_digits`` and the sum to ``max_digits + 1`` digits: every digit then
    sits at a fixed offset, which a tiny model finds far sooner (held-out accuracy after SFT warm-ups of
    several lengths: docs/rl.md)."""
    reversed: bool = False
    """Every number written least-significant digit first."""
    name: str = "addition"

    def sample(self, rng: random.Random) -> Problem:
        # Each operand's digit count is drawn first, so short and long sums are equally common.
        a, b = (rng.randrange(10 ** (rng.randint(1, self.max_digits))) for _ in range(2))
        return Problem(f"{self._show(a, 0)}+{self._show(b, 0)}=", self._show(a + b, 1))

    def _show(self, number: int, extra: int) -> str:
        text = f"{number:0{self.max_digits + extra}d}" if self.padded else str(number)
        return text[::-1] if self.reversed else text

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.max_digits + 2

    @property
    def max_answer_chars(self) -> int:
        return self.max_digits + 1


@dataclass(frozen=True)
class Sort:
    min_digits: int = 3
    max_digits: int = 6
    name: str = "sort"

    def sample(self, rng: random.Random) -> Problem:
        digits = [rng.randrange(10) for _ in range(rng.randint(self.min_digits, self.max_digits))]
        return Problem(f"sort:{''.join(map(str, digits))}=", "".join(map(str, sorted(digits))))

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)

    @property
    def max_prompt_chars(self) -> int:
        return self.max_digits + 6

    @property
    def max_answer_chars(self) -> int:
        return self.max_digits


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}
_SYMBOL = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an expression of integer literals and + - * /; collects the literals in ``used``.
    Raises ValueError on anything else (names, calls, powers, unary minus, division by zero)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed")


@dataclass(frozen=True)
class Countdown:
    num_numbers: int = 3
    max_number: int = 9
    name: str = "countdown"

    def sample(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            expression, previous = str(numbers[0]), None
            for number in numbers[1:]:
                op = rng.choice("+-*")
                # Left to right; brackets only where precedence would otherwise regroup the sum.
                if op == "*" and previous is not None and previous in "+-":
                    expression = f"({expression})"
                expression, previous = f"{expression}{op}{number}", op
            target = _evaluate(ast.parse(expression, mode="eval").body, [])
            if target > 0:  # a positive target keeps the prompt alphabet free of a minus sign
                prompt = f"{','.join(map(str, numbers))}>{int(target)}="
                return Problem(prompt, expression, tuple(numbers), int(target))

    def score(self, problem: Problem, completion: str) -> float:
        text = completion.strip()
        if not text or len(text) > 64 or not set(text) <= set("0123456789+-*/() "):
            return 0.0
        try:
            used: list[int] = []
            value = _evaluate(ast.parse(text, mode="eval").body, used)
        except (SyntaxError, ValueError, RecursionError):
            return 0.0
        return float(sorted(used) == sorted(problem.numbers) and value == problem.target)

    @property
    def max_prompt_chars(self) -> int:
        digits = len(str(self.max_number))
        return self.num_numbers * (digits + 1) + len(str(self.max_number ** self.num_numbers)) + 1

    @property
    def max_answer_chars(self) -> int:
        return self.num_numbers * (len(str(self.max_number)) + 1) + 2 * self.num_numbers


TASKS: dict[str, Task] = {"addition": Addition(), "sort": Sort(), "countdown": Countdown()}


def get_task(name: str) -> Task:
    """A built-in task, or ``rg:<dataset>[:options]`` from reasoning-gym (``moetrain.rl.gym_tasks``)."""
    if name.startswith("rg:"):
        return _gym_task(name)
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; choose one of {', '.join(TASKS)} or rg:<reasoning-gym dataset>")
    return TASKS[name]


def new_tokens_for(task: Task, max_new_tokens: int | None) -> int:
    """Generated tokens per sample at most: ``max_new_tokens`` (``rl.max_new_tokens``), else the task's
    longest answer + 2, the default every RL path (generation, evaluation, the sequence length) takes."""
    return max_new_tokens or task.max_answer_chars + 2


def sequence_len_for(task: Task, max_new_tokens: int) -> int:
    """Input tokens of the longest sample: BOS, prompt and completion, less the last token (never an input)."""
    return 1 + task.max_prompt_chars + max_new_tokens - 1


@functools.cache
def _gym_task(name: str) -> Task:
    return gym_task(name)


def split_of(prompt: str) -> Split:
    """Held out when the prompt's SHA-256 lands in the first tenth of the hash range."""
    head = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big")
    return "heldout" if head < 2**32 // 10 else "train"


def problem_at(task: Task, seed: int, purpose: str, index: int, split: Split = "train") -> Problem:
    """Problem ``index`` of the stream ``purpose`` (e.g. "sft", "rl", "eval"), drawn from ``split`` only."""
    rng = random.Random(f"{task.name}/{seed}/{purpose}/{index}")
    while True:
        problem = task.sample(rng)
        if split_of(problem.prompt) == split:
            return problem


DRY_DRAWS = 1_000
"""A search for distinct held-out problems ends after max(DRY_DRAWS, 10 × found) draws in a row that bring
no new one: the task has run out of them (countdown's three numbers of 1-9 hold about 470)."""


def _dry_limit(found: int) -> int:
    return max(DRY_DRAWS, 10 * found)


def distinct_problems(task: Task, seed: int, purpose: str, count: int,
                      exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """Up to ``count`` distinct held-out problems of the stream ``purpose``, none of them in ``exclude``, in
    the stream's order; fewer where the task's held-out problems run out (``DRY_DRAWS``)."""
    found: dict[str, Problem] = {}
    index = dry = 0
    while len(found) < count and dry < _dry_limit(len(found)):
        problem = problem_at(task, seed, purpose, index, "heldout")
        index += 1
        if problem.prompt in found or problem.prompt in exclude:
            dry += 1
        else:
            found[problem.prompt] = problem
            dry = 0
    return list(found.values())


def heldout_problems(task: Task, seed: int, count: int) -> list[Problem]:
    """A fixed evaluation set of ``count`` distinct held-out problems; refused where the task has fewer."""
    problems = distinct_problems(task, seed, "eval", count)
    if len(problems) < count:
        raise UserError(f"--eval-size {count}: the {task.name} task gave only {len(problems)} distinct held-out "
                        f"problems ({_dry_limit(len(problems)):,} draws in a row brought no new one); give "
                        f"--eval-size {len(problems)} or less")
    return problems
