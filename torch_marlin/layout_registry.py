"""The table of weight layouts (torch_marlin/layouts/), filled as each registers itself.

It imports nothing of the package: the layouts register here
(`torch_marlin.layouts.register_layout`), and code on the floors below them
(the quantizers: gptq.py, sparsegpt.py) finds a layout here by name or by
sparsity to pack its codes, instead of importing the layout.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Type

# LAYOUT_CODE -> class, LAYOUT name -> class and sparsity string ("2:4") -> class.
_LAYOUTS: Dict[int, Type] = {}
_NAMES: Dict[str, Type] = {}
_SPARSITIES: Dict[str, Type] = {}


def register_layout(cls: Type) -> Type:
    """Class decorator: makes a layout known to MarlinLinear's state_dict guard
    (and, if it sets SPARSITY, to `sparsity=` arguments)."""
    if cls.LAYOUT_CODE in _LAYOUTS:
        raise ValueError(f"layout code {cls.LAYOUT_CODE} is taken by {_LAYOUTS[cls.LAYOUT_CODE].__name__}")
    if cls.LAYOUT in _NAMES:
        raise ValueError(f"layout name {cls.LAYOUT!r} is taken by {_NAMES[cls.LAYOUT].__name__}")
    if cls.SPARSITY is not None and cls.SPARSITY in _SPARSITIES:
        raise ValueError(f"sparsity {cls.SPARSITY!r} is taken by {_SPARSITIES[cls.SPARSITY].__name__}")
    _LAYOUTS[cls.LAYOUT_CODE] = cls
    _NAMES[cls.LAYOUT] = cls
    if cls.SPARSITY is not None:
        _SPARSITIES[cls.SPARSITY] = cls
    return cls


def layout_for_sparsity(sparsity: Optional[str]) -> Optional[Type]:
    """The layout class of a `sparsity=` argument ("2:4"); None for None (dense)."""
    if sparsity is None:
        return None
    if not isinstance(sparsity, str) or sparsity not in _SPARSITIES:
        raise ValueError(f"sparsity must be None or one of {sorted(_SPARSITIES)}, got {sparsity!r}")
    return _SPARSITIES[sparsity]


def layout_named(name: str) -> Type:
    """The layout class whose LAYOUT is `name` ("dense", "sparse24", ...)."""
    if name not in _NAMES:
        raise ValueError(f"layout must be one of {sorted(_NAMES)}, got {name!r}")
    return _NAMES[name]


def layout_by_code(code: int) -> Optional[Type]:
    return _LAYOUTS.get(code)


def known_layout_codes() -> List[int]:
    return sorted(_LAYOUTS)
