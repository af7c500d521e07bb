"""What a worker needs to load a model and score with it: plain data, shared by the driver and the actors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ModelSpec(BaseModel):
    """Everything that decides which weights a worker holds (and so belongs in the result-cache key)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field(description="local model folder or Hugging Face repo id")
    adapter_path: str | None = None
    revision: str | None = None
    dtype: str | None = None
    max_length: int | None = Field(default=None, gt=1)
    trust_remote_code: bool = False

    def load(self):
        from .load import load

        return load(
            self.model,
            adapter_path=self.adapter_path,
            max_length=self.max_length,
            dtype=self.dtype,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
        )


class Batching(BaseModel):
    """How a worker cuts its requests into forward passes; never changes a number, only speed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(default=32, ge=1, description="most rows in one forward")
    max_batch_tokens: int = Field(default=8192, ge=1, description="most padded tokens in one forward")
    prefix_reuse: bool = Field(default=True, description="compute a prefix shared by many requests once")
