"""Errors of the Hugging Face pipeline (reading, converting and loading checkpoints)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or not what its config says."""


class UnsupportedQuantization(CheckpointError):
    """The source's quantization config or tensors describe something we cannot repack."""
