"""Training hyper-parameters and run options for ``moetrain train``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    steps: int = Field(default=200, gt=0)
    """Total optimizer steps of the run; sets the learning-rate schedule."""
    global_batch: int = Field(default=16, gt=0)
    """Sequences per optimizer step, whatever the parallel layout."""
    micro_batch: int = Field(default=4, gt=0)
    seq_len: int = Field(default=128, gt=0)
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0)
    seed: int = Field(default=1234, ge=0, lt=2**32)  # numpy's generators refuse a negative seed, torch's a 65-bit one
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on GPU, fp32 on CPU."""

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainingConfig:
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch={self.global_batch} is not a multiple of micro_batch={self.micro_batch}"
            )
        return self
