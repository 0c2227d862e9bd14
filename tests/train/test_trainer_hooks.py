"""A trainer of another objective changes the loop through ``Trainer``'s extension points only: a batch
source it is given, ``next_batch``, ``note``, ``after_step`` and ``finished`` (as the RL trainers do)."""

import io

from rich.console import Console

from moetrain.config import TrainingConfig, load_model_config
from moetrain.config.run import RunSpec
from moetrain.data.synthetic import SyntheticDataset
from moetrain.train import Trainer

TRAINING = TrainingConfig(steps=5, global_batch=4, micro_batch=2, seq_len=32, lr=3e-3, warmup_steps=2)
LOSS_FIELDS = ("loss", "lm_loss", "aux_loss", "lr", "grad_norm")


class RecordedSource:
    """A batch source of the caller's: the synthetic batches, keeping the steps they were asked for."""

    def __init__(self, vocab_size: int) -> None:
        self.inner = SyntheticDataset(vocab_size, TRAINING.seq_len, TRAINING.seed)
        self.steps: list[int] = []

    def step_batch(self, step, global_batch, micro_batch, dp_rank=0, dp_size=1):
        self.steps.append(step)
        return self.inner.step_batch(step, global_batch, micro_batch, dp_rank, dp_size)


class HookedTrainer(Trainer):
    """Notes a field from its batch and one from every second update; stops after three steps."""

    def next_batch(self):
        self.note(batch_step=self.step)
        return super().next_batch()

    def after_step(self):
        if self.step % 2 == 0:
            self.note(even_update=self.step)
        return {**super().after_step(), "updated_to": self.step}

    def finished(self) -> bool:
        return self.step >= 3


def _spec(**run) -> RunSpec:
    return RunSpec(training=TRAINING, run={"device": "cpu", "cluster": "cpu", "quiet": True, **run})


def test_a_subclass_on_the_hooks_trains_its_given_batches_as_the_plain_loop():
    plain = Trainer(_spec(synthetic_data=True), console=Console(file=io.StringIO())).train()
    source = RecordedSource(load_model_config(_spec().model).vocab_size)
    # no corpus is read when the batches are given: the data path is never opened
    hooked = HookedTrainer(_spec(data="/nonexistent/corpus.jsonl"), console=Console(file=io.StringIO()),
                           batches=source)
    rows = hooked.train()
    assert source.steps == [0, 1, 2]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [{k: r[k] for k in LOSS_FIELDS} for r in rows] == [{k: r[k] for k in LOSS_FIELDS} for r in plain[:3]]
    assert [r["batch_step"] for r in rows] == [0, 1, 2] and [r["updated_to"] for r in rows] == [1, 2, 3]
    # a noted field belongs to its own step's row only
    assert [r.get("even_update") for r in rows] == [None, 2, None]
