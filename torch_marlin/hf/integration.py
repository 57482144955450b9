"""transformers integration: `quant_method: "torch_marlin"` for from_pretrained/save_pretrained.

After `register()` (called by `import torch_marlin` when transformers is
installed):
- `AutoModel*.from_pretrained(converted_dir)` builds the model on the meta
  device, swaps the listed linear layers for MarlinLinear and loads the
  packed tensors;
- `AutoModel*.from_pretrained(float_dir, quantization_config=MarlinConfig(...))`
  loads the float weights and quantizes the linear layers (peak memory is the
  float model; use `torch-marlin convert` for streaming);
- `model.save_pretrained(dir)` writes a directory that loads again.

Without `import torch_marlin`, transformers skips the unknown quant_method with
a warning and returns the float model with the quantized layers randomly
initialised; a checkpoint cannot prevent that (docs/CONVERT.md, Load).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import List, Optional

from .. import formats
from ..quantize import quantizer_names
from .config import FORMAT_VERSION, QUANT_METHOD, validate_quantization_config

_CLASSES = {}  # "config" / "quantizer": defined on first registration (they subclass transformers')


def register() -> bool:
    """Register MarlinConfig and MarlinHfQuantizer with transformers; False if it is not installed."""
    if _CLASSES:
        return True
    try:
        from transformers.quantizers import auto as quantizer_auto
    except ImportError:
        return False
    config_cls, quantizer_cls = _define_classes()
    # Another copy of torch_marlin (e.g. reloaded) may have registered already: replace it.
    quantizer_auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
    quantizer_auto.AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
    quantizer_auto.register_quantization_config(QUANT_METHOD)(config_cls)
    quantizer_auto.register_quantizer(QUANT_METHOD)(quantizer_cls)
    _CLASSES.update(config=config_cls, quantizer=quantizer_cls)
    return True


_HOOKED_MODULE = "transformers.quantizers.auto"


class _RegisterWhenTransformersLoads(importlib.abc.MetaPathFinder):
    """Registers torch_marlin right after transformers' quantizer registry is imported,
    so `import torch_marlin` costs nothing when transformers is never used."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _HOOKED_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            try:
                register()
            except Exception as e:  # noqa: BLE001  (a transformers API change must not break its import)
                import warnings

                warnings.warn(f"torch_marlin could not register with transformers: {e}")

        spec.loader.exec_module = exec_module
        return spec


def enable_transformers_integration() -> None:
    """Hook for `torch_marlin/__init__.py`: register now if transformers' quantizers are
    already imported, otherwise as soon as they are. Never imports transformers itself."""
    if _HOOKED_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterWhenTransformersLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenTransformersLoads())


def marlin_config(**kwargs):
    """A transformers quantization config for torch_marlin (registers the integration)."""
    if not register():
        raise ImportError("transformers is required for MarlinConfig: pip install 'torch_marlin[hf]'")
    return _CLASSES["config"](**kwargs)


def _define_classes():
    from transformers.quantizers.base import HfQuantizer

    from ..layouts.rans import GRID_KINDS
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class MarlinConfig(QuantizationConfigMixin):
        """torch_marlin quantization config.

        For quantize-on-load give weight_format / group_size / quantizer /
        modules_to_not_convert; a converted checkpoint's config also carries
        the per-layer `modules` table (see torch_marlin/hf/config.py).
        """

        def __init__(self, weight_format: str = "fp4", group_size: int = 128, quantizer: str = "mse",
                     modules_to_not_convert: Optional[List[str]] = None, modules: Optional[dict] = None,
                     format_version: int = FORMAT_VERSION, source: Optional[dict] = None,
                     fuse_projections: bool = False, **kwargs):
            if modules is None or weight_format not in GRID_KINDS:  # only name converted entropy-coded layers
                formats.check_weight_format(weight_format)
                formats.check_group_size(group_size)
            if quantizer not in quantizer_names():  # quantize-on-load has no calibration data
                raise ValueError(f"quantizer must be one of {quantizer_names()}, got {quantizer!r}")
            if modules_to_not_convert is not None and not all(isinstance(m, str) for m in modules_to_not_convert):
                raise TypeError(f"modules_to_not_convert must be a list of names, got {modules_to_not_convert!r}")
            self.quant_method = QUANT_METHOD
            self.format_version = format_version
            self.weight_format = weight_format
            self.group_size = group_size
            self.quantizer = quantizer
            self.modules_to_not_convert = list(modules_to_not_convert or [])
            self.modules = modules
            self.source = source or {"method": "float", "quantizer": quantizer}
            if not isinstance(fuse_projections, bool):
                raise TypeError(f"fuse_projections must be a bool, got {fuse_projections!r}")
            self.fuse_projections = fuse_projections  # fuse q|k|v, gate|up after loading
            if modules is not None:
                validate_quantization_config(self.to_dict())

        def to_dict(self):
            return {k: v for k, v in super().to_dict().items() if not k.startswith("_")}

    class MarlinHfQuantizer(HfQuantizer):
        requires_calibration = False

        def _process_model_before_weight_loading(self, model, **kwargs):
            from .modules import replace_with_empty_marlin

            if self.pre_quantized:
                table = validate_quantization_config(self.quantization_config.to_dict())
                replace_with_empty_marlin(model, table, device="meta")
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            from .modules import check_loaded, default_skips, keep_stacks_on_save, quantize_linear_modules

            qc = self.quantization_config
            if self.pre_quantized:
                check_loaded(model)
                if qc.fuse_projections:
                    from ..fused_projections import fuse_projections

                    self.fused_projections = bool(fuse_projections(model))
                return model
            skips = default_skips(model, qc.modules_to_not_convert)
            qc.modules = quantize_linear_modules(model, qc.weight_format, qc.group_size, qc.quantizer, skips)
            qc.modules_to_not_convert = sorted(set(skips))
            keep_stacks_on_save(model)
            return model

        def is_serializable(self, *args, **kwargs):
            # A fused model's state dict holds the fused tensors, which the per-layer modules
            # table does not describe: refuse to save it rather than write an unloadable checkpoint.
            if getattr(self, "fused_projections", False):
                warnings.warn("this model's projections are fused (torch_marlin.fused_projections) and are not "
                              "saved fused: load the checkpoint without fusing to save it", stacklevel=2)
                return False
            return True

        @property
        def is_trainable(self):
            return False

    MarlinConfig.__module__ = MarlinHfQuantizer.__module__ = __name__
    return MarlinConfig, MarlinHfQuantizer
