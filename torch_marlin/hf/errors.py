"""Errors of the Hugging Face pipeline (reading, converting and loading checkpoints)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or not what its config says."""


class UnsupportedQuantization(CheckpointError):
    """The source's quantization config or tensors describe something we cannot repack."""


class MissingDependency(ImportError):
    """An optional dependency (the `hf` extra) that this operation needs is not installed."""


def import_transformers(purpose: str):
    """The transformers module, or MissingDependency saying that `purpose` needs it."""
    try:
        import transformers
    except ImportError as e:
        raise MissingDependency(f"{purpose} needs transformers, which is not installed; install the hf extra: "
                                f"pip install 'torch_marlin[hf]' (in a source checkout: "
                                f"pip install --no-build-isolation '.[hf]')") from e
    return transformers
